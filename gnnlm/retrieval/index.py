"""The FAISS index over train keys: the ``auto`` choice of index, and the resumable build.

``build_index(workdir, config)`` writes ``workdir.index(key, metric)``: ``index.faiss`` (always a
CPU index, whatever device built it) and a manifest recording the key type (``final``/``att``),
the metric, the factory string actually used, shapes, timings, the features' base LM (so an index
over another model's features is refused) and the search settings' recall against exact search
on held-out queries, the valid split's features (``gnnlm.retrieval.tuning``; train keys would find
themselves). Searching is ``gnnlm.retrieval.search.Searcher``.

The build trains once on a seeded sample, then adds keys in fixed chunks; after each chunk the
partial index is written into the ``.partial`` folder and progress is recorded, so a killed build
reloads it (never retrains) and ends with the same bytes: faiss adds to a fixed trained IVF/PQ/Flat
index are deterministic for a fixed order. (HNSW adds are not, with several threads.)
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from gnnlm.retrieval.features import check_key, open_features
from gnnlm.retrieval.search import _as_float32, faiss_metric, normalize_rows, to_gpu
from gnnlm.retrieval.settings import (  # noqa: F401  (the settings, importable from here too)
    FACTORY_CHECK_DIM,
    MIN_POINTS_PER_CENTROID,
    IndexConfig,
    check_metric,
)
from gnnlm.retrieval.torch_ivf import add_assigned, train_ivf, trains_on_torch
from gnnlm.retrieval.tuning import tune
from gnnlm.utils.devices import faiss_device, torch_device
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError

INDEX_FILE = "index.faiss"


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
    this (transformer features, with their few outlier dimensions, are the typical case: on
    clustered data PQ32 found 65% of the true top 32, 86% with OPQ). On balanced data it only
    costs training time (minutes), so it is used when the largest sub-vector variance exceeds
    ``threshold`` times the smallest.
    """
    var = sample.var(axis=0, dtype=np.float64).reshape(m, -1).sum(axis=1)  # [m]
    return bool(var.max() > threshold * max(var.min(), 1e-30))


def auto_factory(n: int, d: int, sample: np.ndarray, config: IndexConfig) -> str:
    """The factory string for ``factory="auto"``.

    - fewer than ``exact_below`` keys: ``Flat`` (exact; fast enough and no recall loss);
    - codes of at most ``code_budget_gb`` at one byte per dimension: ``IVF<nlist>,SQ8``. Its
      distances are close to exact, so the true neighbours are in its top k and re-ranking
      them exactly from the stored keys (``gnnlm.retrieval.tuning``) gives recall@10 above 0.9 with
      few lists probed (measured on the WikiText-2 datastore: 0.92 at nprobe 4, where
      ``IVF4096,PQ32x8np`` found 0.23 at any nprobe, and 0.89 only with 8x re-ranking);
    - else ``[OPQm,]IVF<nlist>,PQ<m>x<bits>np``, 4x smaller, which needs wider re-ranking:
      m = the divisor of d nearest d/4; 8 bits per code, fewer only when the sample is too
      small to train 256 centroids; OPQ when ``opq_helps``; ``np`` skips polysemous training,
      which only serves Hamming-threshold search (unused here) and triples training time.

    nlist = 4·sqrt(N) rounded to a power of two, capped so every list gets >= 39 training
    points (raise ``train_sample`` for more lists).
    """
    if n < config.exact_below:
        return "Flat"
    n_train = len(sample)
    nlist = min(1 << int(round(math.log2(4 * math.sqrt(n)))),
                _prev_pow2(n_train / MIN_POINTS_PER_CENTROID))
    if n * d <= config.code_budget_gb * 1e9:
        return f"IVF{nlist},SQ8"
    m = pq_subquantizers(d)
    bits = int(min(8, max(1, math.floor(math.log2(n_train / MIN_POINTS_PER_CENTROID)))))
    opq = f"OPQ{m}," if opq_helps(sample, m) else ""
    return f"{opq}IVF{nlist},PQ{m}x{bits}np"


