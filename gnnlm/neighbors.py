"""Neighbours for every position of a split: the retrieval that GNN-LM and kNN-LM build on.

For split s, ``workdir.neighbors(key, metric, s)`` holds, per position t:

- ``ids`` int32 [N, K]: train positions of the K nearest train keys, best first, -1 = none;
- ``sims`` float32 [N, K]: their similarities as the search returned them (the "FAISS scores"
  of Xu et al. §5.1; higher is better, l2 = negative squared distance), -inf where ids is -1.

Queries are the split's features of the index's key type. The datastore holds train positions
only, so train queries would find their own future. A feature at train position p was computed
from the W tokens before its target (W: the features' context length) and predicts target p, so
it has read, or is, the target of every position t with p − W ≤ t ≤ p. For ``split == "train"``
every neighbour p with t ≤ p ≤ t + W is therefore dropped: it has read the query's target
(GNN-LM §3.1, "Data Leakage Prevention"). At most W + 1 keys lie in that window, so train queries
search ``K + W + 1`` candidates and keep the first K unmasked ones: the result never holds a
masked position and never has fewer than K neighbours for lack of width. The manifest records
``masked_fraction`` (dropped / retrieved candidates) and ``masked_fraction_top_k`` (the share of
the unmasked search's top K that leakage removed). Valid/test queries are not masked.

``backend="exact"`` searches exactly in torch over the stored train keys (Xu et al.'s "real
mask" ablation); ``"index"`` uses the FAISS index ("FAISS mask"). The build goes in fixed chunks
of positions with progress after each, so a killed build resumes and ends with the same bytes.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, check_inputs, open_array, read_manifest
from gnnlm.datastore import check_key, open_features
from gnnlm.search import Searcher
from gnnlm.workdir import Workdir


@dataclass
class NeighborsConfig:
    """Retrieval for every position.

    ``leakage_window`` is W for train queries: how many tokens back a feature has read; None
    takes the ``leakage_window`` argument of ``build_neighbors``, which the pipeline sets to the
    features' context length. 0 disables masking (an ablation only).
    ``train_queries`` retrieves for the first N train positions only (the prefix that heads
    train on; the datastore itself stays whole); valid and test always get every position.
    """
    K: int = 1024
    leakage_window: int | None = None
    train_queries: int | None = None
    batch_size: int = 4096
    backend: Literal["index", "exact"] = "index"
    chunk: int = 65536

    def __post_init__(self):
        for name in ("K", "batch_size", "chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"neighbors.{name} must be >= 1 (got {getattr(self, name)}).")
        if self.train_queries is not None and self.train_queries < 1:
            raise ValueError(f"neighbors.train_queries must be >= 1 or None for all "
                             f"(got {self.train_queries}).")
        if self.leakage_window is not None and self.leakage_window < 0:
            raise ValueError(f"neighbors.leakage_window must be >= 0 or None for the base LM's "
                             f"context length (got {self.leakage_window}).")
        if self.backend not in ("index", "exact"):
            raise ValueError(f"neighbors.backend must be 'index' or 'exact' "
                             f"(got {self.backend!r}).")


def mask_leakage(sims: np.ndarray, ids: np.ndarray, positions: np.ndarray, window: int, K: int
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Drop candidates p with t ≤ p ≤ t + window (they have read the target t) and keep the
    first K others, order preserved.

    ``sims``/``ids`` [n, width] best first, ``positions`` [n] the query positions t.
    Returns ``(sims [n, K], ids [n, K], counts)``; missing slots are -1 / -inf.
    """
    valid = ids >= 0                                                   # [n, width]
    ahead = ids - positions[:, None]                                   # [n, width]
    masked = valid & (ahead >= 0) & (ahead <= window)
    keep = valid & ~masked
    # A stable sort of "not kept" moves kept candidates to the front in their search order.
    order = np.argsort(~keep, axis=1, kind="stable")[:, :K]            # [n, K]
    out_ids = np.take_along_axis(ids, order, axis=1)
    out_sims = np.take_along_axis(sims, order, axis=1)
    kept = np.take_along_axis(keep, order, axis=1)
    out_ids[~kept] = -1
    out_sims[~kept] = -np.inf
    counts = {"retrieved": int(valid.sum()), "dropped": int(masked.sum()),
              "retrieved_top_k": int(valid[:, :K].sum()),
              "dropped_top_k": int(masked[:, :K].sum())}
    return out_sims, out_ids, counts


