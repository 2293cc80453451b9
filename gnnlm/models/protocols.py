"""How a report row's tokens were scored, and how much left context each token had.

Every row of a report scores every position of the split once, but not every row reads the same
context: the base LM, kNN-LM and GNN-LM rows read sliding windows (``gnnlm.models.encode``), while
the Transformer-XL comparison's rows read the split as contiguous segments of parallel streams, with
or without the memory of the previous segment. A protocol is recorded with each row as a plain
dict, one of

- ``{"kind": "sliding_window", "context": C, "stride": S, "bos_each_window": bool}``;
- ``{"kind": "segments", "segment": T, "streams": S, "memory": M}``: the split cut into S
  contiguous streams, each read T tokens at a time with M cached states of the previous segment
  of its stream (Transformer-XL; M = 0: each segment alone). Every stream starts cold.

Rows are comparable when their protocols share a ``layout`` (everything but the memory, which is
the model's); ``left_context`` gives, per scored position, the number of earlier tokens its
prediction attends to directly (the window's or segment's tokens before it plus the memory;
the receptive field of a multi-layer Transformer-XL reaches further).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from gnnlm.models.encode import sliding_windows

Protocol = dict[str, Any]


def sliding_window(context: int, stride: int, bos_each_window: bool = False) -> Protocol:
    return {"kind": "sliding_window", "context": int(context), "stride": int(stride),
            "bos_each_window": bool(bos_each_window)}


def segments(segment: int, streams: int, memory: int) -> Protocol:
    return {"kind": "segments", "segment": int(segment), "streams": int(streams),
            "memory": int(memory)}


def of_features(manifest: dict) -> Protocol:
    """The sliding-window protocol a features artifact was encoded with."""
    config = manifest["config"]
    return sliding_window(config["context"], config["stride"],
                          config.get("bos_each_window", False))


def layout(protocol: Protocol) -> tuple:
    """What must be equal for two rows to share a table: the protocol without the memory."""
    return tuple(sorted((k, v) for k, v in protocol.items() if k != "memory"))


def left_context(protocol: Protocol, n: int) -> np.ndarray:
    """[n] int64: for each of the split's n positions, the earlier tokens its prediction
    attends to directly under ``protocol`` (BOS counted as a token)."""
    if protocol["kind"] == "sliding_window":
        context = min(protocol["context"], n)
        starts, score_from = sliding_windows(n, context, min(protocol["stride"], context))
        ends = np.append(score_from[1:], n)                 # window w scores [score_from, end)
        window_start = np.repeat(starts, ends - score_from)
        return np.arange(n, dtype=np.int64) - window_start
    if protocol["kind"] == "segments":
        length = math.ceil(n / protocol["streams"])         # positions per stream
        in_stream = np.arange(n, dtype=np.int64) % length
        segment = protocol["segment"]
        before = in_stream // segment * segment             # the stream's tokens before the segment
        return in_stream % segment + np.minimum(protocol["memory"], before)
    raise ValueError(f"Unknown scoring protocol {protocol!r}.")


def describe(protocol: Protocol, with_memory: bool = True,
             mean_left_context: float | None = None) -> str:
    """One line for a report's table header (with the mean left context when given)."""
    if protocol["kind"] == "sliding_window":
        c, s = protocol["context"], protocol["stride"]
        bos = " (BOS first in every window)" if protocol.get("bos_each_window") else ""
        mean = ("" if mean_left_context is None else
                f"mean {mean_left_context:.1f} on test; ")
        return (f"sliding windows of {c} tokens{bos}, stride {s}: every token scored once, with "
                f">= {c - s} tokens of left context ({mean}all of it near the split's start)")
    if protocol["kind"] == "segments":
        memory = (f", memory of the previous {protocol['memory']} tokens carried"
                  if with_memory and protocol["memory"] else "")
        return (f"contiguous segments: the split cut into {protocol['streams']} streams, each "
                f"read {protocol['segment']} tokens at a time from a cold start{memory}; every "
                f"token scored once")
    return f"unrecorded protocol ({protocol.get('reason', 'no record')})"
