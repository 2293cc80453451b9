"""Search settings chosen by measurement: recall against exact search, and time, per setting.

An IVF index has two knobs: ``nprobe`` (inverted lists visited) and ``rerank`` (the index
returns rerank·k candidates, re-ranked by their exact similarity from the stored keys; 0 keeps
the index's own approximate scores and order). ``tune`` measures recall@10, recall@100 and
queries/s of every combination on held-out queries against exact search, and picks the
fastest one that reaches the target recall@10 (the most accurate one when none does). The
whole table goes into the index manifest, so the trade-off is on record.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gnnlm.search import Searcher, exact_search, recall_at, set_nprobe


def measure(searcher: Searcher, queries: np.ndarray, exact_ids: np.ndarray, k: int) -> dict:
    """recall@10 and @100 of ``searcher``'s top k, and its queries/s."""
    t0 = time.perf_counter()
    _, ids = searcher.search(queries, k)
    seconds = time.perf_counter() - t0
    at = [a for a in (10, 100) if a <= min(k, exact_ids.shape[1])]
    return {**{f"recall@{a}": round(recall_at(ids, exact_ids, a), 4) for a in at},
            "queries_per_s": round(len(queries) / max(seconds, 1e-9), 1)}


def tune(index: Any, keys: Any, queries: np.ndarray, key: str, metric: str,
         nprobes: Sequence[int], reranks: Sequence[float], target_recall: float,
         k: int = 128) -> tuple[dict, list[dict]]:
    """``(chosen settings and their measurements, the table of all)`` for ``index``."""
    n = int(index.ntotal)
    k = min(k, n)
    _, exact_ids = exact_search(keys, queries, min(max(k, 100), n), metric)
    # one searcher for every setting: it prepares the keys re-ranking reads once, as the
    # neighbours stage's searcher does for all its queries
    searcher = Searcher(metric=metric, key=key, ntotal=n, d=index.d, index=index, keys=keys)
    table = []
    for nprobe in nprobes:
        set_nprobe(index, nprobe)
        for rerank in reranks:
            searcher.nprobe, searcher.rerank = nprobe, float(rerank)
            searcher.search(queries[:16], k)             # warm caches (and prepare the keys)
            table.append({"nprobe": int(nprobe), "rerank": float(rerank),
                          **measure(searcher, queries, exact_ids, k)})
    reached = [row for row in table if row.get("recall@10", 1.0) >= target_recall]
    if reached:
        chosen = max(reached, key=lambda row: row["queries_per_s"])
    else:
        chosen = max(table, key=lambda row: (row.get("recall@10", 0.0), row["queries_per_s"]))
    return dict(chosen), table
