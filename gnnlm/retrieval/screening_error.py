"""How far a screening score can be from the exact score: the bound ε that lets
``gnnlm.retrieval.exact`` certify a top k found by a fast, rounded product.

A screening score of query q and key k is a matrix product of q and k in float16 (tensor cores)
or float32; the exact score is the float32 product ``gnnlm.retrieval.exact_scores`` defines.
Before its output is rounded, the screening score differs from the exact one by at most ε
(``screening_queries``), the sum of

- the inputs' rounding to float16: |q16 − q|·|k16| + |q|·|k16 − k|;
- the float32 accumulation of d products: Higham's γ_d = d·u/(1 − d·u) times Σ|q_i k_i| for an
  IEEE sum, ``TENSOR_CORE_GAMMAS`` times that on tensor cores, whose adders truncate;
- the exact score's own float32 rounding, γ_d·|q|·|k|;

with Cauchy-Schwarz bounding Σ|q_i k_i| by the product of the norms. A float16 output adds at
most half the gap to the next float16 (``next_up``). The bound rests on the device summing
float16 products in float32, which ``half_products_accumulate_in_float32`` tries before a
float16 screening is used.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

U16, U32 = 2.0 ** -11, 2.0 ** -24   # unit round-off of float16 and float32
F16_SUBNORMAL = 2.0 ** -25          # float16's absolute rounding error below its normal range
SAFETY = 1.01   # on the error bound (a worst case already): its own float64 arithmetic
# float16 products summed in float32 on NVIDIA's tensor cores: a block of n >= 4 products and
# the running sum are added at once, every term aligned to the largest one with the bits below
# its last place dropped, and the sum truncated to float32 (Fasi, Higham, Mikaitis & Pranesh,
# "Numerical behavior of NVIDIA tensor cores", 2021). With S = Σ|q_i k_i|, a block errs by
# less than (n + 1)·2^-23·S (what each term but the largest loses, and the sum's truncation),
# where an IEEE sum errs by up to 2^-24·S per product: over d products at most 2(1 + 1/n)
# <= 2.5 times γ_d·S; a split-K kernel's float32 sums of partial products add under 0.5 γ_d
TENSOR_CORE_GAMMAS = 3.0


def gamma(d: int, u: float) -> float:
    """Higham's γ_d: the relative error bound of a sum of d terms with unit round-off u."""
    return d * u / (1 - d * u)


@dataclass(frozen=True)
class KeyNorms:
    """What ε needs of the keys, from one pass over them: the largest norm of the keys as the
    exact scores read them (float32), and for l2 the largest |k|² as its expansion sums it;
    for a float16 screening the largest norm of the float16 table and of a key's rounding to
    it."""

    largest: float
    squared_largest: float = 0.0
    table_largest: float = 0.0
    table_error: float = 0.0


