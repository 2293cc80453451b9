"""kNN-LM maths as functions of arrays, and the per-token cache that the λ × T × k sweep reads.

kNN-LM (Khandelwal et al. 2020; gnn-lm.txt eq. 5; why-knnlm.txt eq. 2-3, 6)::

    p_kNN(w) = Σ_{i≤k, v_i = w} exp(s_i / T) / Σ_{i≤k} exp(s_i / T)
    p(w)     = λ · p_kNN(w) + (1 − λ) · p_LM(w)

with s_i the similarity of the i-th neighbour (higher is better: cos, ip or −squared l2) and
v_i its value (the train token after it). Only the target's probability matters for perplexity,
so everything here works on ``hits`` [N, K] (v_i == target) instead of vocabulary-sized tensors.

**Invalid neighbours** (id -1 in the neighbours file) are marked by ``sims = -inf``: they get
weight exp(-inf) = 0 in both sums. ``hits`` must be False there (the cache guarantees it). A
token whose first k neighbours hold no hit has log p_kNN = -inf; interpolation with λ < 1 keeps
it finite.

The cache (``build_knn_cache``) holds per token ``lm_logprob`` [N], ``sims`` [N, K] and ``hits``
[N, K]: every (k, T, λ) is then a cheap vectorised pass. ``scores="faiss"`` keeps the search's
scores; ``scores="exact"`` recomputes them from the stored float keys in float32, in the same
neighbour order ("FAISS mask, real score" of Xu et al. §5.1 when the neighbours came from the
index; "real mask, real score" when they came from the exact backend). ``k`` always means the
first k neighbours in stored order.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, open_array, read_manifest
from gnnlm.datastore import open_features
from gnnlm.index import check_metric
from gnnlm.neighbors import open_neighbors

CACHE_ARRAYS = ("lm_logprob", "sims", "hits")


# -- validation ------------------------------------------------------------------------------
def check_lambda(lam: Any) -> None:
    values = np.asarray(lam, dtype=np.float64)
    if values.size and (not np.all(np.isfinite(values)) or values.min() < 0 or values.max() > 1):
        raise ValueError(f"λ (knn.lambda_) must lie in [0, 1] (got {lam}).")


def check_temperature(temperature: Any) -> None:
    values = np.asarray(temperature, dtype=np.float64)
    if values.size and (not np.all(np.isfinite(values)) or values.min() <= 0):
        raise ValueError(f"The temperature T (knn.temperature) must be a finite number > 0 "
                         f"(got {temperature}).")


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


# -- the maths -------------------------------------------------------------------------------
def knn_logprob(sims: Any, hits: Any, k: int, temperature: float) -> Any:
    """log p_kNN(target) [N] from the first k of ``sims`` [N, K] and ``hits`` bool [N, K].

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


def interpolate(lm_logprob: Any, knn_logprob: Any, lam: Any) -> Any:
    """log((1 − λ)·p_LM + λ·p_kNN) from log-probabilities, exactly for λ = 0, 1 and -inf.

    ``lam`` may be a scalar or an array broadcasting against the log-probabilities.
    """
    check_lambda(lam)
    a = _tensor(lm_logprob, torch.float64 if _is_f64(lm_logprob) else torch.float32)
    b = _tensor(knn_logprob, a.dtype)
    lam_t = torch.as_tensor(np.asarray(lam, dtype=np.float64)).to(a.dtype)
    # log(0) = -inf and -inf + x = -inf, so λ = 0 or 1 reduces to exactly a or b.
    out = torch.logaddexp(torch.log1p(-lam_t) + a, torch.log(lam_t) + b)
    return _like(out, lm_logprob, knn_logprob, lam)


def _is_f64(x: Any) -> bool:
    return getattr(x, "dtype", None) in (np.float64, torch.float64)


def similarity(queries: Any, keys: Any, metric: str) -> Any:
    """Similarity of ``queries`` [..., d] and ``keys`` [..., d] along the last dim, broadcast
    over the leading dims (e.g. [n, 1, d] with [n, K, d] -> [n, K]); float32, higher is better,
    the same convention as the index (cos, ip, -squared l2)."""
    check_metric(metric)
    q = _tensor(queries, torch.float32)
    k = _tensor(keys, torch.float32)
    if metric == "cos":
        q, k = F.normalize(q, dim=-1, eps=1e-12), F.normalize(k, dim=-1, eps=1e-12)
    if metric == "l2":
        out = -((q - k) ** 2).sum(-1)
    else:
        out = (q * k).sum(-1)
    return _like(out, queries, keys)


