"""kNN-LM maths as functions of arrays: p_kNN, the interpolation, the (k, T, λ) sweep and fit.

kNN-LM (Khandelwal et al. 2020; Meng et al. 2022 eq. 5; Xu et al. 2023 eq. 2-3, 6)::

    p_kNN(w) = Σ_{i≤k, v_i = w} exp(s_i / T) / Σ_{i≤k} exp(s_i / T)
    p(w)     = λ · p_kNN(w) + (1 − λ) · p_LM(w)

with s_i the similarity of the i-th neighbour (higher is better: cos, ip or −squared l2) and
v_i its value (the train token after it). Only the target's probability matters for perplexity,
so scoring works on ``hits`` [N, K] (v_i == target) instead of vocabulary-sized tensors;
``knn_support`` forms the distribution where it is not zero (at most k words), which
generation interpolates with the LM's and samples from; ``knn_distribution`` writes it out over
the vocabulary.
The arrays come from a kNN cache (``gnnlm.retrieval.knn_cache``) or from any mapping with
``lm_logprob`` [N], ``sims`` [N, K] and ``hits`` [N, K].

**Invalid neighbours** (id -1 in the neighbours file) are marked by ``sims = -inf``: they get
weight exp(-inf) = 0 in both sums. ``hits`` must be False there. A token whose first k
neighbours hold no hit has log p_kNN = -inf; interpolation with λ < 1 keeps it finite. ``k``
always means the first k neighbours in stored order.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gnnlm.retrieval.settings import (  # noqa: F401  (the grid's settings, importable from here)
    DEFAULT_KS,
    DEFAULT_LAMBDAS,
    check_lambda,
    check_temperature,
    default_temperatures,
    grid_or_point,
)
from gnnlm.utils.devices import torch_device
from gnnlm.utils.metrics import perplexity, ppl_from_logprobs

CACHE_ARRAYS = ("lm_logprob", "sims", "hits")


# -- settings --------------------------------------------------------------------------------
def check_k(k: Any, K: int) -> None:
    values = np.asarray(k)
    if values.size and (values.min() < 1 or values.max() > K or
                        not np.all(values == np.round(values))):
        raise ValueError(f"k (knn.k) must be an integer between 1 and the K = {K} stored "
                         f"neighbours (got {k}); build the neighbours with a larger K for more.")


# -- array helpers ---------------------------------------------------------------------------
def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    array = np.asarray(x)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array)  # read-only memmaps: torch wants writable memory
    t = torch.from_numpy(array)
    return t if dtype is None else t.to(dtype)


def _like(result: torch.Tensor, *inputs: Any) -> Any:
    """Return torch when any input was torch, numpy otherwise."""
    if any(isinstance(x, torch.Tensor) for x in inputs):
        return result
    return result.numpy()


def _arrays(cache: Mapping[str, Any]) -> Mapping[str, Any]:
    missing = [name for name in CACHE_ARRAYS if name not in cache]
    if missing:
        raise ValueError(f"kNN-LM inputs need arrays {CACHE_ARRAYS} (missing {missing}).")
    return cache


# -- the maths -------------------------------------------------------------------------------
def knn_logprob(sims: Any, hits: Any, k: int, temperature: float) -> Any:
    """Log p_kNN(target) [N] from the first k of ``sims`` [N, K] and ``hits`` bool [N, K].

    Invalid neighbours carry ``sims = -inf``; rows with no hit among them give -inf.
    """
    check_k(k, sims.shape[1])
    check_temperature(temperature)
    s = _tensor(sims, torch.float32)[:, :k] / temperature              # [N, k]
    h = _tensor(hits, torch.bool)[:, :k]
    total = torch.logsumexp(s, dim=1)                                  # [N], -inf: no neighbour
    hit = torch.logsumexp(s.masked_fill(~h, -math.inf), dim=1)         # [N], -inf: no hit
    # No hit is -inf even when there is also no neighbour (-inf - -inf would be nan).
    out = torch.where(torch.isneginf(hit), torch.full_like(hit, -math.inf), hit - total)
    return _like(out, sims, hits)


def knn_support(sims: Any, values: Any, k: int, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """p_kNN where it is not zero: ``(words [N, k], log p_kNN [N, k])``, the value of each of
    the first k neighbours and the log-probability of that word (-inf at a missing neighbour,
    whose word is 0), from ``sims`` [N, K] and ``values`` [N, K] (-1: no neighbour).

    p_kNN(w) sums softmax(s / T) over the neighbours whose value is w; here in log space, as
    ``knn_logprob`` computes it for the target alone (so the two agree at the target): the
    neighbours sorted by value, each run of one value is a word, whose log-probability is the
    logsumexp of its scores minus the logsumexp of all k. Everything is [N, k]: the vocabulary
    is not touched.
    """
    check_k(k, sims.shape[1])
    check_temperature(temperature)
    s = _tensor(sims, torch.float32)[:, :k] / temperature                 # [N, k]
    v = _tensor(values).to(torch.int64)[:, :k]
    valid = (v >= 0) & torch.isfinite(s)
    words, order = torch.where(valid, v, -1).sort(dim=1)                   # -1s first
    s = s.masked_fill(~valid, -math.inf).gather(1, order)
    valid = valid.gather(1, order)
    starts = torch.ones_like(valid)
    starts[:, 1:] = words[:, 1:] != words[:, :-1]
    run = starts.cumsum(1) - 1                                             # [N, k] run index
    peak = torch.full_like(s, -math.inf).scatter_reduce(1, run, s, reduce="amax")
    shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    mass = torch.zeros_like(s).scatter_add(1, run, torch.exp(s - shift.gather(1, run)))
    logp = (torch.log(mass) + shift).gather(1, run) - torch.logsumexp(s, dim=1, keepdim=True)
    return words.clamp(min=0), logp.masked_fill(~valid, -math.inf)


def knn_distribution(sims: Any, values: Any, k: int, temperature: float,
                     vocab_size: int) -> torch.Tensor:
    """The kNN distribution: log p_kNN over the vocabulary, float32 [N, V] (``knn_support``
    written out). Words no neighbour holds get -inf; a row with no neighbour at all is -inf
    everywhere (interpolation with λ < 1 leaves it the LM's share, as in ``knn_logprob``)."""
    words, logp = knn_support(sims, values, k, temperature)
    # a missing neighbour (-inf at word 0) writes to a spare column, dropped after
    words = torch.where(torch.isfinite(logp), words, torch.full_like(words, vocab_size))
    out = torch.full((logp.shape[0], vocab_size + 1), -math.inf)
    return out.scatter_(1, words, logp)[:, :vocab_size]


def interpolate_support(lm_logprobs: torch.Tensor, words: torch.Tensor, knn: torch.Tensor,
                        lam: float) -> torch.Tensor:
    """``interpolate(lm_logprobs, knn_distribution(...), lam)`` [N, V] from ``knn_support``'s
    ``(words, knn)``: the LM's share everywhere, kNN-LM's added at the ≤ k words it holds."""
    check_lambda(lam)
    out = lm_logprobs.float() + math.log1p(-lam) if lam < 1 else \
        torch.full_like(lm_logprobs, -math.inf, dtype=torch.float32)
    mixed = torch.logaddexp(out.gather(1, words), math.log(lam) + knn if lam > 0 else
                            torch.full_like(knn, -math.inf))
    # a missing neighbour (-inf at word 0) writes to a spare column, dropped after; the
    # neighbours of one word all write its one mixed value
    held = torch.isfinite(knn)
    V = out.shape[1]
    padded = torch.cat([out, out.new_full((out.shape[0], 1), -math.inf)], dim=1)
    padded.scatter_(1, torch.where(held, words, torch.full_like(words, V)),
                    mixed.masked_fill(~held, -math.inf))
    return padded[:, :V]


def interpolate(lm_logprob: Any, other_logprob: Any, lam: Any) -> Any:
    """log((1 − λ)·p_LM + λ·p_other) from log-probabilities, exactly for λ = 0, 1 and -inf.

    ``lam`` may be a scalar or an array broadcasting against the log-probabilities.
    """
    check_lambda(lam)
    a = _tensor(lm_logprob, torch.float64 if _is_f64(lm_logprob) else torch.float32)
    b = _tensor(other_logprob, a.dtype)
    lam_t = torch.as_tensor(np.asarray(lam, dtype=np.float64)).to(a.dtype)
    # log(0) = -inf and -inf + x = -inf, so λ = 0 or 1 reduces to exactly a or b.
    out = torch.logaddexp(torch.log1p(-lam_t) + a, torch.log(lam_t) + b)
    return _like(out, lm_logprob, other_logprob, lam)


def _is_f64(x: Any) -> bool:
    return getattr(x, "dtype", None) in (np.float64, torch.float64)


# -- sweeping --------------------------------------------------------------------------------
# Scores per block of rows: 16 MB of float32 on a CPU (cache-sized), 256 MB on a GPU, where a
# block is one launch per operation and the launches, not the arithmetic, would bound small ones.
_CPU_BLOCK = 1 << 22
_GPU_BLOCK = 1 << 26


def _row_step(K: int, budget: int = _CPU_BLOCK) -> int:
    return max(1, budget // max(1, K))


def _knn_logprob_prefixes(sims: torch.Tensor, hits: torch.Tensor, ks: Sequence[int],
                          first_hit: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log p_kNN(target) [b, nk] for the prefixes k ∈ ``ks`` (ascending) of ``sims``/``hits``.

    One exp pass over the neighbour axis, segment by segment between consecutive k, with the
    running sums rescaled to each prefix's own best score (an online logsumexp). So every
    prefix is as precise as ``knn_logprob`` even when the neighbours are not sorted by score
    (exact scores in FAISS order). Sums whose every hit term underflows float32 (a hit more
    than ~87·T below the prefix's best score) are recomputed exactly.
    """
    b, device = sims.shape[0], sims.device
    run_max = torch.full((b,), -math.inf, device=device)
    total = torch.zeros(b, device=device)
    hit = torch.zeros(b, device=device)
    out = torch.empty(b, len(ks), device=device)
    start = 0
    for i, k in enumerate(ks):
        x = sims[:, start:k] / temperature                              # [b, k - start]
        new_max = torch.maximum(run_max, x.max(dim=1).values if k > start else run_max)
        shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        rescale = torch.exp(torch.where(torch.isfinite(run_max), run_max - shift,
                                        torch.full_like(run_max, -math.inf)))
        weights = torch.exp(x - shift[:, None])                         # 0 where invalid
        total = total * rescale + weights.sum(dim=1)
        hit = hit * rescale + (weights * hits[:, start:k]).sum(dim=1)
        run_max, start = new_max, k
        out[:, i] = torch.where(hit > 0, torch.log(hit) - torch.log(total), -math.inf)
    k_idx = torch.tensor(ks, device=device) - 1
    # a hit, yet its sum is 0 or denormal (imprecise): a hit ~87·T or more below the best
    tiny = torch.finfo(torch.float32).tiny
    underflow = (first_hit[:, None] <= k_idx[None]) & (out <= math.log(tiny) + 1e-3)
    if bool(underflow.any()):
        rows = underflow.any(dim=1).nonzero().squeeze(1)
        x = sims[rows] / temperature
        exact = (torch.logcumsumexp(x.masked_fill(~hits[rows], -math.inf), dim=1)[:, k_idx]
                 - torch.logcumsumexp(x, dim=1)[:, k_idx])
        out[rows] = torch.where(underflow[rows], exact, out[rows])
    return out


@torch.no_grad()
def sweep(cache: Mapping[str, Any], ks: Sequence[int], temperatures: Sequence[float],
          lambdas: Sequence[float], device: str | torch.device = "auto") -> np.ndarray:
    """Perplexity for every (k, T, λ): ndarray [len(ks), len(T), len(λ)].

    Rows are read once in blocks; per block and temperature, one pass over the neighbour axis
    gives log p_kNN for every k at once, and every λ is scored in one broadcast. The blocks are
    computed on ``device`` (``auto``: the GPU when there is one; the sums in float64 there too):
    a WikiText-2 valid cache at K = 1,024 is 9 exp passes over 222M scores per grid, which a
    CPU's cores take seconds for. A GPU's float32 exp rounds otherwise than a CPU's, so the
    perplexities may differ from a CPU's in their last digits.
    """
    device = torch_device(device)
    arrays = _arrays(cache)
    sims, hits, lm = arrays["sims"], arrays["hits"], arrays["lm_logprob"]
    n, K = sims.shape
    ks = [int(k) for k in ks]
    check_k(ks, K)
    check_temperature(list(temperatures))
    check_lambda(list(lambdas))
    order = sorted(range(len(ks)), key=lambda i: ks[i])
    sorted_ks = [ks[i] for i in order]
    lam = torch.tensor(list(lambdas), dtype=torch.float32, device=device)[:, None]  # [L, 1]
    log_lm_w, log_knn_w = torch.log1p(-lam), torch.log(lam)            # [L, 1]
    totals = torch.zeros(len(ks), len(temperatures), len(lambdas), dtype=torch.float64,
                         device=device)
    step = _row_step(K, _GPU_BLOCK if device.type == "cuda" else _CPU_BLOCK)
    for r0 in range(0, n, step):
        s_block = _tensor(sims[r0:r0 + step], torch.float32).to(device)   # [b, K]
        h_block = _tensor(hits[r0:r0 + step], torch.bool).to(device)
        lm_block = _tensor(lm[r0:r0 + step], torch.float32).to(device)    # [b]
        first_hit = torch.where(h_block.any(dim=1), h_block.byte().argmax(dim=1), K)  # [b]
        for j, temperature in enumerate(temperatures):
            knn = _knn_logprob_prefixes(s_block, h_block, sorted_ks, first_hit,
                                        float(temperature))             # [b, nk] sorted
            for pos, i in enumerate(order):
                mixed = torch.logaddexp(log_lm_w + lm_block, log_knn_w + knn[:, pos])  # [L, b]
                totals[i, j] += mixed.sum(1, dtype=torch.float64)
    return np.exp(-(totals / n).cpu().numpy())


def knn_lm_logprob(cache: Mapping[str, Any], k: int, temperature: float,
                   lam: float) -> np.ndarray:
    """Per-token log p of the interpolated kNN-LM, float32 [N] (for evaluation tables)."""
    arrays = _arrays(cache)
    n, K = arrays["sims"].shape
    check_k(k, K)
    out = np.empty(n, dtype=np.float32)
    step = _row_step(k)
    for r0 in range(0, n, step):
        sims = np.asarray(arrays["sims"][r0:r0 + step, :k])
        hits = np.asarray(arrays["hits"][r0:r0 + step, :k])
        knn = knn_logprob(sims, hits, k, temperature)
        out[r0:r0 + step] = interpolate(np.asarray(arrays["lm_logprob"][r0:r0 + step]), knn, lam)
    return out


def evaluate(cache: Mapping[str, Any], k: int, temperature: float, lam: float) -> float:
    """Perplexity of the kNN-LM at one point (token-weighted)."""
    return ppl_from_logprobs(knn_lm_logprob(cache, k, temperature, lam))


def base_perplexity(cache: Mapping[str, Any]) -> float:
    lm = np.asarray(_arrays(cache)["lm_logprob"])
    return perplexity(-float(np.sum(lm, dtype=np.float64)), len(lm))


def fit(cache: Mapping[str, Any], ks: Sequence[int], temperatures: Sequence[float],
        lambdas: Sequence[float]) -> dict:
    """The grid point minimising perplexity on ``cache`` (valid):
    ``{"k", "temperature", "lambda", "ppl", "base_ppl", "grid"}`` (grid as from ``sweep``)."""
    grid = sweep(cache, ks, temperatures, lambdas)
    i, j, n = (int(x) for x in np.unravel_index(int(np.argmin(grid)), grid.shape))
    return {"k": int(ks[i]), "temperature": float(temperatures[j]), "lambda": float(lambdas[n]),
            "ppl": float(grid[i, j, n]), "base_ppl": base_perplexity(cache), "grid": grid}


def fit_and_score(valid: Mapping[str, Any], test: Mapping[str, Any], ks: Sequence[int],
                  temperatures: Sequence[float], lambdas: Sequence[float]) -> dict:
    """Choose (k, T, λ) on valid, apply them to test (test chooses nothing).

    Returns ``k``, ``temperature``, ``lambda``, ``valid_ppl``, ``test_ppl`` and the per-token
    ``test_logprob``. ``valid``/``test`` map ``lm_logprob`` (any model's log p(target): the base
    LM's, or GNN-LM's for GNN+kNN), ``sims`` and ``hits``.
    """
    best = fit(valid, ks, temperatures, lambdas)
    test_logprob = knn_lm_logprob(test, best["k"], best["temperature"], best["lambda"])
    return {"k": best["k"], "temperature": best["temperature"], "lambda": best["lambda"],
            "valid_ppl": best["ppl"], "test_ppl": ppl_from_logprobs(test_logprob),
            "test_logprob": test_logprob}


def fit_lambda(lm_valid: Any, other_valid: Any, lambdas: Sequence[float],
               ) -> tuple[float, float]:
    """The λ of (1 − λ)·p_LM + λ·p_other minimising valid perplexity, and that perplexity
    (two full models, e.g. the base LM and a learned W_ds: no k or T)."""
    lams = [lam for lam in lambdas if lam < 1] or [0.0]
    ppl = [ppl_from_logprobs(interpolate(np.asarray(lm_valid), np.asarray(other_valid), lam))
           for lam in lams]
    best = int(np.argmin(ppl))
    return float(lams[best]), ppl[best]
