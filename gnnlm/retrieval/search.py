"""Search over the train keys: the similarity convention, exact search, and ``Searcher``.

Similarity convention, everywhere in the package: **higher is better**. ``cos`` L2-normalises keys
and queries and scores by inner product, ``ip`` is the raw inner product, ``l2`` is the *negative*
squared L2 distance. Missing results (fewer keys than asked for) are id -1 with similarity -inf.

``exact_search`` is exact search in torch (``gnnlm.retrieval.exact``: a screening product over a
possibly float16 memmap, read one chunk at a time, certified, then float32 scores; ties to the
lower position); it is the dependable exact path on CUDA machines without faiss-gpu.
``Searcher`` puts a FAISS index (``gnnlm.retrieval.index``) and exact search behind one call. With
``rerank = f`` it searches f·k candidates in the index and keeps the k best by their exact
similarity, recomputed from the stored float16 keys: the IVF-PQ index only has to bring the
true neighbours into the candidate list, and the scores returned are exact. On a GPU, a search
whose candidate width (``candidate_width``) or nprobe exceeds ``GPU_MAX_K`` runs on the index's
CPU copy instead, with a warning (``fits_gpu``; tuning never picks such a setting). ``rescore``
recomputes the similarities of given neighbours exactly, in their order.
"""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import faiss
import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.retrieval.exact import ExactSearch
from gnnlm.retrieval.features import check_key, open_features
from gnnlm.retrieval.settings import METRICS, check_metric  # noqa: F401  (importable from here)
from gnnlm.utils.devices import faiss_device, torch_device
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest

# Below its BLAS threshold faiss sums in another order, and a query's similarities would depend
# on how many were searched with it (generation searches one at a time, scoring thousands): an
# exhaustive faiss index is searched with at least this many rows (the exact search's scores:
# ``exact_scores.ROWS``).
FAISS_BLAS_ROWS = 20
# faiss factories searched exhaustively (every key scored): their neighbours are the exact ones.
_EXHAUSTIVE = re.compile(r"(IDMap2?,)?Flat")


def exhaustive_index(factory: str | None) -> bool:
    """True when an index of this faiss factory scores every key (``Flat``): its neighbours are
    the exact ones."""
    return factory is not None and _EXHAUSTIVE.fullmatch(factory) is not None

# GPU faiss refuses k (and nprobe) above this; larger searches run on the CPU copy
# (``Searcher.search`` warns once), and tuning never picks such a setting
# (``gnnlm.retrieval.tuning``).
GPU_MAX_K = 2048


def candidate_width(k: int, rerank: float, ntotal: int) -> int:
    """How many candidates ``Searcher.search(queries, k)`` asks the index for: ceil(rerank·k)
    (at most ``ntotal``) when re-ranking, else k."""
    return min(int(ntotal), math.ceil(rerank * k)) if rerank else int(k)


def fits_gpu(k: int, nprobe: int | None, rerank: float, ntotal: int) -> bool:
    """Whether a search of width k at ``nprobe``/``rerank`` stays within GPU faiss's limit
    (``GPU_MAX_K`` on both the candidate width and nprobe), i.e. runs on a GPU index rather
    than falling back to its CPU copy."""
    return (candidate_width(k, rerank, ntotal) <= GPU_MAX_K
            and int(nprobe or 0) <= GPU_MAX_K)


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise float32 rows in place (zero rows stay zero); the cos metric's key/query map."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    x /= norms
    return x


def _as_float32(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))



def _float_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.float()
    array = np.asarray(x, dtype=np.float32)
    if not array.flags.writeable:
        array = array.copy()  # read-only memmaps: torch wants writable memory
    return torch.from_numpy(array)


