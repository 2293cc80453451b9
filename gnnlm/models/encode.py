"""Sliding-window encoding of a whole split with a frozen base LM.

A split of N tokens is scored as the stream ``[bos] + tokens``: position t reads stream[t] (and
everything before it) and predicts tokens[t] (its *value*, the next token of the stream). Windows
of length C start every S positions; the first window scores all its positions, every later
window only its last S, and the final window is shifted left so that it is full length. Every
position is therefore encoded exactly once, with at least C - S tokens of left context (or all
of its left context, when that is shorter), whatever the batch size or chunking.

Models trained with a beginning-of-sequence token before every sequence (Llama, Mistral,
Gemma, OPT) read it first in every window (``bos_each_window``): the window's first slot holds
BOS instead of its stream token, so scored positions keep >= C - S - 1 tokens of left context
after it (this needs S < C). Models without one (GPT-2, Pythia, Qwen2, Phi) start windows
mid-text, as they were trained.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from gnnlm.models.base import BaseLM
from gnnlm.utils.metrics import target_nll


def check_protocol(context: int, stride: int, max_context: int | None = None,
                   bos_each_window: bool = False) -> None:
    if context <= 0 or not 0 < stride <= context:
        raise ValueError(f"need 0 < stride <= context (got context={context}, stride={stride}).")
    if bos_each_window and stride >= context:
        raise ValueError(f"features.stride must be below features.context when every window "
                         f"starts with the model's BOS token (got context={context}, "
                         f"stride={stride}).")
    if max_context is not None and context > max_context:
        raise ValueError(f"context {context} exceeds the base LM's context length {max_context}.")


def protocol(context: int, stride: int, bos_each_window: bool = False) -> str:
    if bos_each_window:
        return (f"sliding window: context {context} (BOS first in every window), stride "
                f"{stride}; every token scored once with >= {context - stride - 1} tokens of "
                f"left context after BOS (all of it near the split's start)")
    return (f"sliding window: context {context}, stride {stride}; every token scored once with "
            f">= {context - stride} tokens of left context (all of it near the split's start)")


def sliding_windows(n_positions: int, context: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Window ``w`` covers ``[starts[w], starts[w] + C)`` and scores ``[score_from[w], end)``."""
    check_protocol(context, stride)
    if n_positions <= context:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    n_windows = 1 + -(-(n_positions - context) // stride)                  # ceil division
    starts = np.arange(n_windows, dtype=np.int64) * stride
    score_from = starts + context - stride
    score_from[0] = 0
    starts[-1] = n_positions - context  # keep every window full length (uniform batches)
    return starts, score_from


def open_with_bos(windows: Tensor, bos_id: int) -> Tensor:
    """A copy of ``windows [..., C]`` whose first slot is BOS (models trained with a BOS before
    every sequence; see the module docstring)."""
    windows = windows.clone()
    windows[..., 0] = bos_id
    return windows


def stream_tensor(tokens: np.ndarray, bos_id: int) -> Tensor:
    """``[bos] + tokens`` as int64, the input stream whose position t predicts tokens[t]."""
    stream = np.empty(len(tokens) + 1, dtype=np.int64)
    stream[0] = bos_id
    stream[1:] = tokens
    return torch.from_numpy(stream)


class EncodedBatch(NamedTuple):
    start: int          # first position of this batch's scored span
    final: Tensor       # [n, d] float32
    att: Tensor         # [n, d]
    logprob: Tensor | None  # [n] log p_LM(target) when asked for


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. To a GPU from pinned memory without waiting: a copy from pageable
    memory would first wait for every kernel already queued, so the host could not prepare the
    next batch while the device computes this one."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def encode_windows(model: BaseLM, tokens: np.ndarray, bos_id: int, context: int, stride: int,
                   window_range: tuple[int, int] | None = None, batch_size: int = 8,
                   with_logprob: bool = False, device: str | torch.device = "cpu",
                   bos_each_window: bool = False) -> Iterator[EncodedBatch]:
    """Encode windows ``window_range`` (all by default) in batches, yielding scored spans in order.

    Spans of consecutive batches are contiguous, so callers can write them straight into a
    position-indexed memmap and resume at any window boundary. ``bos_each_window`` puts
    ``bos_id`` in the first slot of every window (see the module docstring). Nothing here waits
    for a GPU: each batch's indices are made on the host before its forward pass, and the
    yielded tensors are still being computed (a caller reading them on the host waits then).
    """
    n = len(tokens)
    context = min(context, n)
    stride = min(stride, context)
    # one window (a split no longer than the context) has no later window to start with BOS
    check_protocol(context, stride, getattr(model, "context_length", None),
                   bos_each_window and n > context)
    starts, score_from = sliding_windows(n, context, stride)
    lo, hi = window_range or (0, len(starts))
    stream = stream_tensor(tokens, bos_id)
    targets = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    device = torch.device(device)
    model.eval()
    for b in range(lo, hi, batch_size):
        w = np.arange(b, min(b + batch_size, hi))
        idx = torch.from_numpy(starts[w])[:, None] + torch.arange(context)[None, :]  # [B, C]
        inputs = open_with_bos(stream[idx], bos_id) if bos_each_window else stream[idx]
        offsets = score_from[w] - starts[w]                       # first scored slot per window
        ends = np.minimum(starts[w] + context, n) - starts[w]
        keep = torch.cat([torch.arange(o, e) + i * context for i, (o, e)
                          in enumerate(zip(offsets, ends))])
        feats = model(to_device(inputs, device))
        out = feats.final.device        # a model spread over several GPUs ends on its last
        keep = to_device(keep, out)
        final = feats.final.reshape(-1, feats.final.shape[-1])[keep].float()   # [n_b, d]
        att = feats.att.reshape(-1, feats.att.shape[-1])[keep].float()
        logprob = None
        if with_logprob:
            positions = torch.cat([torch.arange(s + o, s + e) for s, o, e
                                   in zip(starts[w], offsets, ends)])
            logits = model.logits(final)  # float32 (soft-capped where the model is)
            logprob = -target_nll(logits, to_device(targets[positions], logits.device))
        yield EncodedBatch(int(score_from[w[0]]), final, att, logprob)
