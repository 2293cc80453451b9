"""Scoring protocols: the left context each position reads under sliding windows and segments,
checked against a per-position reference loop."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gnnlm.models import protocols
from gnnlm.models.encode import sliding_windows


def _window_reference(n: int, context: int, stride: int) -> np.ndarray:
    starts, score_from = sliding_windows(n, context, stride)
    left = np.full(n, -1)
    for w, (start, first) in enumerate(zip(starts, score_from)):
        end = score_from[w + 1] if w + 1 < len(starts) else n
        for t in range(first, end):
            left[t] = t - start
    return left


def _segment_reference(n: int, streams: int, segment: int, memory: int) -> np.ndarray:
    length = math.ceil(n / streams)
    left = np.empty(n, dtype=np.int64)
    for t in range(n):
        offset = t % length                       # place in its stream
        seg_start = offset // segment * segment
        left[t] = (offset - seg_start) + min(memory, seg_start)
    return left


@pytest.mark.parametrize("n,context,stride", [(1000, 128, 64), (1000, 128, 128), (90, 128, 64),
                                              (777, 64, 16)])
def test_sliding_window_left_context(n, context, stride):
    left = protocols.left_context(protocols.sliding_window(context, stride), n)
    np.testing.assert_array_equal(left, _window_reference(n, context, stride))
    if n > context:  # at least C - S after the first window
        assert left[context:].min() >= context - stride


@pytest.mark.parametrize("n,streams,segment,memory", [(1000, 16, 128, 0), (1000, 16, 128, 128),
                                                      (5003, 7, 64, 32), (100, 1, 16, 200)])
def test_segment_left_context(n, streams, segment, memory):
    left = protocols.left_context(protocols.segments(segment, streams, memory), n)
    np.testing.assert_array_equal(left, _segment_reference(n, streams, segment, memory))


def test_the_demo_protocols_give_the_left_contexts_they_are_reported_with():
    """WikiText-2's test split (245,569 tokens): the sliding window of the CPU demo reads
    about 95.5 tokens, a transformer on 16 cold-start streams of 128-token segments 63.5, and
    Transformer-XL with M = 128 about 190: memory is more context."""
    n = 245_569
    window = protocols.left_context(protocols.sliding_window(128, 64), n).mean()
    plain = protocols.left_context(protocols.segments(128, 16, 0), n).mean()
    xl = protocols.left_context(protocols.segments(128, 16, 128), n).mean()
    assert window == pytest.approx(95.5, abs=0.05)
    assert plain == pytest.approx(63.5, abs=0.05)
    assert 185 < xl < 191.5
    # more streams, more cold starts: the segment protocol depends on the number of streams
    assert protocols.left_context(protocols.segments(128, 256, 128), n).mean() < xl - 5


def test_layout_ignores_only_the_memory():
    a, b = protocols.segments(128, 16, 0), protocols.segments(128, 16, 128)
    assert protocols.layout(a) == protocols.layout(b)
    assert protocols.layout(a) != protocols.layout(protocols.segments(128, 32, 0))
    assert protocols.layout(a) != protocols.layout(protocols.sliding_window(128, 64))
