"""The sliding-window protocol for text that grows, read from scratch or with a key/value cache.

Scoring a split (``gnnlm.models.encode``) cuts it into windows of C tokens every S positions and
shifts the last window left so that it is full: a position's context there depends on where the
split ends. Text that grows token by token has no end, so here every position t reads the window
the same protocol gives it in an unbounded stream::

    window_start(t) = 0                             while t < C
                    = S · (⌊(t − C) / S⌋ + 1)       after: windows start every S positions

which is where the scoring protocol reads every position but those of a split's last window. A
position keeps between C − S and C tokens of left context (all of it near the start), and its
features never depend on what follows it. Models that read BOS first in every window
(``bos_each_window``) have it in each window's first slot, as in scoring.

Two ways to compute them, which agree to float rounding:

- ``stream_features``: from scratch, one forward pass per window (what scoring a prefix does);
- ``StreamDecoder``: incrementally, the current window in the model's key/value cache
  (``BaseLM.step``), one token per step; every S tokens past C the window moves on, and its
  C − S tokens already read are read again into a fresh cache (``slid`` counts those moves).

The stream is ``[bos] + tokens`` (``gnnlm.models.encode.stream_tensor``): stream position t
reads stream[t] and everything before it in its window, and predicts the token after it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from gnnlm.models.base import BaseLM, Features
from gnnlm.models.encode import check_protocol, open_with_bos


def window_start(t: int, context: int, stride: int) -> int:
    """The first stream position of the window that reads position ``t``."""
    return 0 if t < context else stride * ((t - context) // stride + 1)


def _runs(positions: Sequence[int], context: int, stride: int) -> Iterator[tuple[int, list[int]]]:
    """Consecutive ``positions`` grouped by the window that reads them: ``(start, group)``."""
    group: list[int] = []
    start = -1
    for t in positions:
        s = window_start(t, context, stride)
        if group and s != start:
            yield start, group
            group = []
        start = s
        group.append(t)
    if group:
        yield start, group


def _window(stream: Tensor, start: int, end: int, bos_id: int, bos_each_window: bool) -> Tensor:
    """``stream [B, L]`` positions ``start … end − 1``, BOS in the first slot where the model
    reads one first in every window (position 0 holds BOS already)."""
    window = stream[:, start:end]
    return open_with_bos(window, bos_id) if bos_each_window and start > 0 else window


@torch.no_grad()
def stream_features(model: BaseLM, stream: Tensor, positions: Sequence[int], context: int,
                    stride: int, bos_id: int, bos_each_window: bool = False) -> Features:
    """Features (float32 ``[B, len(positions), d]``) of ``positions`` (increasing) of
    ``stream [B, L]``, each read in its window, from scratch: one forward pass per window."""
    check_protocol(context, stride, bos_each_window=bos_each_window)
    final, att = [], []
    for start, group in _runs(positions, context, stride):
        feats = model(_window(stream, start, group[-1] + 1, bos_id, bos_each_window))
        rows = torch.as_tensor(group, device=feats.final.device) - start
        final.append(feats.final[:, rows].float())
        att.append(feats.att[:, rows].float())
    return Features(final=torch.cat(final, dim=1), att=torch.cat(att, dim=1))


class StreamDecoder:
    """The features of a batch of B streams (of one length), appended token by token with the
    model's key/value cache over the current window."""

    def __init__(self, model: BaseLM, context: int, stride: int, bos_id: int,
                 bos_each_window: bool = False):
        check_protocol(context, stride, bos_each_window=bos_each_window)
        self.model, self.context, self.stride = model, context, stride
        self.bos_id, self.bos_each_window = bos_id, bos_each_window
        self.stream: Tensor | None = None   # [B, L], every token so far
        self._cache = None
        self._start = -1                    # the first position of the cached window
        self.slid = 0                       # times the window moved on

    @property
    def length(self) -> int:
        return 0 if self.stream is None else self.stream.shape[1]

    @torch.no_grad()
    def append(self, tokens: Tensor, features_from: int = 0) -> Features:
        """Read ``tokens [B, n]`` after the stream so far: the features (float32) of the new
        positions from ``features_from`` on (the others are only read into the cache where the
        window they end in needs them)."""
        first = self.length
        self.stream = tokens if self.stream is None else torch.cat([self.stream, tokens], dim=1)
        final, att = [], []
        runs = list(_runs(range(first, self.length), self.context, self.stride))
        for i, (start, group) in enumerate(runs):
            wanted = group[-1] >= features_from
            if i < len(runs) - 1 and not wanted:
                continue  # a window the stream has left, whose features nobody reads
            if start != self._start:  # the window moved on: read its earlier tokens afresh
                if self._start >= 0:
                    self.slid += 1
                self._cache, self._start = None, start
                feed = _window(self.stream, start, group[-1] + 1, self.bos_id,
                               self.bos_each_window)
            else:
                feed = self.stream[:, group[0]:group[-1] + 1]
            feats, self._cache = self.model.step(feed, self._cache)
            rows = torch.as_tensor([t for t in group if t >= features_from],
                                   device=feats.final.device) - (group[-1] + 1 - feed.shape[1])
            final.append(feats.final[:, rows].float())
            att.append(feats.att[:, rows].float())
        return Features(final=torch.cat(final, dim=1), att=torch.cat(att, dim=1))