def perplexity_of(logprob_sum: float, n_tokens: int) -> float:
    """exp(−Σ log p / N): token-weighted (inf when a token has probability 0)."""
    if n_tokens <= 0:
        raise ValueError(f"perplexity needs at least one token (got {n_tokens}).")
    try:
        return math.exp(-logprob_sum / n_tokens)
    except OverflowError:  # -inf sums (a zero-probability token) or astronomically bad models
        return math.inf


# -- the cache -------------------------------------------------------------------------------
def open_knn_cache(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(manifest, {"lm_logprob", "sims", "hits"})`` of a kNN cache artifact (memmaps)."""
    manifest = read_manifest(path, kind="knn_cache")
    return manifest, {name: open_array(path, name, manifest) for name in CACHE_ARRAYS}


def _as_cache(cache: Any) -> tuple[dict, Mapping[str, Any]]:
    if isinstance(cache, (str, Path)):
        return open_knn_cache(cache)
    missing = [name for name in CACHE_ARRAYS if name not in cache]
    if missing:
        raise ValueError(f"a kNN cache needs arrays {CACHE_ARRAYS} (missing {missing}).")
    return {}, cache


def _exact_scores(queries: np.ndarray, ids: np.ndarray, train_keys: np.ndarray, metric: str,
                  max_elems: int = 1 << 24) -> np.ndarray:
    """float32 similarities [n, K] of ``queries`` [n, d] to train keys ``ids`` [n, K] (-1: -inf)."""
    n, K = ids.shape
    d = queries.shape[1]
    out = np.full((n, K), -np.inf, dtype=np.float32)
    step = max(1, max_elems // max(1, K * d))
    for r0 in range(0, n, step):
        rows = ids[r0:r0 + step]                                       # [b, K]
        valid = rows >= 0
        # Gather each distinct key once, in increasing order (sequential memmap reads).
        uniq, inverse = np.unique(rows[valid], return_inverse=True)
        gathered = np.zeros(rows.shape + (d,), dtype=np.float32)       # [b, K, d]
        gathered[valid] = np.asarray(train_keys[uniq], dtype=np.float32)[inverse]
        q = np.asarray(queries[r0:r0 + step], dtype=np.float32)[:, None, :]  # [b, 1, d]
        scores = similarity(q, gathered, metric)                       # [b, K]
        out[r0:r0 + step] = np.where(valid, scores, -np.inf)
    return out


def build_knn_cache(split: str, query_features_dir: str | Path, train_features_dir: str | Path,
                    neighbors_dir: str | Path, out_dir: str | Path, scores: str = "faiss",
                    rebuild: bool = False, chunk: int = 16384,
                    stop_after_chunks: int | None = None) -> dict:
    """Per-token ``lm_logprob`` [N], ``sims`` float32 [N, K] and ``hits`` bool [N, K].

    ``hits[t, i]`` = (train targets[ids[t, i]] == targets[t]), False where ids is -1.
    """
    if scores not in ("faiss", "exact"):
        raise ValueError(f"scores must be 'faiss' (the search's scores) or 'exact' "
                         f"(recomputed from the stored keys) (got {scores!r}).")
    nb_manifest, nb = open_neighbors(neighbors_dir)
    query_manifest, query = open_features(query_features_dir)
    train_manifest, train = open_features(train_features_dir)
    if nb_manifest["split"] != split:
        raise ArtifactError(f"The neighbours at {neighbors_dir} are for split "
                            f"{nb_manifest['split']!r}, not {split!r}.")
    if nb_manifest["inputs"]["features"] != query_manifest["fingerprint"]:
        raise ArtifactError(
            f"The neighbours at {neighbors_dir} were searched for features "
            f"{nb_manifest['inputs']['features']}, not for those at {query_features_dir} "
            f"({query_manifest['fingerprint']}). Rebuild the neighbours.")
    if nb_manifest["inputs"]["train_features"] != train_manifest["fingerprint"]:
        raise ArtifactError(
            f"The neighbours at {neighbors_dir} point into train features "
            f"{nb_manifest['inputs']['train_features']}, not those at {train_features_dir} "
            f"({train_manifest['fingerprint']}). Rebuild the neighbours.")
    if "lm_logprob" not in query:
        raise ArtifactError(f"The features at {query_features_dir} have no lm_logprob (the base "
                            f"LM's log p(target)); build them with with_logprob / "
                            f"train_logprob: true.")
    key, metric = nb_manifest["key"], nb_manifest["metric"]
    K, n = nb_manifest["K"], nb_manifest["n"]
    builder = ArtifactBuilder(
        out_dir, kind="knn_cache", config={"split": split, "scores": scores, "chunk": chunk},
        inputs={"neighbors": nb_manifest["fingerprint"], "features": query_manifest["fingerprint"],
                "train_features": train_manifest["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    # The train targets are read at random positions: hold them in RAM (4 bytes per token).
    train_targets = np.asarray(train["targets"], dtype=np.int64)       # [N_train]
    n_chunks = -(-n // chunk)
    t0 = time.perf_counter()
    with builder:
        lm_out = builder.array("lm_logprob", np.float32, (n,))
        sims_out = builder.array("sims", np.float32, (n, K))
        hits_out = builder.array("hits", np.bool_, (n, K))
        done = builder.progress.get("chunks_done", 0)
        lm_sum = builder.progress.get("lm_sum", 0.0)
        covered = builder.progress.get("covered", 0)
        for c in range(done, n_chunks):
            if stop_after_chunks is not None and c - done >= stop_after_chunks:
                return {}
            rows = slice(c * chunk, min((c + 1) * chunk, n))
            ids = np.asarray(nb["ids"][rows], dtype=np.int64)          # [b, K]
            valid = ids >= 0
            targets = np.asarray(query["targets"][rows], dtype=np.int64)  # [b]
            hits = valid & (train_targets[np.where(valid, ids, 0)] == targets[:, None])
            hits_out[rows] = hits
            if scores == "faiss":
                sims_out[rows] = nb["sims"][rows]
            else:
                sims_out[rows] = _exact_scores(query[key][rows], ids, train[key], metric)
            lm = np.asarray(query["lm_logprob"][rows], dtype=np.float32)
            lm_out[rows] = lm
            lm_sum += float(np.sum(lm, dtype=np.float64))
            covered += int(hits.any(axis=1).sum())
            builder.save_progress(chunks_done=c + 1, lm_sum=lm_sum, covered=covered)
        return builder.finish(extra={
            "split": split, "n": n, "K": K, "key": key, "metric": metric, "scores": scores,
            "backend": nb_manifest.get("backend"), "factory": nb_manifest.get("factory"),
            "base_lm": query_manifest["base_lm"], "base_ppl": perplexity_of(lm_sum, n),
            # the share of tokens whose target is among the values of their K neighbours
            "hit_coverage": covered / max(n, 1), "seconds": round(time.perf_counter() - t0, 3)})


# -- sweeping --------------------------------------------------------------------------------
def _row_step(K: int, budget: int = 1 << 22) -> int:
    return max(1, budget // max(1, K))


def _knn_logprob_prefixes(sims: torch.Tensor, hits: torch.Tensor, k_idx: torch.Tensor,
                          first_hit: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p_kNN(target) [b, nk] for the prefixes k = k_idx + 1 of ``sims``/``hits`` [b, K].

    One exp pass and two cumulative sums, shifted by each row's best score (3x faster than two
    logcumsumexp). Prefix sums whose every term underflows float32 (a hit more than ~87·T below
    the row's best score) are recomputed exactly, so the result equals ``knn_logprob``.
    """
    best = sims.max(dim=1, keepdim=True).values                       # [b, 1]
    best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
    weights = torch.exp((sims - best) / temperature)                  # [b, K], 0 where invalid
    total = weights.cumsum(dim=1)[:, k_idx]                           # [b, nk]
    hit = (weights * hits).cumsum(dim=1)[:, k_idx]
    out = torch.where(hit > 0, torch.log(hit) - torch.log(total), -math.inf)
    underflow = (first_hit[:, None] <= k_idx[None]) & (hit == 0)      # a hit, yet a zero sum
    if bool(underflow.any()):
        rows = underflow.any(dim=1).nonzero().squeeze(1)
        x = sims[rows] / temperature
        exact = (torch.logcumsumexp(x.masked_fill(~hits[rows], -math.inf), dim=1)[:, k_idx]
                 - torch.logcumsumexp(x, dim=1)[:, k_idx])
        out[rows] = torch.where(underflow[rows], exact, out[rows])
    return out


@torch.no_grad()
def sweep(cache: Any, ks: Sequence[int], temperatures: Sequence[float],
          lambdas: Sequence[float]) -> np.ndarray:
    """Perplexity for every (k, T, λ): ndarray [len(ks), len(T), len(λ)].

    ``cache`` is a cache folder or a mapping with ``lm_logprob``, ``sims`` and ``hits``. Rows are
    read once in blocks; per block and temperature, one pass of cumulative sums over the
    neighbour axis gives log p_kNN for every k at once, and every λ is scored in one broadcast.
    """
    _, arrays = _as_cache(cache)
    sims, hits, lm = arrays["sims"], arrays["hits"], arrays["lm_logprob"]
    n, K = sims.shape
    ks = [int(k) for k in ks]
    check_k(ks, K)
    check_temperature(list(temperatures))
    check_lambda(list(lambdas))
    k_idx = torch.tensor([k - 1 for k in ks])                          # [nk]
    lam = torch.tensor(list(lambdas), dtype=torch.float32)[:, None]    # [L, 1]
    log_lm_w, log_knn_w = torch.log1p(-lam), torch.log(lam)            # [L, 1]
    totals = torch.zeros(len(ks), len(temperatures), len(lambdas), dtype=torch.float64)
    step = _row_step(K)
    for r0 in range(0, n, step):
        s_block = _tensor(sims[r0:r0 + step], torch.float32)           # [b, K]
        h_block = _tensor(hits[r0:r0 + step], torch.bool)
        lm_block = _tensor(lm[r0:r0 + step], torch.float32)            # [b]
        first_hit = torch.where(h_block.any(dim=1), h_block.byte().argmax(dim=1), K)  # [b]
        for j, temperature in enumerate(temperatures):
            knn = _knn_logprob_prefixes(s_block, h_block, k_idx, first_hit, float(temperature))
            for i in range(len(ks)):
                mixed = torch.logaddexp(log_lm_w + lm_block, log_knn_w + knn[:, i])  # [L, b]
                totals[i, j] += mixed.sum(1, dtype=torch.float64)
    return np.exp(-(totals / n).numpy())


def knn_lm_logprob(cache: Any, k: int, temperature: float, lam: float) -> np.ndarray:
    """Per-token log p of the interpolated kNN-LM, float32 [N] (for evaluation tables)."""
    _, arrays = _as_cache(cache)
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


def evaluate(cache: Any, k: int, temperature: float, lam: float) -> float:
    """Perplexity of the kNN-LM at one point (token-weighted)."""
    logprob = knn_lm_logprob(cache, k, temperature, lam)
    return perplexity_of(float(np.sum(logprob, dtype=np.float64)), len(logprob))


def fit(cache: Any, ks: Sequence[int], temperatures: Sequence[float],
        lambdas: Sequence[float]) -> dict:
    """The grid point minimising perplexity on ``cache`` (valid):
    ``{"k", "temperature", "lambda", "ppl", "base_ppl", "grid"}`` (grid as from ``sweep``)."""
    _, arrays = _as_cache(cache)
    grid = sweep(arrays, ks, temperatures, lambdas)
    i, j, n = np.unravel_index(int(np.argmin(grid)), grid.shape)
    lm = arrays["lm_logprob"]
    return {"k": int(ks[i]), "temperature": float(temperatures[j]), "lambda": float(lambdas[n]),
            "ppl": float(grid[i, j, n]),
            "base_ppl": perplexity_of(float(np.sum(lm, dtype=np.float64)), len(lm)),
            "grid": grid}
