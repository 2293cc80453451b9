"""The FAISS index over train keys, and an exact torch search backend with the same contract.

``build_index`` writes ``<workdir>/index/`` (see ``index_dir``): ``index.faiss`` (always a CPU
index, whatever device built it) and a manifest recording the key type (``final``/``att``), the
metric, the factory string actually used, shapes, timings, the features' base LM (so an index over
another model's features is refused) and recall@k against exact search on sampled train keys.

Similarity convention, everywhere in the package: **higher is better**. ``cos`` L2-normalises keys
and queries and scores by inner product, ``ip`` is the raw inner product, ``l2`` is the *negative*
squared L2 distance. Missing results (fewer keys than asked for) are id -1 with similarity -inf.

The build trains once on a seeded sample, then adds keys in fixed chunks; after each chunk the
partial index is written into the ``.partial`` folder and progress is recorded, so a killed build
reloads it (never retrains) and ends with the same bytes: faiss adds to a fixed trained IVF/PQ/Flat
index are deterministic for a fixed order. (HNSW adds are not, with several threads.)

``exact_search`` is a chunked matmul + top-k in torch over a possibly float16 memmap; STACK-NOTES
(9) measured it ~2x faster than ``IndexFlatIP`` on CPU, and it is the dependable path on CUDA
machines without faiss-gpu.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, read_manifest
from gnnlm.datastore import check_key, open_features
from gnnlm.models.base import FEATURE_KEYS

METRICS = ("cos", "ip", "l2")
INDEX_FILE = "index.faiss"
# faiss warns (and clusters badly) with fewer training points than this per centroid.
MIN_POINTS_PER_CENTROID = 39
# GPU faiss refuses k (and nprobe) above this; larger searches run on the CPU copy.
GPU_MAX_K = 2048


@dataclass
class IndexConfig:
    """How the index over train keys is built (``factory="auto"``: see ``auto_factory``)."""
    key: Literal["final", "att"] = "final"
    metric: Literal["cos", "ip", "l2"] = "cos"
    factory: str = "auto"
    nprobe: int = 32
    train_sample: int = 131072
    seed: int = 0
    add_chunk: int = 131072
    exact_below: int = 300_000
    device: Literal["auto", "cpu", "cuda"] = "auto"
    recall_queries: int = 1000

    def __post_init__(self):
        if self.key not in FEATURE_KEYS:
            raise ValueError(f"index.key must be one of {FEATURE_KEYS} (got {self.key!r}).")
        check_metric(self.metric)
        if not isinstance(self.factory, str) or not self.factory:
            raise ValueError(f"index.factory must be 'auto' or a faiss index_factory string "
                             f"such as 'IVF1024,PQ32' (got {self.factory!r}).")
        for name in ("nprobe", "train_sample", "add_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"index.{name} must be >= 1 (got {getattr(self, name)}).")
        for name in ("exact_below", "recall_queries"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"index.{name} must be >= 0 (got {getattr(self, name)}).")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"index.device must be 'auto', 'cpu' or 'cuda' (got {self.device!r}).")

    def fingerprint_config(self) -> dict:
        # The device does not define the artifact (an index built on GPU is used on CPU), and the
        # number of recall queries only changes a statistic in the manifest.
        cfg = asdict(self)
        cfg.pop("device")
        cfg.pop("recall_queries")
        return cfg


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS} (got {metric!r}).")


def faiss_metric(metric: str) -> int:
    check_metric(metric)
    return faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT


def index_dir(workdir: str | Path, tag: str | None = None) -> Path:
    """``<workdir>/index`` (or ``<workdir>/index/<tag>`` when one work dir holds several)."""
    return Path(workdir) / "index" if tag is None else Path(workdir) / "index" / tag


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise float32 rows in place (zero rows stay zero); the cos metric's key/query map."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    x /= norms
    return x


def _as_float32(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


# -- devices ---------------------------------------------------------------------------------
def faiss_has_gpu() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def resolve_faiss_device(device: str) -> str:
    """'cuda' when faiss-gpu is installed and sees a GPU (for 'auto' or 'cuda'), else 'cpu'."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' (got {device!r}).")
    if device == "cpu":
        return "cpu"
    if faiss_has_gpu():
        return "cuda"
    if device == "cuda":
        raise ValueError("device='cuda' asks for faiss-gpu, but this faiss has no GPU support or "
                         "sees no GPU. Install the `gpu` extra (faiss-gpu, after uninstalling "
                         "faiss-cpu), use device='auto', or use the exact torch backend on CUDA.")
    return "cpu"


