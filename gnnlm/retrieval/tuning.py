"""Search settings chosen by measurement: recall against exact search, and time, per setting.

An IVF index has two knobs: ``nprobe`` (inverted lists visited) and ``rerank`` (the index
returns rerank·k candidates, re-ranked by their exact similarity from the stored keys; 0 keeps
the index's own approximate scores and order). ``tune`` measures every combination on held-out
queries against exact search: recall@10, recall@100, recall@K (K: the depth the neighbours
stage searches at, when given) and queries/s, all of one search at depth max(128, K) (at most
the datastore size; each row records it as ``depth``), since the neighbours' recall and speed
at K are what the setting is chosen for. It picks the fastest setting that reaches the target
recall@10 (the most accurate one when none does) among those GPU faiss can run at the widest
search the neighbours stage asks for (``gpu_ok``: candidate width, ceil(rerank·width) or the
width itself without re-ranking, and nprobe at most ``GPU_MAX_K``), whatever machine tunes: the
index may be searched on a GPU later, where such a setting would run on the CPU copy instead.
The whole table goes into the index manifest, so the trade-off is on record; ``measured_recall``
reads back the row of the setting the neighbours used.

For K < 128 with re-ranking, recall@K is the top K among ceil(rerank·128) re-ranked candidates,
more than the neighbours' ceil(rerank·K): an upper bound on theirs (equal without re-ranking).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gnnlm.retrieval.search import Searcher, exact_search, fits_gpu, recall_at, set_nprobe

# the search depth of the measurements when the neighbours' K is not given (or smaller)
TUNING_DEPTH = 128


def measure(searcher: Searcher, queries: np.ndarray, exact_ids: np.ndarray, k: int,
            at: Sequence[int] = (10, 100)) -> dict:
    """recall@a (a in ``at``, at most k) of ``searcher``'s top k, and its queries/s."""
    t0 = time.perf_counter()
    _, ids = searcher.search(queries, k)
    seconds = time.perf_counter() - t0
    at = sorted({int(a) for a in at if a <= min(k, exact_ids.shape[1])})
    return {**{f"recall@{a}": round(recall_at(ids, exact_ids, a), 4) for a in at},
            "queries_per_s": round(len(queries) / max(seconds, 1e-9), 1)}


def tune(index: Any, keys: Any, queries: np.ndarray, key: str, metric: str,
         nprobes: Sequence[int], reranks: Sequence[float], target_recall: float,
         k: int = TUNING_DEPTH, search_k: int | None = None,
         search_width: int | None = None) -> tuple[dict, list[dict]]:
    """``(chosen settings and their measurements, the table of all)`` for ``index``.

    ``search_k`` is the neighbours' K: recall@K is measured and the searches go max(k, K) deep.
    ``search_width`` is the widest search the neighbours stage asks for (K plus the leakage
    margin of train queries; default ``search_k``, else the measuring depth): a setting GPU
    faiss cannot run at that width is measured, marked ``gpu_ok: false``, and not chosen unless
    no setting fits.
    """
    n = int(index.ntotal)
    depth = min(max(k, search_k or 0), n)
    at = (10, 100) if search_k is None else (10, 100, search_k)
    width = min(search_width or search_k or depth, n)
    # the truth by exact search on torch's device (a GPU's: seconds for the whole table)
    _, exact_ids = exact_search(keys, queries, min(max(depth, 100), n), metric, device="auto")
    # one searcher for every setting: it prepares the keys re-ranking reads once, as the
    # neighbours stage's searcher does for all its queries
    searcher = Searcher(metric=metric, key=key, ntotal=n, d=index.d, index=index, keys=keys)
    table = []
    for nprobe in nprobes:
        set_nprobe(index, nprobe)
        for rerank in reranks:
            searcher.nprobe, searcher.rerank = nprobe, float(rerank)
            searcher.search(queries[:16], depth)         # warm caches (and prepare the keys)
            table.append({"nprobe": int(nprobe), "rerank": float(rerank), "depth": depth,
                          **measure(searcher, queries, exact_ids, depth, at),
                          "gpu_ok": fits_gpu(width, nprobe, float(rerank), n)})
    # Only when even the narrowest setting exceeds the GPU limit (a width above it without
    # re-ranking) is every setting a candidate: the search then runs on the CPU whatever it is.
    usable = [row for row in table if row["gpu_ok"]] or table
    reached = [row for row in usable if row.get("recall@10", 1.0) >= target_recall]
    if reached:
        chosen = max(reached, key=lambda row: row["queries_per_s"])
    else:
        chosen = max(usable, key=lambda row: (row.get("recall@10", 0.0), row["queries_per_s"]))
    return dict(chosen), table


def measured_recall(index_manifest: dict, nprobe: int | None, rerank: float | None,
                    K: int | None) -> dict | None:
    """What the index stage measured for exactly the setting ``nprobe``/``rerank`` (e.g. the
    neighbours manifest's), from the manifest's tuning table: ``{"nprobe", "rerank", "K",
    "depth", "recall@10", "recall@100", "recall@K", "queries_per_s", "gpu_ok"}``.

    A value is None where that row lacks it: recall@K of an index tuned for another K or before
    recall@K was measured, recall@100 below 100 keys, gpu_ok before it was recorded. ``depth``
    is the search depth of the measurement; manifests from before it was recorded measured at
    128 (or the datastore size, when smaller). Returns None when the setting was not measured
    (another nprobe or rerank, exact search, or ``index.recall_queries: 0``): the report then
    says "not measured" rather than quote another setting's recall.
    """
    if nprobe is None or rerank is None:
        return None
    for row in index_manifest.get("tuning") or []:
        if int(row["nprobe"]) == int(nprobe) and math.isclose(float(row["rerank"]),
                                                              float(rerank)):
            legacy_depth = min(TUNING_DEPTH, int(index_manifest.get("n", TUNING_DEPTH)))
            return {"nprobe": int(row["nprobe"]), "rerank": float(row["rerank"]),
                    "K": None if K is None else int(K),
                    "depth": int(row.get("depth", legacy_depth)),
                    "recall@10": row.get("recall@10"), "recall@100": row.get("recall@100"),
                    "recall@K": None if K is None else row.get(f"recall@{int(K)}"),
                    "queries_per_s": row.get("queries_per_s"), "gpu_ok": row.get("gpu_ok")}
    return None
