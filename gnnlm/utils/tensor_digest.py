"""An exact digest of tensors' bits, cheap enough to take before every use of a cache computed
from weights (``gnnlm.gnn.window_states``, ``gnnlm.gnn.dense.fold``).

A parameter's ``_version`` counter misses writes that go around autograd: through ``p.data``
(``p.data.copy_(...)``, ``p.data.mul_(...)``: ``.data`` is a new tensor with a counter of its
own) and fused optimiser kernels (``AdamW(fused=True)`` on the CPU with torch 2.13;
``tests/gnn/test_window_states.py`` has one of each). A cache keyed on it can then serve values
of weights that no longer exist. The digest reads the bits themselves: on the CPU, the sha256 of
each tensor's bytes (read in place, 1.4 GB/s on one core here); elsewhere (a GPU), a weighted
sum of its elements' bit patterns computed where they are, so that nothing is copied back but
one integer per tensor.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Optional

import torch
from torch import Tensor

# Odd multipliers by element position (golden-ratio stepping, made odd), for the on-device sum.
_STEP = -7046029254386353131      # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_COEFFICIENTS: dict[torch.device, Tensor] = {}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: Tensor) -> Tensor:
    """The tensor's elements as integers of the same width, flat (a bool as a byte)."""
    flat = t.detach().reshape(-1)
    return flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(
        _BITS[flat.element_size()])


def _coefficients(n: int, device: torch.device) -> Tensor:
    kept = _COEFFICIENTS.get(device)
    if kept is None or kept.numel() < n:
        kept = (torch.arange(max(n, 1024), dtype=torch.int64, device=device) * _STEP) | 1
        _COEFFICIENTS[device] = kept
    return kept[:n]


def weighted_bit_sum(t: Tensor) -> Tensor:
    """Σ_i c_i·b_i modulo 2^64 (a 0-d int64 tensor on ``t``'s device) over the bit patterns b_i
    of its elements, with odd c_i: a change of any one element changes it, as c_i is invertible
    modulo 2^64; so does almost any change of several."""
    bits = _bits(t)
    return (bits.to(torch.int64) * _coefficients(bits.numel(), bits.device)).sum()


def tensor_digest(tensors: Iterable[Optional[Tensor]]) -> tuple:
    """One entry per tensor (None for None): its dtype, shape and device, and the sha256 of its
    bytes (CPU) or its ``weighted_bit_sum`` (other devices, all read back at once). Tensors
    swapped with one another change the tuple."""
    entries: list = []
    on_device: list[tuple[int, Tensor]] = []
    for t in tensors:
        if t is None:
            entries.append(None)
            continue
        meta = (str(t.dtype), tuple(t.shape), str(t.device))
        if t.device.type == "cpu":
            data = _bits(t.contiguous()).numpy()   # the tensor's own memory, not a copy
            entries.append((meta, hashlib.sha256(data.data).hexdigest()))
        else:
            on_device.append((len(entries), weighted_bit_sum(t)))
            entries.append(meta)
    if on_device:
        sums = torch.stack([s for _, s in on_device]).cpu().tolist()
        for (at, _), value in zip(on_device, sums):
            entries[at] = (entries[at], value)
    return tuple(entries)


def autocast_state(device: torch.device) -> tuple:
    """``(enabled, dtype)`` of autocast on ``device``'s type now: part of the key of a value
    cached from matrix products, which autocast computes in another dtype (a bf16 map read
    under float32, or the reverse, would be an error or other numbers)."""
    enabled = torch.is_autocast_enabled(device.type)
    return enabled, str(torch.get_autocast_dtype(device.type)) if enabled else None