def resolve_torch_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_GPU_RESOURCES = None


def _to_gpu(index: faiss.Index) -> faiss.Index:
    global _GPU_RESOURCES
    if _GPU_RESOURCES is None:
        _GPU_RESOURCES = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES, 0, index)


# -- choosing the index ----------------------------------------------------------------------
def _prev_pow2(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1)))))


def pq_subquantizers(d: int) -> int:
    """The divisor of d nearest d/4 (larger on a tie): ~4 dimensions per 8-bit sub-quantizer."""
    divisors = [m for m in range(1, d + 1) if d % m == 0]
    return min(divisors, key=lambda m: (abs(m - d / 4), -m))


def opq_helps(sample: np.ndarray, m: int, threshold: float = 2.0) -> bool:
    """True when the sample's variance is spread unevenly over the m contiguous sub-vectors.

    PQ gives every sub-vector the same 256 centroids, so sub-vectors holding most of the energy
    are quantised coarsely while near-constant ones waste codes. OPQ's learned rotation balances
    this (transformer features, with their few outlier dimensions, are the typical case: STACK-NOTES
    8 measured 65% -> 86% recall). On balanced data it only costs training time (minutes), so it
    is used when the largest sub-vector variance exceeds ``threshold`` times the smallest.
    """
    var = sample.var(axis=0, dtype=np.float64).reshape(m, -1).sum(axis=1)  # [m]
    return bool(var.max() > threshold * max(var.min(), 1e-30))


def auto_factory(n: int, d: int, sample: np.ndarray, config: IndexConfig) -> str:
    """The factory string for ``factory="auto"``.

    - fewer than ``exact_below`` keys: ``Flat`` (exact; fast enough and no recall loss);
    - else ``[OPQm,]IVF<nlist>,PQ<m>x<bits>np``: nlist = 4·sqrt(N) rounded to a power of two,
      capped so every list gets >= 39 training points (raise ``train_sample`` for more lists);
      m = the divisor of d nearest d/4; 8 bits per code, fewer only when the sample is too small
      to train 256 centroids; OPQ when ``opq_helps``; ``np`` skips polysemous training, which
      only serves Hamming-threshold search (unused here) and triples training time.
    """
    if n < config.exact_below:
        return "Flat"
    n_train = len(sample)
    nlist = min(1 << int(round(math.log2(4 * math.sqrt(n)))),
                _prev_pow2(n_train / MIN_POINTS_PER_CENTROID))
    m = pq_subquantizers(d)
    bits = int(min(8, max(1, math.floor(math.log2(n_train / MIN_POINTS_PER_CENTROID)))))
    opq = f"OPQ{m}," if opq_helps(sample, m) else ""
    return f"{opq}IVF{nlist},PQ{m}x{bits}np"


def _set_nprobe(index: faiss.Index, nprobe: int) -> None:
    if faiss.try_extract_index_ivf(index) is not None:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", int(nprobe))


# -- exact search ----------------------------------------------------------------------------
def _key_block(keys: Any, start: int, stop: int, device: torch.device) -> torch.Tensor:
    if isinstance(keys, torch.Tensor):
        return keys[start:stop].to(device=device, dtype=torch.float32)
    return torch.from_numpy(_as_float32(keys[start:stop])).to(device)