# -- building --------------------------------------------------------------------------------
def _read_keys(keys: np.ndarray, rows: np.ndarray | slice, metric: str) -> np.ndarray:
    x = _as_float32(keys[rows])
    return normalize_rows(x) if metric == "cos" else x


def _write_index(index: faiss.Index, path: Path, on_gpu: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(faiss.index_gpu_to_cpu(index) if on_gpu else index, str(tmp))
    os.replace(tmp, path)


def build_index(workdir: Workdir, key: str, metric: str, config: IndexConfig | None = None,
                rebuild: bool = False, stop_after_chunks: int | None = None,
                search_k: int | None = None, search_width: int | None = None) -> dict:
    """Build the index over the train features' ``key`` keys under ``metric`` (skip / refuse /
    resume) into ``workdir.index(key, metric)``: train it (``_trained_index``), add the keys in
    chunks (``_add_chunks``), measure its search settings (``_choose_search``), and write the
    manifest.

    ``search_k`` is the depth the neighbours stage will search at (``neighbors.K``): the search
    settings are measured that deep and the table records recall@K (``gnnlm.retrieval.tuning``).
    ``search_width`` is the widest search it will ask for (K plus the leakage margin of train
    queries; default ``search_k``): no setting GPU faiss cannot run at that width is chosen.
    Both only shape the measurement, recorded in the manifest (``tuning_k``, ``tuning_width``),
    never the index: an index built without them (or for another K) is accepted as it is.
    ``stop_after_chunks`` stops after that many add chunks of this run (0: right after
    training) without completing: used to test resumption.
    """
    config = config or IndexConfig()
    check_metric(metric)
    for name, value in (("search_k", search_k), ("search_width", search_width)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be >= 1 or None (got {value}).")
    feats_manifest, keys = _train_keys(workdir, key)                  # [N, d] float16
    n, d = keys.shape
    base_lm = feats_manifest["base_lm"]
    out_dir = workdir.index(key, metric)
    builder = ArtifactBuilder(
        out_dir, kind="index", config={"key": key, "metric": metric,
                                       **config.fingerprint_config()},
        inputs={"features": feats_manifest["fingerprint"],
                "base_lm_fingerprint": base_lm["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    # before any training: a build that cannot measure its search settings fails in seconds
    queries = _held_out_queries(workdir, key, n, base_lm, config)
    device = faiss_device(config.device)
    with builder:
        path = builder.file(INDEX_FILE)
        index = _trained_index(builder, path, keys, metric, config, on_gpu=device == "cuda",
                               clustering=clustering_of(config, device))
        _add_chunks(builder, index, path, keys, f"index {key}-{metric}", metric, config,
                    on_gpu=device == "cuda", stop_after_chunks=stop_after_chunks)
        if builder.interrupted:
            return {}
        measured = _measured_search(path, keys, queries, key, metric, config, search_k,
                                    search_width)
        progress = builder.progress
        return builder.finish(extra={
            "key": key, "metric": metric, "factory": progress["factory"],
            "factory_requested": config.factory, "n": n, "d": d, **measured,
            "train_points": min(config.train_sample, n),
            "train_seconds": progress["train_seconds"],
            "add_seconds": progress.get("add_seconds", 0.0),
            "base_lm": base_lm, "features": feats_manifest["fingerprint"],
            "index_file": INDEX_FILE, "index_bytes": path.stat().st_size, "device": device,
            "clustering": progress["clustering"],
            "faiss_version": faiss.__version__})


def _train_keys(workdir: Workdir, key: str) -> tuple[dict, np.ndarray]:
    """The train features' manifest and their ``key`` keys [N, d] (float16, memory-mapped)."""
    feats_manifest, arrays = open_features(workdir.features("train"))
    check_key(feats_manifest, key)
    keys = arrays[key]
    n = int(feats_manifest["arrays"][key]["shape"][0])
    if n == 0:
        raise ValueError(f"The features at {workdir.features('train')} hold no positions.")
    return feats_manifest, keys


def clustering_of(config: IndexConfig, faiss_on: str) -> str:
    """What runs k-means and list assignment (``IndexConfig.clustering``): ``auto`` is torch
    when torch sees a GPU and faiss (on ``faiss_on``) does not use one."""
    if config.clustering != "auto":
        return config.clustering
    return "torch" if torch.cuda.is_available() and faiss_on != "cuda" else "faiss"


def _trained_index(builder: ArtifactBuilder, path: Path, keys: np.ndarray, metric: str,
                   config: IndexConfig, on_gpu: bool, clustering: str) -> faiss.Index:
    """The trained index, on the CPU, with the chunks a killed build added: reloaded from the
    ``.partial`` folder when one was saved (never retrained), else trained on a seeded sample of
    ``train_sample`` keys and saved with its factory and training time in the progress."""
    n, d = keys.shape
    progress = builder.progress
    if progress.get("trained") and path.exists():
        index = faiss.read_index(str(path))
        # the index file, written after each chunk, is the record of what was added
        n_chunks = -(-n // config.add_chunk)
        done = index.ntotal // config.add_chunk if index.ntotal < n else n_chunks
        if index.ntotal != min(done * config.add_chunk, n):
            raise ArtifactError(f"{path} holds {index.ntotal} keys, not a whole number of "
                                f"add chunks of {config.add_chunk}: delete {builder.partial} "
                                f"and build again.")
        progress["chunks_done"] = done
        return index
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    sample_rows = np.sort(rng.choice(n, size=min(config.train_sample, n), replace=False))
    sample = _read_keys(keys, sample_rows, metric)                     # [n_train, d]
    factory = (auto_factory(n, d, sample, config) if config.factory == "auto"
               else config.factory)
    try:
        index = faiss.index_factory(d, factory, faiss_metric(metric))
    except RuntimeError as err:
        raise ValueError(f"faiss cannot build index factory {factory!r} for d={d} "
                         f"(got error: {str(err).strip().splitlines()[-1]}).") from err
    if clustering == "torch" and not trains_on_torch(index):
        clustering = "faiss"  # an index behind a transform (OPQ): faiss trains it whole
    if not index.is_trained and clustering == "torch":
        train_ivf(index, sample, torch_device("auto"))
    elif not index.is_trained:
        trainer = to_gpu(index) if on_gpu else index
        trainer.train(sample)
        index = faiss.index_gpu_to_cpu(trainer) if on_gpu else trainer
    del sample
    train_seconds = round(time.perf_counter() - t0, 3)
    _write_index(index, path, on_gpu=False)
    builder.save_progress(trained=True, factory=factory, train_seconds=train_seconds,
                          chunks_done=0, clustering=clustering)
    return index


def _add_chunks(builder: ArtifactBuilder, index: faiss.Index, path: Path, keys: np.ndarray,
                desc: str, metric: str, config: IndexConfig, on_gpu: bool,
                stop_after_chunks: int | None) -> None:
    """Add the keys in fixed chunks of ``add_chunk`` from the first one not added yet, writing
    the index after each (the resumption point) and the time spent in the progress."""
    n = len(keys)
    progress = builder.progress
    # as the training ran (a build from before this was recorded: faiss)
    clustering = progress.setdefault("clustering", "faiss")
    on_gpu = on_gpu and clustering == "faiss"
    if on_gpu:
        index = to_gpu(index)
    for chunk in builder.chunks(-(-n // config.add_chunk), desc, stop_after_chunks):
        t0 = time.perf_counter()
        start = chunk * config.add_chunk
        rows = _read_keys(keys, slice(start, min(start + config.add_chunk, n)), metric)
        if clustering == "torch":
            add_assigned(index, rows, torch_device("auto"))
        else:
            index.add(rows)
        _write_index(index, path, on_gpu)
        progress["add_seconds"] = round(
            progress.get("add_seconds", 0.0) + time.perf_counter() - t0, 3)


def _measured_search(path: Path, keys: np.ndarray, queries: np.ndarray | None, key: str,
                     metric: str, config: IndexConfig, search_k: int | None,
                     search_width: int | None) -> dict:
    """What the manifest records of the search settings, measured on the index file as written
    (exactly the bytes that ship): the chosen ``nprobe`` and ``rerank``, the table, recall."""
    cpu_index = faiss.read_index(str(path))
    t0 = time.perf_counter()
    search, table = _choose_search(cpu_index, keys, queries, key, metric, config,
                                   search_k, search_width)
    recall = {name.split("@")[1]: value for name, value in search.items()
              if name.startswith("recall@")}
    return {"nprobe": search["nprobe"], "rerank": search["rerank"], "search": search,
            "tuning": table, "target_recall": config.target_recall, "recall": recall,
            "recall_queries": 0 if queries is None else len(queries),
            # what the table was measured for (the neighbours' K and widest search); named
            # apart from the neighbours manifest's search_k, which is its width
            "tuning_k": search_k, "tuning_width": search_width or search_k,
            "recall_seconds": round(time.perf_counter() - t0, 3)}


def _held_out_queries(workdir: Workdir, key: str, n: int, base_lm: dict,
                      config: IndexConfig) -> np.ndarray | None:
    """``recall_queries`` (at most n) seeded rows of the valid split's ``key`` features, float32;
    None when ``recall_queries`` is 0. Train keys are refused as queries: each would find
    itself, inflating recall."""
    n_queries = min(config.recall_queries, n)
    if n_queries == 0:
        return None
    where = workdir.features("valid")
    try:
        manifest, arrays = open_features(where)
        source = arrays[key]
    except (ArtifactError, KeyError) as err:
        raise ArtifactError(
            f"Measuring the index's search settings needs held-out queries, the valid split's "
            f"{key!r} features, but {where} holds no complete ones (train keys would find "
            f"themselves): build the valid features first, as `gnnlm pipeline` does, or set "
            f"index.recall_queries: 0 to skip measuring.") from err
    if manifest["base_lm"]["fingerprint"] != base_lm["fingerprint"]:
        raise ArtifactError(
            f"The valid features at {where} come from base LM {manifest['base_lm']['name']} "
            f"(weights {manifest['base_lm']['fingerprint']}), the train keys from "
            f"{base_lm['name']} (weights {base_lm['fingerprint']}): their recall would mean "
            f"nothing. Encode valid with the train features' model, or set "
            f"index.recall_queries: 0.")
    rng = np.random.default_rng([config.seed, 1])  # not the training sample's stream
    rows = np.sort(rng.choice(len(source), size=min(n_queries, len(source)), replace=False))
    return _as_float32(source[rows])


def _choose_search(index: faiss.Index, keys: np.ndarray, queries: np.ndarray | None, key: str,
                   metric: str, config: IndexConfig, search_k: int | None = None,
                   search_width: int | None = None) -> tuple[dict, list[dict]]:
    """The search settings to use and the measured table (see ``gnnlm.retrieval.tuning``) on the
    held-out ``queries`` (None: nothing measured, the index's exact defaults)."""
    if queries is None or len(queries) == 0:
        return {"nprobe": 1, "rerank": 0.0}, []
    ivf = faiss.try_extract_index_ivf(index)
    nprobes = [p for p in (4, 8, 16, 32, 64) if p <= ivf.nlist] if ivf is not None else [1]
    reranks = [0.0, 1.0, 2.0, 4.0] if ivf is not None else [0.0]
    return tune(index, keys, queries, key, metric, nprobes, reranks, config.target_recall,
                search_k=search_k, search_width=search_width)
