"""The choice of search settings (``gnnlm.retrieval.tuning``): measured at the neighbours' depth,
within GPU faiss's limits, and read back for one setting by ``measured_recall``."""
from __future__ import annotations

import faiss
import numpy as np
import pytest

from gnnlm.retrieval.search import GPU_MAX_K, candidate_width
from gnnlm.retrieval.tuning import measured_recall, tune

pytestmark = pytest.mark.usefixtures("one_faiss_thread")

SETTINGS = dict(nprobes=[4, 16], reranks=[0.0, 1.0, 2.0, 4.0])


@pytest.fixture(scope="module")
def lossy_index():
    """3,000 random keys in a coarse PQ index (re-ranking more candidates finds more of the
    true neighbours), and 200 held-out queries."""
    x = np.random.default_rng(0).standard_normal((3200, 32)).astype(np.float32)
    keys, queries = x[:3000], x[3000:]
    index = faiss.index_factory(32, "IVF16,PQ4x4np", faiss.METRIC_L2)
    index.train(keys)
    index.add(keys)
    return index, keys, queries


def test_tuning_never_chooses_a_setting_beyond_the_gpu_limit(lossy_index):
    index, keys, queries = lossy_index
    # train queries ask for K + the leakage margin = 1,100: re-ranking 2x wants 2,200 candidates
    chosen, table = tune(index, keys, queries, "final", "l2", **SETTINGS, target_recall=0.999,
                         search_k=600, search_width=1100)
    assert {(r["nprobe"], r["rerank"]): r["gpu_ok"] for r in table} == {
        (p, r): r <= 1.0 for p in (4, 16) for r in (0.0, 1.0, 2.0, 4.0)}
    assert all(r["depth"] == 600 and "recall@600" in r for r in table)
    assert chosen["gpu_ok"] and candidate_width(1100, chosen["rerank"], 3000) <= GPU_MAX_K
    ok = [r for r in table if r["gpu_ok"]]
    reached = [r for r in ok if r["recall@10"] >= 0.999]
    assert chosen == (max(reached, key=lambda r: r["queries_per_s"]) if reached else
                      max(ok, key=lambda r: (r["recall@10"], r["queries_per_s"])))
    # the limit changed the outcome: a wider setting measured better, and stays on record
    assert max(r["recall@10"] for r in table if not r["gpu_ok"]) > chosen["recall@10"]


def test_when_no_setting_fits_the_gpu_the_best_of_all_is_chosen(lossy_index):
    index, keys, queries = lossy_index
    # even without re-ranking 2,500 candidates exceed the limit: the search runs on the CPU
    # whatever the setting, so the choice is the usual one over the whole table
    chosen, table = tune(index, keys, queries, "final", "l2", **SETTINGS, target_recall=1.0,
                         search_k=600, search_width=2500)
    assert not any(r["gpu_ok"] for r in table)
    assert chosen["recall@10"] == max(r["recall@10"] for r in table)


def test_without_the_neighbours_depth_tuning_measures_at_128(lossy_index):
    index, keys, queries = lossy_index
    chosen, table = tune(index, keys, queries, "final", "l2", [4], [0.0, 4.0], 0.9)
    assert all(r["depth"] == 128 and r["gpu_ok"] for r in table)
    assert {name for r in table for name in r if name.startswith("recall@")} == {
        "recall@10", "recall@100"}


def test_measured_recall_reads_exactly_that_settings_row():
    row = {"nprobe": 8, "rerank": 2.0, "depth": 1024, "recall@10": 0.95, "recall@100": 0.9,
           "recall@1024": 0.81, "queries_per_s": 900.0, "gpu_ok": True}
    manifest = {"n": 50000, "tuning": [
        {**row, "rerank": 0.0, "recall@10": 0.7, "recall@1024": 0.4}, row]}
    assert measured_recall(manifest, 8, 2, 1024) == {
        "nprobe": 8, "rerank": 2.0, "K": 1024, "depth": 1024, "recall@10": 0.95,
        "recall@100": 0.9, "recall@K": 0.81, "queries_per_s": 900.0, "gpu_ok": True}
    assert measured_recall(manifest, 8, 0.0, 1024)["recall@K"] == 0.4
    assert measured_recall(manifest, 8, 2.0, 512)["recall@K"] is None    # tuned for another K
    assert measured_recall(manifest, 16, 2.0, 1024) is None              # not measured
    assert measured_recall(manifest, 8, 1.5, 1024) is None
    assert measured_recall(manifest, None, None, 1024) is None           # exact search
    assert measured_recall({"n": 50000, "tuning": []}, 1, 0.0, 8) is None  # recall_queries 0


def test_measured_recall_of_a_manifest_from_before_recall_at_k():
    """Old tables: no depth (they searched 128 deep, or the whole datastore when smaller), no
    recall@K, no gpu_ok: what was measured comes back, with its depth."""
    old = {"n": 200000, "tuning": [{"nprobe": 4, "rerank": 1.0, "recall@10": 0.9,
                                    "recall@100": 0.85, "queries_per_s": 1e4}]}
    assert measured_recall(old, 4, 1.0, 1024) == {
        "nprobe": 4, "rerank": 1.0, "K": 1024, "depth": 128, "recall@10": 0.9,
        "recall@100": 0.85, "recall@K": None, "queries_per_s": 1e4, "gpu_ok": None}
    assert measured_recall(old, 4, 1.0, 10)["recall@K"] == 0.9           # K = 10: measured
    small = {"n": 50, "tuning": [{"nprobe": 1, "rerank": 0.0, "recall@10": 1.0,
                                  "queries_per_s": 5.0}]}
    got = measured_recall(small, 1, 0.0, 16)
    assert got is not None and (got["depth"], got["recall@100"]) == (50, None)