def exact_search(keys: Any, queries: Any, k: int, metric: str, device: str | torch.device = "cpu",
                 chunk: int = 65536, screen: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of ``queries`` [n, d] among ``keys`` [N, d]: ``(sims float32, ids int64)``,
    best first, ties to the lower id (``gnnlm.retrieval.exact``).

    Keys may be a float16 memmap or a torch tensor; they are converted to float32 one chunk at a
    time. Rows with fewer than k candidate keys end in id -1 / sim -inf. Similarities follow the
    module's convention (higher is better). ``screen`` picks the screening product's precision,
    which changes the time, never the result.
    """
    return ExactSearch(keys, metric, device, screen=screen, chunk=chunk).search(queries, k)


def recall_at(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int) -> float:
    """Mean |approx top-k ∩ exact top-k| / k over queries (-1 ids never count)."""
    a = np.asarray(approx_ids[:, :k], dtype=np.int64)                  # [n, k]
    e = np.asarray(exact_ids[:, :k], dtype=np.int64)                   # [n, k]
    # Membership by binary search in one sorted table where row r's ids (+1, so -1 -> 0) lie in
    # [r * span, (r + 1) * span): O(n k log) where comparing all pairs took n·k² memory
    # (1 GB for 1,000 queries at the neighbours' k = 1,024).
    span = int(max(a.max(initial=-1), e.max(initial=-1))) + 2
    offsets = np.arange(len(e), dtype=np.int64)[:, None] * span         # [n, 1]
    table = np.sort((e + 1 + offsets).ravel())                         # [n·k]
    probe = a + 1 + offsets                                            # [n, k]
    pos = np.minimum(np.searchsorted(table, probe), max(len(table) - 1, 0))
    found = ((table[pos] == probe) & (a >= 0)).sum(axis=1) if table.size else 0
    valid = np.maximum((e >= 0).sum(axis=1), 1)
    return float(np.mean(found / valid))


# -- searching -------------------------------------------------------------------------------
class Searcher:
    """Top-k search over the train keys, by a FAISS index or exactly in torch.

    ``search(queries [n, d], k) -> (sims float32 [n, k], ids int64 [n, k])``, higher is better
    for every metric (l2 gives the negative squared distance); -1 / -inf mark missing results.
    """

    def __init__(self, *, metric: str, key: str, ntotal: int, d: int, index: Any = None,
                 keys: Any = None, device: str = "cpu", chunk: int = 65536,
                 manifest: dict | None = None):
        check_metric(metric)
        self.metric, self.key, self.ntotal, self.d = metric, key, int(ntotal), int(d)
        self.index, self.keys, self.device, self.chunk = index, keys, device, chunk
        self.manifest = manifest or {}
        self.nprobe: int | None = None
        self.rerank = 0.0
        self._rerank_keys: Optional[RerankKeys] = None   # what re-ranking reads, made once
        self.keys_in_ram: Optional[bool] = None  # re-ranking keys in RAM (None: when they fit)
        self._cpu_index: Any = None   # set when ``index`` is on a GPU: for wider searches
        self.exact_search: Optional[ExactSearch] = None   # the exact backend, made once
        self._warned_cpu = False
        self.backend = "faiss" if index is not None else "exact"

    @classmethod
    def open(cls, index_dir: str | Path, nprobe: int | None = None, rerank: float | None = None,
             device: str = "auto", keys: Any = None,
             keys_in_ram: Optional[bool] = None) -> Searcher:
        """A searcher over a built index folder (``nprobe`` and ``rerank`` default to the
        manifest's). Re-ranking reads ``keys``, the train features the index was built over
        (``Searcher.for_workdir`` finds them), prepared in RAM once (``keys_in_ram``; None:
        when they take at most ``RERANK_RAM_BYTES``) or row by row: the same similarities."""
        manifest = read_manifest(index_dir, kind="index")
        index = faiss.read_index(str(Path(index_dir) / manifest["index_file"]))
        nprobe = int(manifest["nprobe"] if nprobe is None else nprobe)
        if nprobe < 1:
            raise ValueError(f"nprobe must be >= 1 (got {nprobe}).")
        rerank = float(manifest.get("rerank", 0.0) if rerank is None else rerank)
        if rerank and keys is None:
            raise ValueError(f"The index at {index_dir} re-ranks with the stored keys "
                             f"(rerank={rerank}): open it with Searcher.for_workdir, or pass "
                             f"keys, or rerank=0.")
        if rerank and (rerank < 1 or tuple(keys.shape) != (index.ntotal, index.d)):
            raise ValueError(f"rerank must be 0 or >= 1 with keys [{index.ntotal}, {index.d}] "
                             f"(got rerank={rerank}, keys {tuple(keys.shape)}).")
        set_nprobe(index, nprobe)
        searcher = cls(metric=manifest["metric"], key=manifest["key"], ntotal=index.ntotal,
                       d=index.d, index=index, keys=keys, device="cpu", manifest=manifest)
        searcher.nprobe, searcher.rerank, searcher.keys_in_ram = nprobe, rerank, keys_in_ram
        if faiss_device(device) == "cuda":
            gpu = int(str(device).split(":")[1]) if ":" in str(device) else 0
            try:
                searcher._cpu_index = index
                searcher.index = to_gpu(index, gpu)
                set_nprobe(searcher.index, min(nprobe, GPU_MAX_K))
                searcher.device = f"cuda:{gpu}"
            except RuntimeError as err:  # e.g. a PQ code size the GPU kernels lack
                warnings.warn(f"faiss-gpu could not take {manifest['factory']} ({err}); "
                              f"searching on CPU.", stacklevel=2)
                searcher.index, searcher._cpu_index = index, None
        return searcher

    @classmethod
    def for_workdir(cls, workdir: Workdir, key: str, metric: str, device: str = "auto",
                    **settings: Any) -> Searcher:
        """The index of ``key`` under ``metric`` with its train keys (for re-ranking)."""
        manifest, arrays = open_features(workdir.features("train"))
        check_key(manifest, key)
        return cls.open(workdir.index(key, metric), device=device, keys=arrays[key],
                        **settings)

    @classmethod
    def exact(cls, workdir: Workdir, key: str = "final", metric: str = "cos",
              device: str = "auto", chunk: int = 65536, screen: str = "auto") -> Searcher:
        """Exact search in torch over the stored train keys (``gnnlm.retrieval.exact``: on CUDA
        the keys are resident on the GPU when they fit, and screened in float16)."""
        check_metric(metric)
        manifest, arrays = open_features(workdir.features("train"))
        check_key(manifest, key)
        keys = arrays[key]
        searcher = cls(metric=metric, key=key, ntotal=keys.shape[0], d=keys.shape[1], keys=keys,
                       device=str(torch_device(device)), chunk=chunk,
                       manifest={"base_lm": manifest["base_lm"],
                                 "features": manifest["fingerprint"], "key": key,
                                 "metric": metric, "factory": "exact"})
        searcher.exact_search = ExactSearch(keys, metric, searcher.device, screen=screen,
                                            chunk=chunk)
        return searcher

    def check(self, queries: Any, k: int) -> None:
        shape = tuple(queries.shape)
        if len(shape) != 2 or shape[1] != self.d:
            raise ValueError(f"queries have dimension {shape[-1] if shape else None} (shape "
                             f"{shape}) but the {self.key!r} keys of this datastore have "
                             f"dimension {self.d}: query with features of the same key type "
                             f"from the base LM that made the datastore.")
        if not 1 <= k <= self.ntotal:
            raise ValueError(f"k must be between 1 and the datastore size {self.ntotal} "
                             f"(got {k}): lower k (neighbors.K) or build a larger datastore.")

    def search_tensors(self, queries: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``search``'s ``(sims, ids)`` as tensors: on the GPU that exact search ran on, where
        the caller's next step can run too; an index's on the CPU."""
        if self.index is None:
            self.check(queries, k)
            return self._exact().search_tensors(queries, k)
        sims, ids = self.search(queries, k)
        return torch.from_numpy(sims), torch.from_numpy(ids)

    def _exact(self) -> ExactSearch:
        if self.exact_search is None:
            self.exact_search = ExactSearch(self.keys, self.metric, self.device,
                                            chunk=self.chunk)
        return self.exact_search

    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        self.check(queries, k)
        if self.index is None:
            return self._exact().search(queries, k)
        if self.metric == "cos":  # a copy: never normalise the caller's array in place
            q = normalize_rows(np.array(queries, dtype=np.float32, copy=True, order="C"))
        else:
            q = _as_float32(queries)
        width = candidate_width(k, self.rerank, self.ntotal)
        index = self.index
        if self._cpu_index is not None and not fits_gpu(k, self.nprobe, self.rerank,
                                                        self.ntotal):
            # GPU faiss refuses this width (or nprobe): the CPU copy (same index, same settings)
            # serves it many times slower, so say so once rather than leave it unexplained.
            index = self._cpu_index
            if not self._warned_cpu:
                self._warned_cpu = True
                warnings.warn(f"This search asks the index for {width} candidates (k={k}, "
                              f"rerank={self.rerank}) at nprobe={self.nprobe}, but GPU faiss "
                              f"allows at most {GPU_MAX_K} of each: it runs on the CPU copy of "
                              f"the index, much slower. Lower neighbors.K, "
                              f"rerank or nprobe, or keep the index's tuned ones ('auto').",
                              stacklevel=2)
        if exhaustive_index(self.manifest.get("factory")) and len(q) < FAISS_BLAS_ROWS:
            # below its BLAS threshold faiss sums another way: zero queries, cut below
            n = len(q)
            q = np.concatenate([q, np.zeros((FAISS_BLAS_ROWS - n, q.shape[1]), q.dtype)])
            dist, ids = (a[:n] for a in index.search(q, width))
        else:
            dist, ids = index.search(q, width)                         # [n, width] each
        ids = ids.astype(np.int64, copy=False)
        if self.rerank:
            if self._rerank_keys is None:
                self._rerank_keys = RerankKeys(self.keys, self.metric, self.keys_in_ram)
            return rerank(queries, ids, self._rerank_keys, self.metric, k)
        sims = -dist if self.metric == "l2" else dist
        sims[ids < 0] = -np.inf  # faiss pads with ±FLT_MAX
        return sims.astype(np.float32, copy=False), ids


_GPU_RESOURCES: dict[int, Any] = {}


def to_gpu(index: faiss.Index, gpu: int = 0) -> faiss.Index:
    """A copy of a CPU faiss index on GPU ``gpu`` (one resources object per GPU and process)."""
    if gpu not in _GPU_RESOURCES:
        _GPU_RESOURCES[gpu] = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[gpu], gpu, index)


def set_nprobe(index: faiss.Index, nprobe: int) -> None:
    if faiss.try_extract_index_ivf(index) is not None:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", int(nprobe))


def faiss_metric(metric: str) -> int:
    check_metric(metric)
    return faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT


def similarity(queries: Any, keys: Any, metric: str) -> torch.Tensor:
    """Similarity of ``queries`` [..., d] and ``keys`` [..., d] along the last dim, broadcast
    over the leading dims (e.g. [n, 1, d] with [n, K, d] -> [n, K]); float32, higher is better."""
    check_metric(metric)
    q, k = _float_tensor(queries), _float_tensor(keys)
    if metric == "cos":
        q, k = F.normalize(q, dim=-1, eps=1e-12), F.normalize(k, dim=-1, eps=1e-12)
    if metric == "l2":
        return -((q - k) ** 2).sum(-1)
    return (q * k).sum(-1)


# keys re-ranked from RAM as float32 (unit rows for cos) when they take at most this many bytes
RERANK_RAM_BYTES = 4 << 30


def _prepared(rows: np.ndarray, metric: str) -> np.ndarray:
    """Stored key rows as re-ranking reads them: float32, L2-normalised for cos."""
    rows = np.asarray(rows, dtype=np.float32)
    return normalize_rows(rows) if metric == "cos" else rows


def prepare_keys(keys: Any, metric: str, chunk: int = 1 << 20) -> np.ndarray:
    """``keys`` as float32 in RAM, L2-normalised for cos: what re-ranking reads (no conversion
    or norm per candidate)."""
    out = np.empty(keys.shape, dtype=np.float32)
    for start in range(0, len(out), chunk):
        out[start:start + chunk] = _prepared(keys[start:start + chunk], metric)
    return out


class RerankKeys:
    """The stored train keys as re-ranking reads them (float32; unit rows for cos): prepared
    once in RAM (``in_ram``; None: when they take at most ``RERANK_RAM_BYTES``), or row by row
    from the float16 memmap for each search. Each row is normalised on its own, so both give
    the same bits, and a searcher that keeps nothing in RAM (``gnnlm.load``) finds the same
    neighbours with the same scores as the pipeline did."""

    def __init__(self, keys: Any, metric: str, in_ram: Optional[bool] = None):
        check_metric(metric)
        self.keys, self.metric = keys, metric
        if in_ram is None:
            in_ram = keys.nbytes * 2 <= RERANK_RAM_BYTES
        self._table = prepare_keys(keys, metric) if in_ram else None
        self.dim = int(keys.shape[1])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Float32 rows [len(ids), d] of the train positions ``ids`` (>= 0)."""
        if self._table is not None:
            return np.take(self._table, ids, axis=0)
        order = np.argsort(ids, kind="stable")  # sequential memmap reads, rows put back after
        rows = np.empty((len(ids), self.dim), dtype=np.float32)
        rows[order] = _prepared(np.take(np.asarray(self.keys), ids[order], axis=0), self.metric)
        return rows


def rerank(queries: Any, ids: np.ndarray, keys: RerankKeys, metric: str, k: int,
           max_elems: int = 1 << 24) -> tuple[np.ndarray, np.ndarray]:
    """The k best of candidate ``ids`` [n, R] (-1: none) by exact similarity to ``queries``
    [n, d], from the stored keys (``RerankKeys``): ``(sims float32 [n, k], ids int64 [n, k])``,
    best first."""
    check_metric(metric)
    n, R = ids.shape
    d = keys.dim
    out_s = np.full((n, k), -np.inf, dtype=np.float32)
    out_i = np.full((n, k), -1, dtype=np.int64)
    step = max(1, max_elems // max(1, R * d))
    for r0 in range(0, n, step):
        cand = ids[r0:r0 + step]                                       # [b, R]
        b = cand.shape[0]
        keys_b = torch.from_numpy(keys.rows(np.maximum(cand, 0).ravel())).view(b, R, d)
        q = _float_tensor(queries[r0:r0 + step])                       # [b, d]
        if metric == "cos":
            q = F.normalize(q, dim=1, eps=1e-12)
        # a dot product per row, not bmm: a batched matmul's sums depend on how many queries
        # go together, and a query's neighbours must not (generation searches one at a time)
        sims = torch.linalg.vecdot(keys_b, q[:, None, :])              # [b, R]
        if metric == "l2":
            sims = (2 * sims - (q * q).sum(-1, keepdim=True)
                    - (keys_b * keys_b).sum(-1)).clamp_(max=0.0)
        sims = sims.masked_fill(torch.from_numpy(cand < 0), -math.inf)
        top_s, top = sims.topk(min(k, R), dim=1)
        out_s[r0:r0 + step, :top.shape[1]] = top_s.numpy()
        out_i[r0:r0 + step, :top.shape[1]] = np.take_along_axis(cand, top.numpy(), axis=1)
    out_i[np.isneginf(out_s)] = -1
    return out_s, out_i


def rescore(queries: Any, ids: np.ndarray, keys: Any, metric: str,
            max_elems: int = 1 << 24) -> np.ndarray:
    """Exact float32 similarities [n, K] of ``queries`` [n, d] to the keys at ``ids`` [n, K]
    (-1: -inf), in the given neighbour order ("real score" of Xu et al. §5.1)."""
    n, K = ids.shape
    d = int(keys.shape[1])
    out = np.full((n, K), -np.inf, dtype=np.float32)
    step = max(1, max_elems // max(1, K * d))
    for r0 in range(0, n, step):
        rows = np.asarray(ids[r0:r0 + step], dtype=np.int64)           # [b, K]
        valid = rows >= 0
        # Gather each distinct key once, in increasing order (sequential memmap reads).
        uniq, inverse = np.unique(rows[valid], return_inverse=True)
        gathered = np.zeros(rows.shape + (d,), dtype=np.float32)       # [b, K, d]
        gathered[valid] = np.asarray(keys[uniq], dtype=np.float32)[inverse]
        q = np.asarray(queries[r0:r0 + step], dtype=np.float32)[:, None, :]  # [b, 1, d]
        scores = similarity(q, gathered, metric).numpy()               # [b, K]
        out[r0:r0 + step] = np.where(valid, scores, -np.inf)
    return out