@torch.no_grad()
def exact_search(keys: Any, queries: Any, k: int, metric: str, device: str | torch.device = "cpu",
                 chunk: int = 65536, exclude: tuple[Any, int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of ``queries`` [n, d] among ``keys`` [N, d]: ``(sims float32, ids int64)``.

    Keys may be a float16 memmap or a torch tensor; they are converted to float32 one chunk at a
    time (keys are read once; every query is scored against each chunk). ``exclude=(positions
    [n], W)`` skips, for query row r, every key p with |p - positions[r]| < W (train-split
    leakage masking inside the search). Rows with fewer than k candidate keys end in id -1 /
    sim -inf. Similarities follow the module's convention (higher is better).
    """
    check_metric(metric)
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k}).")
    device = resolve_torch_device(device)
    n_keys = int(keys.shape[0])
    if isinstance(queries, torch.Tensor):
        q = queries.detach().to(device=device, dtype=torch.float32)
    else:
        q = torch.from_numpy(_as_float32(queries)).to(device)
    if q.ndim != 2 or q.shape[1] != keys.shape[1]:
        raise ValueError(f"queries must be [n, {keys.shape[1]}] like the keys "
                         f"(got {tuple(q.shape)}).")
    if metric == "cos":
        q = F.normalize(q, dim=1, eps=1e-12)
    n = q.shape[0]
    # Scores go to one reused [rows, chunk] buffer of ~2^24 floats (64 MB): allocating (and
    # first-touching) a fresh block per step cost ~30% of the time on CPU.
    width = max(1, min(chunk, n_keys))
    rows = max(1, min(n, (1 << 24) // width))
    buffer = torch.empty(rows * width, device=device)
    best_s = torch.full((n, k), -math.inf, device=device)          # [n, k]
    best_i = torch.full((n, k), -1, dtype=torch.int64, device=device)
    q_sq = (q * q).sum(1) if metric == "l2" else None                # [n]
    if exclude is not None:
        positions = torch.as_tensor(np.asarray(exclude[0], dtype=np.int64)).to(device)  # [n]
        window = int(exclude[1])
        offsets = torch.arange(-(window - 1), window, device=device) if window > 0 else None
    for start in range(0, n_keys, chunk):
        kc = _key_block(keys, start, min(start + chunk, n_keys), device)  # [c, d]
        c = kc.shape[0]
        if metric == "cos":
            kc = F.normalize(kc, dim=1, eps=1e-12)
        k_sq = (kc * kc).sum(1) if metric == "l2" else None           # [c]
        kk = min(k, c)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            s = buffer[:(r1 - r0) * c].view(r1 - r0, c)
            torch.mm(q[r0:r1], kc.T, out=s)                            # [r, c]
            if metric == "l2":
                # -|q - k|^2, clamped: rounding must not make a distance negative.
                s.mul_(2).sub_(q_sq[r0:r1, None]).sub_(k_sq[None]).clamp_(max=0.0)
            if exclude is not None and offsets is not None:
                cols = positions[r0:r1, None] + offsets[None]          # [r, 2W-1]
                hit = (cols >= start) & (cols < start + c)
                if bool(hit.any()):
                    row_ids = torch.arange(r1 - r0, device=device)[:, None].expand_as(cols)
                    s[row_ids[hit], cols[hit] - start] = -math.inf
            top_s, top_i = s.topk(kk, dim=1)                           # [r, kk]
            merged_s = torch.cat([best_s[r0:r1], top_s], dim=1)        # [r, k + kk]
            merged_i = torch.cat([best_i[r0:r1], top_i + start], dim=1)
            best_s[r0:r1], pos = merged_s.topk(k, dim=1)
            best_i[r0:r1] = merged_i.gather(1, pos)
    best_i[torch.isneginf(best_s)] = -1
    return best_s.cpu().numpy(), best_i.cpu().numpy()


def recall_at(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int) -> float:
    """Mean |approx top-k ∩ exact top-k| / k over queries (-1 ids never count)."""
    a, e = approx_ids[:, :k], exact_ids[:, :k]                        # [n, k]
    found = ((a[:, :, None] == e[:, None, :]) & (a[:, :, None] >= 0)).any(axis=2).sum(axis=1)
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
        self._cpu_index = None
        self.backend = "faiss" if index is not None else "exact"

    @classmethod
    def open(cls, index_dir: str | Path, nprobe: int | None = None,
             device: str = "auto") -> "Searcher":
        """A searcher over a built index (``nprobe`` defaults to the manifest's)."""
        manifest = read_manifest(index_dir, kind="index")
        index = faiss.read_index(str(Path(index_dir) / manifest["index_file"]))
        nprobe = int(manifest["nprobe"] if nprobe is None else nprobe)
        if nprobe < 1:
            raise ValueError(f"nprobe must be >= 1 (got {nprobe}).")
        _set_nprobe(index, nprobe)
        searcher = cls(metric=manifest["metric"], key=manifest["key"], ntotal=index.ntotal,
                       d=index.d, index=index, device="cpu", manifest=manifest)
        searcher.nprobe = nprobe
        if resolve_faiss_device(device) == "cuda":
            try:
                searcher._cpu_index = index
                searcher.index = _to_gpu(index)
                _set_nprobe(searcher.index, min(nprobe, GPU_MAX_K))
                searcher.device = "cuda"
            except RuntimeError as err:  # e.g. a PQ code size the GPU kernels lack
                warnings.warn(f"faiss-gpu could not take {manifest['factory']} ({err}); "
                              f"searching on CPU.")
                searcher.index, searcher._cpu_index = index, None
        return searcher

    @classmethod
    def exact(cls, train_features_dir: str | Path, key: str = "final", metric: str = "cos",
              device: str = "auto", chunk: int = 65536) -> "Searcher":
        """Exact search in torch over the stored train keys (the exact-neighbours ablation).

        On CUDA the float16 keys are copied to the GPU once when they fit in half the free
        memory; otherwise they stream from the memmap chunk by chunk.
        """
        check_metric(metric)
        manifest, arrays = open_features(train_features_dir)
        check_key(manifest, key)
        keys = arrays[key]
        torch_device = resolve_torch_device(device)
        if torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch_device)
            if keys.nbytes < free // 2:
                keys = torch.from_numpy(np.ascontiguousarray(keys)).to(torch_device)
        return cls(metric=metric, key=key, ntotal=keys.shape[0], d=keys.shape[1], keys=keys,
                   device=str(torch_device), chunk=chunk,
                   manifest={"base_lm": manifest["base_lm"], "features": manifest["fingerprint"],
                             "key": key, "metric": metric, "factory": "exact"})

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

    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        self.check(queries, k)
        if self.index is None:
            return exact_search(self.keys, queries, k, self.metric, self.device, self.chunk)
        if self.metric == "cos":  # a copy: never normalise the caller's array in place
            q = normalize_rows(np.array(queries, dtype=np.float32, copy=True, order="C"))
        else:
            q = _as_float32(queries)
        index = self.index
        if self._cpu_index is not None and k > GPU_MAX_K:
            index = self._cpu_index
        dist, ids = index.search(q, k)                                 # [n, k] each
        sims = -dist if self.metric == "l2" else dist
        sims[ids < 0] = -np.inf  # faiss pads with ±FLT_MAX
        return sims.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)


# -- building --------------------------------------------------------------------------------
def _read_keys(keys: np.ndarray, rows: np.ndarray | slice, metric: str) -> np.ndarray:
    x = _as_float32(keys[rows])
    return normalize_rows(x) if metric == "cos" else x


def _write_index(index: faiss.Index, path: Path, on_gpu: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(faiss.index_gpu_to_cpu(index) if on_gpu else index, str(tmp))
    os.replace(tmp, path)


def build_index(train_features_dir: str | Path, out_dir: str | Path,
                config: IndexConfig | None = None, rebuild: bool = False,
                stop_after_chunks: int | None = None) -> dict:
    """Build the index over the train features' ``config.key`` keys (skip / refuse / resume).

    ``stop_after_chunks`` stops after that many add chunks of this run (0: right after
    training) without completing: used to test resumption.
    """
    config = config or IndexConfig()
    feats_manifest, arrays = open_features(train_features_dir)
    check_key(feats_manifest, config.key)
    keys = arrays[config.key]                                          # [N, d] float16
    n, d = (int(s) for s in feats_manifest["arrays"][config.key]["shape"])
    if n == 0:
        raise ValueError(f"The features at {train_features_dir} hold no positions.")
    base_lm = feats_manifest["base_lm"]
    out_dir = Path(out_dir)
    if (out_dir / "manifest.json").is_file() and not rebuild:
        found = read_manifest(out_dir)
        made = found.get("base_lm") or {}
        if made.get("fingerprint") not in (None, base_lm["fingerprint"]):
            raise ArtifactError(
                f"The index at {out_dir} was built over features of base LM {made.get('name')} "
                f"(weights {made.get('fingerprint')}), but the features at {train_features_dir} "
                f"come from base LM {base_lm['name']} (weights {base_lm['fingerprint']}). Use "
                f"another work directory, delete the index, or rebuild it (--rebuild).")
    builder = ArtifactBuilder(
        out_dir, kind="index", config=config.fingerprint_config(),
        inputs={"features": feats_manifest["fingerprint"], "base_lm": base_lm["name"],
                "base_lm_fingerprint": base_lm["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    device = resolve_faiss_device(config.device)
    on_gpu = device == "cuda"
    n_chunks = -(-n // config.add_chunk)
    with builder:
        path = builder.file(INDEX_FILE)
        progress = builder.progress
        if progress.get("trained") and path.exists():
            # Resume: the saved index is the trained one plus the chunks already added.
            index = faiss.read_index(str(path))
            factory, train_seconds = progress["factory"], progress["train_seconds"]
            done = index.ntotal // config.add_chunk if index.ntotal < n else n_chunks
            if index.ntotal != min(done * config.add_chunk, n):
                raise ArtifactError(f"{path} holds {index.ntotal} keys, not a whole number of "
                                    f"add chunks of {config.add_chunk}: delete {builder.partial} "
                                    f"and build again.")
        else:
            t0 = time.perf_counter()
            rng = np.random.default_rng(config.seed)
            sample_rows = np.sort(rng.choice(n, size=min(config.train_sample, n), replace=False))
            sample = _read_keys(keys, sample_rows, config.metric)     # [n_train, d]
            factory = (auto_factory(n, d, sample, config) if config.factory == "auto"
                       else config.factory)
            try:
                index = faiss.index_factory(d, factory, faiss_metric(config.metric))
            except RuntimeError as err:
                raise ValueError(f"faiss cannot build index factory {factory!r} for d={d} "
                                 f"(got error: {str(err).strip().splitlines()[-1]}).") from err
            if not index.is_trained:
                trainer = _to_gpu(index) if on_gpu else index
                trainer.train(sample)
                index = faiss.index_gpu_to_cpu(trainer) if on_gpu else trainer
            del sample
            train_seconds = round(time.perf_counter() - t0, 3)
            _write_index(index, path, on_gpu=False)
            builder.save_progress(trained=True, factory=factory, train_seconds=train_seconds,
                                  chunks_done=0)
            done = 0
        if on_gpu:
            index = _to_gpu(index)
        t0 = time.perf_counter()
        for chunk in range(done, n_chunks):
            if stop_after_chunks is not None and chunk - done >= stop_after_chunks:
                return {}
            start = chunk * config.add_chunk
            index.add(_read_keys(keys, slice(start, min(start + config.add_chunk, n)),
                                 config.metric))
            _write_index(index, path, on_gpu)
            builder.save_progress(chunks_done=chunk + 1, add_seconds=round(
                progress.get("add_seconds", 0.0) + time.perf_counter() - t0, 3))
            t0 = time.perf_counter()
        cpu_index = faiss.read_index(str(path))  # exactly the bytes that ship
        recall, recall_seconds = _measure_recall(cpu_index, keys, config)
        return builder.finish(extra={
            "key": config.key, "metric": config.metric, "factory": factory,
            "factory_requested": config.factory, "n": n, "d": d, "nprobe": config.nprobe,
            "train_points": min(config.train_sample, n), "train_seconds": train_seconds,
            "add_seconds": progress.get("add_seconds", 0.0), "recall": recall,
            "recall_queries": min(config.recall_queries, n), "recall_seconds": recall_seconds,
            "base_lm": base_lm, "features": feats_manifest["fingerprint"],
            "features_split": feats_manifest.get("config", {}).get("split"),
            "index_file": INDEX_FILE, "index_bytes": path.stat().st_size, "device": device,
            "faiss_version": faiss.__version__})


def _measure_recall(index: faiss.Index, keys: np.ndarray, config: IndexConfig
                    ) -> tuple[dict[str, float], float]:
    """recall@k (k = 10 and 100, or the datastore size if smaller) against exact search."""
    n = index.ntotal
    n_queries = min(config.recall_queries, n)
    if n_queries == 0:
        return {}, 0.0
    t0 = time.perf_counter()
    ks = sorted({min(10, n), min(100, n)})
    rng = np.random.default_rng([config.seed, 1])  # not the training sample's stream
    rows = np.sort(rng.choice(n, size=n_queries, replace=False))
    queries = _as_float32(keys[rows])
    _set_nprobe(index, config.nprobe)
    searcher = Searcher(metric=config.metric, key=config.key, ntotal=n, d=index.d, index=index)
    _, approx = searcher.search(queries, ks[-1])
    _, exact = exact_search(keys, queries, ks[-1], config.metric)
    recall = {str(k): round(recall_at(approx, exact, k), 4) for k in ks}
    return recall, round(time.perf_counter() - t0, 3)
