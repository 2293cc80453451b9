"""Neighbours for every position of a split: the retrieval that GNN-LM and kNN-LM build on.

For split s, ``<workdir>/neighbors/<s>/`` (see ``neighbors_dir``) holds, per position t:

- ``ids`` int32 [N, K]: train positions of the K nearest train keys, best first, -1 = none;
- ``sims`` float32 [N, K]: their similarities as the search returned them (the "FAISS scores"
  of Xu et al. §5.1; higher is better, l2 = negative squared distance), -inf where ids is -1.

Queries are the split's features of the index's key type. The datastore holds train positions
only, so train queries would find their own future: for ``split == "train"`` every neighbour p
with |p - t| < W is dropped (DESIGN.md "Leakage"; W defaults to the base LM's context length,
passed by the caller). At most 2W - 1 keys lie in that window, so train queries search
``K + 2W - 1`` candidates and keep the first K unmasked ones: the result never holds a masked
position and never has fewer than K neighbours for lack of width. The manifest records
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
from tqdm import tqdm

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, open_array, read_manifest
from gnnlm.datastore import check_key, open_features
from gnnlm.index import Searcher


@dataclass
class NeighborsConfig:
    """Retrieval for every position.

    ``leakage_window`` is W for train queries; None takes the ``leakage_window`` argument of
    ``build_neighbors``, which the pipeline sets to the base LM's context length (a train
    position's feature has seen at most that many tokens before it, and its value is the next
    token, so nearer positions share its future). 0 disables masking (an ablation only).
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


def neighbors_dir(workdir: str | Path, split: str, tag: str | None = None) -> Path:
    """``<workdir>/neighbors/<split>`` (or ``neighbors/<tag>/<split>`` for several indexes)."""
    root = Path(workdir) / "neighbors"
    return root / split if tag is None else root / tag / split