def build_neighbors(workdir: Workdir, split: str, key: str, metric: str,
                    config: NeighborsConfig | None = None, leakage_window: int | None = None,
                    rebuild: bool = False, stop_after_chunks: int | None = None,
                    device: str = "auto") -> dict:
    """Neighbours of every position of ``split`` among the train ``key`` keys under ``metric``
    (skips a complete build; resumes a partial one).

    ``config.backend`` picks the FAISS index ``workdir.index(key, metric)`` or exact search over
    the same keys. ``stop_after_chunks`` stops early without completing (used to test
    resumption).
    """
    config = config or NeighborsConfig()
    index_path = workdir.index(key, metric)
    index_manifest = read_manifest(index_path, kind="index")
    query_manifest, query_arrays = open_features(workdir.features(split))
    train_manifest, _ = open_features(workdir.features("train"))
    made, asked = index_manifest["base_lm"], query_manifest["base_lm"]
    if made["fingerprint"] != asked["fingerprint"]:
        raise ArtifactError(
            f"The {split} features at {workdir.features(split)} come from base LM "
            f"{asked['name']} (weights {asked['fingerprint']}), but the index at {index_path} "
            f"holds keys of base LM {made['name']} (weights {made['fingerprint']}): their vectors "
            f"live in different spaces. Encode {split} with the model that made the index, or "
            f"rebuild the index.")
    check_inputs(index_manifest, index_path, {"features": train_manifest["fingerprint"]},
                 "Neighbour ids would point at other positions: rebuild the index over these "
                 "train features (--rebuild).")
    check_key(query_manifest, key)
    masked = split == "train"
    given = config.leakage_window if config.leakage_window is not None else leakage_window
    if masked and given is None:
        raise ValueError("Train queries need a leakage window W (neighbors.leakage_window, "
                         "default: the base LM's context length) (got None).")
    window = int(given) if masked and given is not None else 0
    queries = query_arrays[key]                                        # [N, d] float16
    n = int(queries.shape[0])
    if split == "train" and config.train_queries is not None:
        n = min(n, config.train_queries)  # heads train on this prefix; the datastore stays whole
    ntotal = int(index_manifest["n"])
    if config.K > ntotal:
        raise ValueError(f"neighbors.K must not exceed the datastore size {ntotal} "
                         f"(got {config.K}): lower K or build a larger datastore.")
    width = min(config.K + window + 1, ntotal) if masked and window > 0 else config.K
    out_dir = workdir.neighbors(key, metric, split)
    builder = ArtifactBuilder(
        out_dir, kind="neighbors",
        config={**asdict(config), "leakage_window": window if masked else None, "split": split},
        inputs={"index": index_manifest["fingerprint"], "features": query_manifest["fingerprint"],
                "train_features": train_manifest["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    if config.backend == "index":
        searcher = Searcher.open(index_path, device=device)
    else:
        searcher = Searcher.exact(workdir, key, metric, device=device)
    n_chunks = -(-n // config.chunk)
    names = ("retrieved", "dropped", "retrieved_top_k", "dropped_top_k")
    with builder:
        ids_out = builder.array("ids", np.int32, (n, config.K))
        sims_out = builder.array("sims", np.float32, (n, config.K))
        counts = builder.progress
        for chunk in builder.chunks(n_chunks, f"neighbours {split}", stop_after_chunks):
            t0 = time.perf_counter()
            stop = min((chunk + 1) * config.chunk, n)
            for start in range(chunk * config.chunk, stop, config.batch_size):
                end = min(start + config.batch_size, stop)
                sims, ids = searcher.search(np.asarray(queries[start:end], dtype=np.float32),
                                            width)                     # [b, width]
                if masked and window > 0:
                    positions = np.arange(start, end, dtype=np.int64)
                    sims, ids, c = mask_leakage(sims, ids, positions, window, config.K)
                    for name in names:
                        counts[name] = counts.get(name, 0) + c[name]
                else:
                    sims, ids = sims[:, :config.K], ids[:, :config.K]
                ids_out[start:end] = ids
                sims_out[start:end] = sims
            counts["search_seconds"] = counts.get("search_seconds", 0.0) + time.perf_counter() - t0
        if builder.interrupted:
            return {}
        seconds = counts.get("search_seconds", 0.0)
        stats = {}
        if masked:
            totals = {name: counts.get(name, 0) for name in names}
            stats = {**totals,
                     "masked_fraction": totals["dropped"] / max(totals["retrieved"], 1),
                     "masked_fraction_top_k": (totals["dropped_top_k"]
                                               / max(totals["retrieved_top_k"], 1))}
        return builder.finish(extra={
            "split": split, "n": n, "K": config.K, "key": key, "metric": metric,
            "backend": config.backend,
            "factory": index_manifest["factory"] if config.backend == "index" else "exact",
            "nprobe": getattr(searcher, "nprobe", None),
            "leakage_window": window if masked else None, "search_k": width, "masked": masked,
            **stats,
            "base_lm": asked, "index_recall": index_manifest.get("recall"),
            "search_seconds": round(seconds, 3),
            "queries_per_s": round(n / seconds, 1) if seconds > 0 else None})


def neighbor_values(ids: np.ndarray, train_targets: np.ndarray) -> np.ndarray:
    """The values (the train tokens that followed) of neighbour ids [..., K]; -1 where id is -1."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.where(ids >= 0, np.asarray(train_targets)[np.maximum(ids, 0)], -1)


def neighbor_hits(ids: np.ndarray, train_targets: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Bool [n, K]: does neighbour i's value equal the query's target (False where id is -1)."""
    values = neighbor_values(ids, train_targets)
    return (values == np.asarray(targets, dtype=np.int64)[:, None]) & (values >= 0)


def open_neighbors(path: str | Path) -> tuple[dict, dict]:
    """``(manifest, {"ids": memmap [N, K], "sims": memmap [N, K]})`` of a neighbours folder
    (``workdir.neighbors(key, metric, split)``)."""
    manifest = read_manifest(path, kind="neighbors")
    return manifest, {name: open_array(path, name, manifest) for name in ("ids", "sims")}