def screening_queries(q: torch.Tensor, screen: str, metric: str, keys: KeyNorms
                      ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(queries as screened [b, d], ε [b] float64, scale)`` for queries ``q`` [b, d] (float32,
    unit rows for cos): ε bounds |v / scale − s|, a screening score v before its output
    rounding against the exact score s, for every key. A float16 screening scales the queries
    by a power of two (exact) that keeps every score inside float16's range, then rounds
    them."""
    g = gamma(q.shape[1], U32)
    q_norm = torch.linalg.vector_norm(q.double(), dim=1)              # [b]
    if screen == "float32":  # the same inputs; two float32 sums in any order
        eps = 2 * g * q_norm * keys.largest
        if metric == "l2":   # and the two subtractions of -|q - k|², on both sides
            eps = 2 * eps + 4 * U32 * (1 + g) * (
                2 * q_norm * keys.largest + q_norm ** 2 + keys.squared_largest)
        return q, SAFETY * eps, 1.0
    largest = float(q_norm.max()) * keys.table_largest * (1 + U16)
    exponent = math.ceil(math.log2(largest / 2 ** 14)) if largest > 2 ** 14 else 0
    scale = 2.0 ** -exponent
    q_scaled = q * scale
    q16 = q_scaled.half()
    q16_norm = torch.linalg.vector_norm(q16.double(), dim=1)
    q_error = torch.linalg.vector_norm(q16.double() - q_scaled.double(), dim=1)
    scaled_norm = q_norm * scale
    product = q16_norm * keys.table_largest                            # >= |q16 · k16|
    eps = (q_error * keys.table_largest                 # the queries' rounding
           + scaled_norm * keys.table_error             # the keys' rounding
           + TENSOR_CORE_GAMMAS * g * product           # float32 accumulation
           + g * scaled_norm * keys.largest)            # the exact score's own rounding
    return q16, SAFETY * eps / scale, scale


@contextmanager
def full_precision() -> Iterator[None]:
    """float32 products in float32 (no TF32, which a Lightning run may have switched on) and
    float16 products accumulated in float32 (cuBLAS may otherwise reduce in float16); the
    settings as they were after. TF32 is set through the API torch has (``fp32_precision``
    from torch 2.9): a setting made by ``torch.set_float32_matmul_precision`` and restored
    through ``allow_tf32`` leaves a state that torch then refuses to read, as Lightning does
    when it starts on a GPU."""
    matmul = torch.backends.cuda.matmul
    wanted: dict[str, object] = {"allow_fp16_reduced_precision_reduction": False}
    if hasattr(matmul, "fp32_precision"):
        wanted["fp32_precision"] = "ieee"
    else:
        wanted["allow_tf32"] = False
    if hasattr(matmul, "allow_fp16_accumulation"):  # torch >= 2.7: float16 sums in float16
        wanted["allow_fp16_accumulation"] = False
    saved = {name: getattr(matmul, name) for name in wanted}
    for name, value in wanted.items():
        setattr(matmul, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(matmul, name, value)


def half_products_accumulate_in_float32(device: torch.device, d: int, seed: int = 0) -> bool:
    """Whether float16 matrix products on ``device`` stay within the error of float32
    accumulation on tensor cores (``TENSOR_CORE_GAMMAS``·γ_d, the bound the float16 screening
    rests on), tried on d-dimensional rows whose products are positive in the first half and
    negative in the second: their partial sums grow to about d/3 and cancel, so a float16
    accumulator's errors stand out from the small result's own rounding (summed pairwise in
    float16 they exceed the bound 5.6 times at d = 512 and 44 times at d = 64, where random
    rows' exceed it 1.2 and 14 times; float32 sums stay under a hundredth of it)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(32, d, generator=gen).abs().half()
    b = torch.randn(256, d, generator=gen).abs()
    b[:, d // 2:] *= -1
    b = b.half()
    with full_precision():
        s = torch.mm(a.to(device), b.to(device).T).cpu().double()
    exact = a.double() @ b.double().T
    product = (torch.linalg.vector_norm(a.double(), dim=1)[:, None]
               * torch.linalg.vector_norm(b.double(), dim=1)[None])
    g = TENSOR_CORE_GAMMAS * gamma(d, U32)
    # the output's rounding is of the score itself: a float16 sum's errors are of its partials
    bound = g * product + U16 * (exact.abs() + g * product) + F16_SUBNORMAL
    return bool(((s - exact).abs() <= bound).all())


def next_up(t: torch.Tensor) -> torch.Tensor:
    """The next float16 above each finite float16 of ``t``, from its bits (older torch releases
    have no float16 ``nextafter`` on CUDA)."""
    bits = t.view(torch.int16).to(torch.int32)
    up = torch.where(t == 0, torch.ones_like(bits), torch.where(bits >= 0, bits + 1, bits - 1))
    return up.to(torch.int16).view(torch.float16)


def next_down(t: torch.Tensor) -> torch.Tensor:
    """The next float16 or float32 below each finite value of ``t``."""
    if t.dtype == torch.float32:
        return torch.nextafter(t, torch.full_like(t, -math.inf))
    return -next_up(-t)
