"""The index stage against exact search on synthetic features written as real artifacts."""
from __future__ import annotations

import json

import faiss
import numpy as np
import pytest
from fakes import write_features

from gnnlm.artifacts import ArtifactError
from gnnlm.index import (
    IndexConfig,
    Searcher,
    auto_factory,
    build_index,
    exact_search,
    pq_subquantizers,
    recall_at,
)


def clustered(n=20000, d=64, centres=200, rank=8, seed=0):
    """Points around random centres, each cluster spread along its own low-rank subspace
    (like LM features: few directions of variation per context type) plus small noise."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, d)).astype(np.float32)
    basis = 0.3 * rng.standard_normal((centres, rank, d)).astype(np.float32)
    label = rng.integers(0, centres, n)
    z = rng.standard_normal((n, rank)).astype(np.float32)
    x = c[label] + np.einsum("nr,nrd->nd", z, basis[label])
    return (x + 0.05 * rng.standard_normal((n, d))).astype(np.float32)


@pytest.fixture(autouse=True)
def one_faiss_thread():
    # The CI machine has 2 shared cores; OpenMP spinning on a busy core makes faiss training
    # several times slower than one thread.
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def clustered_features(tmp_path_factory):
    path = tmp_path_factory.mktemp("clustered") / "features" / "train"
    x = clustered()
    write_features(path, x)
    return path, x


def brute_force(keys, queries, k, metric):
    keys, queries = keys.astype(np.float64), queries.astype(np.float64)
    if metric == "cos":
        keys = keys / np.linalg.norm(keys, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    if metric == "l2":
        sims = -((queries[:, None, :] - keys[None]) ** 2).sum(-1)
    else:
        sims = queries @ keys.T
    ids = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, ids, 1), ids


def test_auto_ivfpq_recall_on_clustered_set(clustered_features, tmp_path):
    path, x = clustered_features
    # exact_below below N makes "auto" choose IVF+PQ: nlist = 4·sqrt(20000) -> 512, m = 64/4.
    cfg = IndexConfig(key="final", metric="cos", exact_below=1000, nprobe=32,
                      recall_queries=500)
    manifest = build_index(path, tmp_path / "index", cfg)
    assert manifest["factory"] == "IVF512,PQ16x8np"
    assert manifest["n"] == 20000 and manifest["d"] == 64 and manifest["key"] == "final"
    assert set(manifest["recall"]) == {"10", "100"}
    assert manifest["recall"]["10"] >= 0.8, manifest["recall"]
    assert manifest["base_lm"]["fingerprint"] == "weights-a"
    # Held-out queries from the same distribution, through the public Searcher.
    queries = clustered(n=400, seed=0)[:400] + 0.02
    searcher = Searcher.open(tmp_path / "index")
    assert (searcher.metric, searcher.key, searcher.ntotal, searcher.d) == ("cos", "final",
                                                                           20000, 64)
    _, approx = searcher.search(queries, 10)
    _, exact = exact_search(x.astype(np.float16), queries, 10, "cos")
    assert recall_at(approx, exact, 10) >= 0.8
    # nprobe is honoured: a single probed list loses neighbours.
    _, one_probe = Searcher.open(tmp_path / "index", nprobe=1).search(queries, 10)
    assert recall_at(one_probe, exact, 10) < recall_at(approx, exact, 10)


def test_auto_is_flat_below_threshold_and_exact(tmp_path):
    x = clustered(n=3000, d=32, centres=30)
    write_features(tmp_path / "train", x)
    manifest = build_index(tmp_path / "train", tmp_path / "index",
                           IndexConfig(metric="ip", recall_queries=200))
    assert manifest["factory"] == "Flat"
    assert manifest["recall"]["10"] >= 0.99 and manifest["recall"]["100"] >= 0.99


def test_auto_factory_rule():
    rng = np.random.default_rng(0)
    balanced = rng.standard_normal((20000, 128)).astype(np.float32)
    cfg = IndexConfig(exact_below=300_000)
    assert auto_factory(100_000, 128, balanced, cfg) == "Flat"
    assert auto_factory(2_000_000, 128, balanced, cfg) == "IVF512,PQ32x8np"  # capped by sample
    big_sample = np.repeat(balanced, 9, axis=0)  # 180k points: 4096 lists x 39
    assert auto_factory(2_000_000, 128, big_sample, cfg) == "IVF4096,PQ32x8np"
    skewed = balanced.copy()
    skewed[:, :4] *= 10  # a few outlier dimensions, as in transformer features
    assert auto_factory(2_000_000, 128, skewed, cfg).startswith("OPQ32,IVF")
    assert pq_subquantizers(768) == 192 and pq_subquantizers(100) == 25
    assert pq_subquantizers(30) in (6, 10) and 30 % pq_subquantizers(30) == 0


@pytest.mark.parametrize("metric", ["cos", "ip", "l2"])
def test_exact_search_equals_numpy_argsort(metric):
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((500, 24)).astype(np.float16)
    queries = rng.standard_normal((37, 24)).astype(np.float32)
    sims, ids = exact_search(keys, queries, 15, metric, chunk=64)  # several chunks merged
    ref_sims, ref_ids = brute_force(keys, queries, 15, metric)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(sims, ref_sims, rtol=1e-4, atol=1e-4)
    assert sims.dtype == np.float32 and ids.dtype == np.int64
    # Higher is better in every metric, so each row is sorted descending.
    assert np.all(np.diff(sims, axis=1) <= 0)
    if metric == "l2":
        assert np.all(sims <= 0)


def test_exact_search_short_rows_and_exclude():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((12, 8)).astype(np.float32)
    sims, ids = exact_search(keys, keys[:3], 20, "ip", chunk=5)
    assert np.all(ids[:, 12:] == -1) and np.all(np.isneginf(sims[:, 12:]))
    assert np.all(ids[:, :12] >= 0)
    positions, window = np.array([0, 5, 11]), 3
    sims, ids = exact_search(keys, keys[:3], 12, "ip", chunk=5, exclude=(positions, window))
    for row, t in enumerate(positions):
        kept = ids[row][ids[row] >= 0]
        assert np.all(np.abs(kept - t) >= window)
        allowed = np.array([p for p in range(12) if abs(p - t) >= window])
        assert sorted(kept) == sorted(allowed)


@pytest.mark.parametrize("metric", ["cos", "ip", "l2"])
def test_searcher_similarity_conventions(tmp_path, metric):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((800, 16)) * rng.uniform(0.5, 2, (800, 1))).astype(np.float32)
    write_features(tmp_path / "train", x)
    build_index(tmp_path / "train", tmp_path / "index",
                IndexConfig(metric=metric, factory="Flat", recall_queries=50))
    queries = rng.standard_normal((20, 16)).astype(np.float32)
    ref_sims, ref_ids = brute_force(x.astype(np.float16), queries, 8, metric)
    for searcher in (Searcher.open(tmp_path / "index"),
                     Searcher.exact(tmp_path / "train", "final", metric, device="cpu")):
        sims, ids = searcher.search(queries, 8)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(sims, ref_sims, rtol=1e-4, atol=1e-4)
    before = queries.copy()
    Searcher.open(tmp_path / "index").search(queries, 3)
    np.testing.assert_array_equal(queries, before)  # cos must not normalise the caller's array


def test_killed_build_resumes_to_identical_bytes(tmp_path):
    x = clustered(n=6000, d=32, centres=40, seed=4)
    write_features(tmp_path / "train", x)
    cfg = IndexConfig(factory="IVF64,PQ8x4np", add_chunk=1000, nprobe=8, recall_queries=100)
    whole = build_index(tmp_path / "train", tmp_path / "a", cfg)
    assert build_index(tmp_path / "train", tmp_path / "b", cfg, stop_after_chunks=0) == {}
    partial = tmp_path / "b.partial"
    assert json.loads((partial / "progress.json").read_text())["progress"]["trained"]
    assert faiss.read_index(str(partial / "index.faiss")).ntotal == 0
    assert build_index(tmp_path / "train", tmp_path / "b", cfg, stop_after_chunks=2) == {}
    assert faiss.read_index(str(partial / "index.faiss")).ntotal == 2000
    resumed = build_index(tmp_path / "train", tmp_path / "b", cfg)
    assert not partial.exists()
    assert (tmp_path / "a" / "index.faiss").read_bytes() == \
        (tmp_path / "b" / "index.faiss").read_bytes()
    assert resumed["recall"] == whole["recall"] and resumed["factory"] == "IVF64,PQ8x4np"
    assert resumed["fingerprint"] == whole["fingerprint"]


def test_search_errors_are_clear(tmp_path):
    x = np.random.default_rng(5).standard_normal((50, 16)).astype(np.float32)
    write_features(tmp_path / "train", x)
    build_index(tmp_path / "train", tmp_path / "index", IndexConfig(recall_queries=10))
    for searcher in (Searcher.open(tmp_path / "index"), Searcher.exact(tmp_path / "train")):
        with pytest.raises(ValueError, match=r"dimension 8.*dimension 16"):
            searcher.search(np.zeros((2, 8), np.float32), 3)
        with pytest.raises(ValueError, match=r"datastore size 50 \(got 51\)"):
            searcher.search(np.zeros((2, 16), np.float32), 51)
    with pytest.raises(ValueError, match=r"metric must be one of .*\(got 'dot'\)"):
        IndexConfig(metric="dot")
    with pytest.raises(ValueError, match="faiss cannot build index factory"):
        build_index(tmp_path / "train", tmp_path / "bad", IndexConfig(factory="IVF4,PQ5"))


def test_complete_index_is_skipped_and_other_features_refused(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    write_features(tmp_path / "train", x)
    cfg = IndexConfig(recall_queries=20)
    first = build_index(tmp_path / "train", tmp_path / "index", cfg)
    again = build_index(tmp_path / "train", tmp_path / "index", cfg)
    assert again["created"] == first["created"] and again["fingerprint"] == first["fingerprint"]
    write_features(tmp_path / "other", x + 1, lm=("other-lm", "weights-b"))
    with pytest.raises(ArtifactError, match=r"fake-lm.*weights-a.*other-lm.*weights-b"):
        build_index(tmp_path / "other", tmp_path / "index", cfg)
    write_features(tmp_path / "same-lm", x + 1)  # same base LM, other features
    with pytest.raises(ArtifactError, match="other inputs"):
        build_index(tmp_path / "same-lm", tmp_path / "index", cfg)
    rebuilt = build_index(tmp_path / "other", tmp_path / "index", cfg, rebuild=True)
    assert rebuilt["base_lm"]["name"] == "other-lm"