def mask_leakage(sims: np.ndarray, ids: np.ndarray, positions: np.ndarray, window: int, K: int
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Drop candidates p with |p - t| < window and keep the first K others, order preserved.

    ``sims``/``ids`` [n, width] best first, ``positions`` [n] the query positions t.
    Returns ``(sims [n, K], ids [n, K], counts)``; missing slots are -1 / -inf.
    """
    valid = ids >= 0                                                   # [n, width]
    masked = valid & (np.abs(ids - positions[:, None]) < window)
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


def build_neighbors(split: str, query_features_dir: str | Path, train_features_dir: str | Path,
                    index_dir: str | Path, out_dir: str | Path,
                    config: NeighborsConfig | None = None, leakage_window: int | None = None,
                    rebuild: bool = False, stop_after_chunks: int | None = None,
                    device: str = "auto") -> dict:
    """Neighbours of every position of ``split`` (skips a complete build; resumes a partial one).

    The index manifest gives the key type and metric for both backends (the exact backend
    searches the same keys with the same metric). ``stop_after_chunks`` stops early without
    completing (used to test resumption).
    """
    config = config or NeighborsConfig()
    index_manifest = read_manifest(index_dir, kind="index")
    key, metric = index_manifest["key"], index_manifest["metric"]
    query_manifest, query_arrays = open_features(query_features_dir)
    train_manifest, _ = open_features(train_features_dir)
    made, asked = index_manifest["base_lm"], query_manifest["base_lm"]
    if made["fingerprint"] != asked["fingerprint"]:
        raise ArtifactError(
            f"The query features at {query_features_dir} come from base LM {asked['name']} "
            f"(weights {asked['fingerprint']}), but the index at {index_dir} holds keys of base "
            f"LM {made['name']} (weights {made['fingerprint']}): their vectors live in different "
            f"spaces. Encode {split} with the model that made the index, or rebuild the index.")
    if train_manifest["fingerprint"] != index_manifest["features"]:
        raise ArtifactError(
            f"The index at {index_dir} was built over features {index_manifest['features']}, "
            f"not over the train features at {train_features_dir} "
            f"({train_manifest['fingerprint']}): neighbour ids would point at other positions. "
            f"Rebuild the index over these features.")
    check_key(query_manifest, key)
    masked = split == "train"
    window = config.leakage_window if config.leakage_window is not None else leakage_window
    if masked:
        if window is None:
            raise ValueError("Train queries need a leakage window W (neighbors.leakage_window, "
                             "default: the base LM's context length) (got None).")
        if query_manifest["fingerprint"] != index_manifest["features"]:
            raise ArtifactError(
                f"split 'train' queries must be the index's own features "
                f"({index_manifest['features']}) so that leakage masking compares the same "
                f"positions, but {query_features_dir} holds features "
                f"{query_manifest['fingerprint']}.")
        window = int(window)
    else:
        window = None
    queries = query_arrays[key]                                        # [N, d] float16
    n = int(queries.shape[0])
    if split == "train" and config.train_queries is not None:
        n = min(n, config.train_queries)  # heads train on this prefix; the datastore stays whole
    ntotal = int(index_manifest["n"])
    if config.K > ntotal:
        raise ValueError(f"neighbors.K must not exceed the datastore size {ntotal} "
                         f"(got {config.K}): lower K or build a larger datastore.")
    width = min(config.K + 2 * window - 1, ntotal) if masked and window > 0 else config.K
    builder = ArtifactBuilder(
        out_dir, kind="neighbors",
        config={**asdict(config), "leakage_window": window, "split": split},
        inputs={"index": index_manifest["fingerprint"], "features": query_manifest["fingerprint"],
                "train_features": train_manifest["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    if config.backend == "index":
        searcher = Searcher.open(index_dir, device=device)
    else:
        searcher = Searcher.exact(train_features_dir, key, metric, device=device)
    n_chunks = -(-n // config.chunk)
    names = ("retrieved", "dropped", "retrieved_top_k", "dropped_top_k")
    with builder:
        ids_out = builder.array("ids", np.int32, (n, config.K))
        sims_out = builder.array("sims", np.float32, (n, config.K))
        done = builder.progress.get("chunks_done", 0)
        counts = {name: builder.progress.get(name, 0) for name in names}
        seconds = builder.progress.get("search_seconds", 0.0)
        bar = tqdm(total=n_chunks, initial=done, desc=f"neighbours {split}", unit="chunk",
                   disable=None)
        for chunk in range(done, n_chunks):
            if stop_after_chunks is not None and chunk - done >= stop_after_chunks:
                return {}
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
                        counts[name] += c[name]
                else:
                    sims, ids = sims[:, :config.K], ids[:, :config.K]
                ids_out[start:end] = ids
                sims_out[start:end] = sims
            seconds += time.perf_counter() - t0
            builder.save_progress(chunks_done=chunk + 1, search_seconds=seconds, **counts)
            bar.update(1)
        bar.close()
        stats = {}
        if masked:
            stats = {**counts,
                     "masked_fraction": counts["dropped"] / max(counts["retrieved"], 1),
                     "masked_fraction_top_k": (counts["dropped_top_k"]
                                               / max(counts["retrieved_top_k"], 1))}
        return builder.finish(extra={
            "split": split, "n": n, "K": config.K, "key": key, "metric": metric,
            "backend": config.backend,
            "factory": index_manifest["factory"] if config.backend == "index" else "exact",
            "nprobe": getattr(searcher, "nprobe", None),
            "leakage_window": window, "search_k": width, "masked": masked, **stats,
            "base_lm": asked, "index_recall": index_manifest.get("recall"),
            "search_seconds": round(seconds, 3),
            "queries_per_s": round(n / seconds, 1) if seconds > 0 else None})


def open_neighbors(path: str | Path) -> tuple[dict, dict]:
    """``(manifest, {"ids": memmap [N, K], "sims": memmap [N, K]})`` of a neighbours artifact."""
    manifest = read_manifest(path, kind="neighbors")
    return manifest, {name: open_array(path, name, manifest) for name in ("ids", "sims")}
