"""Search over the train keys: exact search, the Searcher conventions, similarity, rescore."""
from __future__ import annotations

import warnings

import faiss
import numpy as np
import pytest
import torch

from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.search import (
    GPU_MAX_K,
    Searcher,
    candidate_width,
    check_metric,
    exact_search,
    faiss_metric,
    fits_gpu,
    normalize_rows,
    recall_at,
    rescore,
    set_nprobe,
    similarity,
)
from gnnlm.workdir.layout import Workdir
from tests.fakes import write_features

pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def write_valid(wd, d, n=30):
    """Valid features: the held-out queries the index's tuning measures recall on."""
    rows = np.random.default_rng(11).standard_normal((n, d)).astype(np.float32)
    write_features(wd.features("valid"), rows, split="valid")


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
    # torch keys and queries give the same answer
    t_sims, t_ids = exact_search(torch.from_numpy(keys.astype(np.float32)),
                                 torch.from_numpy(queries), 15, metric, chunk=100)
    np.testing.assert_array_equal(t_ids, ids)
    np.testing.assert_allclose(t_sims, sims, rtol=1e-5, atol=1e-5)


def test_exact_search_short_rows():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((12, 8)).astype(np.float32)
    sims, ids = exact_search(keys, keys[:3], 20, "ip", chunk=5)
    assert np.all(ids[:, 12:] == -1) and np.all(np.isneginf(sims[:, 12:]))
    assert np.all(ids[:, :12] >= 0)
    assert all(sorted(row[:12]) == list(range(12)) for row in ids)  # every key, once


def test_exact_search_refuses_bad_shapes_and_k():
    keys = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"queries must be \[n, 4\]"):
        exact_search(keys, np.zeros((2, 3), np.float32), 2, "ip")
    with pytest.raises(ValueError, match=r"k must be >= 1 \(got 0\)"):
        exact_search(keys, np.zeros((2, 4), np.float32), 0, "ip")


@pytest.mark.parametrize("metric", ["cos", "ip", "l2"])
def test_searcher_similarity_conventions(tmp_path, metric):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((800, 16)) * rng.uniform(0.5, 2, (800, 1))).astype(np.float32)
    wd = Workdir(tmp_path)
    write_features(wd.features("train"), x)
    write_valid(wd, d=16)
    build_index(wd, "final", metric, IndexConfig(factory="Flat", recall_queries=50))
    queries = rng.standard_normal((20, 16)).astype(np.float32)
    ref_sims, ref_ids = brute_force(x.astype(np.float16), queries, 8, metric)
    for searcher in (Searcher.open(wd.index("final", metric), device="cpu"),
                     Searcher.exact(wd, "final", metric, device="cpu")):
        assert (searcher.metric, searcher.key, searcher.ntotal, searcher.d) == (
            metric, "final", 800, 16)
        sims, ids = searcher.search(queries, 8)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(sims, ref_sims, rtol=1e-4, atol=1e-4)
        assert sims.dtype == np.float32 and ids.dtype == np.int64
    assert Searcher.open(wd.index("final", metric)).backend == "faiss"
    assert Searcher.exact(wd, "final", metric, device="cpu").backend == "exact"
    before = queries.copy()
    Searcher.open(wd.index("final", metric), device="cpu").search(queries, 3)
    np.testing.assert_array_equal(queries, before)  # cos must not normalise the caller's array


def test_searcher_marks_missing_results(tmp_path):
    """An IVF index probing one list returns fewer than k keys: -1 ids with -inf scores."""
    rng = np.random.default_rng(4)
    wd = Workdir(tmp_path)
    write_features(wd.features("train"), rng.standard_normal((400, 8)).astype(np.float32))
    write_valid(wd, d=8)
    build_index(wd, "final", "l2", IndexConfig(factory="IVF16,Flat", recall_queries=10))
    sims, ids = Searcher.open(wd.index("final", "l2"), nprobe=1, rerank=0, device="cpu").search(
        rng.standard_normal((5, 8)).astype(np.float32), 200)
    missing = ids < 0
    assert missing.any() and np.all(np.isneginf(sims[missing]))
    assert np.all(np.isfinite(sims[~missing])) and np.all(sims[~missing] <= 0)


def test_search_errors_are_clear(tmp_path):
    x = np.random.default_rng(5).standard_normal((50, 16)).astype(np.float32)
    wd = Workdir(tmp_path)
    write_features(wd.features("train"), x)
    write_valid(wd, d=16)
    build_index(wd, "final", "cos", IndexConfig(recall_queries=10))
    for searcher in (Searcher.open(wd.index("final", "cos")), Searcher.exact(wd)):
        with pytest.raises(ValueError, match=r"dimension 8.*dimension 16"):
            searcher.search(np.zeros((2, 8), np.float32), 3)
        with pytest.raises(ValueError, match=r"datastore size 50 \(got 51\)"):
            searcher.search(np.zeros((2, 16), np.float32), 51)
    with pytest.raises(ValueError, match=r"nprobe must be >= 1 \(got 0\)"):
        Searcher.open(wd.index("final", "cos"), nprobe=0)
    with pytest.raises(ValueError, match=r"metric must be one of .*\(got 'dot'\)"):
        check_metric("dot")
    with pytest.raises(ValueError, match=r"\(got 'dot'\)"):
        Searcher.exact(wd, "final", "dot")
    with pytest.raises(ValueError, match=r"key must be one of .*\(got 'mid'\)"):
        Searcher.exact(wd, "mid", "cos")
    assert faiss_metric("l2") == faiss.METRIC_L2
    assert faiss_metric("cos") == faiss_metric("ip") == faiss.METRIC_INNER_PRODUCT


def test_similarity_conventions():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((5, 1, 8)), rng.standard_normal((5, 6, 8))
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    for metric, expected in (("cos", (qn * kn).sum(-1)), ("ip", (q * k).sum(-1)),
                             ("l2", -((q - k) ** 2).sum(-1))):
        got = similarity(q, k, metric)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert got.shape == (5, 6)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
        # torch inputs (and read-only arrays, as memmaps are) give the same
        ro = k.copy()
        ro.flags.writeable = False
        torch.testing.assert_close(similarity(torch.from_numpy(q), ro, metric), got)


def test_rescore_gives_exact_scores_in_neighbour_order():
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((40, 8)).astype(np.float16)
    queries = rng.standard_normal((9, 8)).astype(np.float32)
    ids = rng.integers(0, 40, (9, 5))
    ids[0, 3:] = -1
    ids[4] = -1
    ids[5] = [7, 7, 3, 3, 7]                                          # repeats keep their order
    for metric in ("cos", "ip", "l2"):
        got = rescore(queries, ids, keys, metric, max_elems=8 * 5 * 2)  # several row blocks
        assert got.dtype == np.float32 and got.shape == (9, 5)
        gathered = keys[np.maximum(ids, 0)].astype(np.float32)        # [9, 5, 8]
        expected = similarity(queries[:, None, :], gathered, metric).numpy()
        expected[ids < 0] = -np.inf
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert np.all(np.isneginf(got[4]))
        assert got[5, 0] == got[5, 1] == got[5, 4] and got[5, 2] == got[5, 3]


def test_recall_at_counts_shared_ids_and_ignores_missing_ones():
    exact = np.array([[1, 2, 3, 4], [5, 6, -1, -1], [7, 8, 9, 10]])
    approx = np.array([[2, 1, 9, 4], [6, -1, -1, -1], [-1, -1, -1, -1]])
    # row 0: 3 of 4; row 1: 1 of the 2 that exist; row 2: none
    assert recall_at(approx, exact, 4) == pytest.approx((3 / 4 + 1 / 2 + 0) / 3)
    assert recall_at(approx, exact, 2) == pytest.approx((2 / 2 + 1 / 2 + 0) / 3)
    assert recall_at(exact, exact, 4) == 1.0


def test_normalize_rows_keeps_zero_rows():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    out = normalize_rows(x)
    assert out is x                                                  # in place
    np.testing.assert_allclose(x, [[0.6, 0.8], [0.0, 0.0]])


def test_set_nprobe_reaches_the_ivf_inside_a_pipeline():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((800, 8)).astype(np.float32)
    index = faiss.index_factory(8, "OPQ4,IVF8,PQ4x4np")
    index.train(x)
    set_nprobe(index, 5)
    assert faiss.extract_index_ivf(index).nprobe == 5
    flat = faiss.index_factory(8, "Flat")
    set_nprobe(flat, 5)                                               # nothing to set: no error


def test_recall_at_matches_the_pairwise_definition():
    """The sorted-table recall equals counting, per query, the approx ids among the exact ones
    (-1 never counts), at the neighbours' widths too."""
    rng = np.random.default_rng(8)
    for n, k, ids in ((40, 300, 2000), (25, 7, 12)):
        exact = np.stack([rng.permutation(ids)[:k] for _ in range(n)])
        approx = np.where(rng.random((n, k)) < 0.5, exact, rng.integers(-1, ids, (n, k)))
        approx = np.take_along_axis(approx, rng.permuted(np.tile(np.arange(k), (n, 1)),
                                                         axis=1), axis=1)
        exact[3, k // 2:] = -1                                       # fewer keys than k
        for at in (1, k // 2, k):
            a, e = approx[:, :at], exact[:, :at]
            found = ((a[:, :, None] == e[:, None, :]) & (a[:, :, None] >= 0)).any(2).sum(1)
            ref = np.mean(found / np.maximum((e >= 0).sum(1), 1))
            assert recall_at(approx, exact, at) == pytest.approx(ref, abs=1e-12)


def test_gpu_limit_applies_to_the_candidate_width_and_nprobe():
    assert candidate_width(1024, 0.0, 10**6) == 1024
    assert candidate_width(1024, 1.5, 10**6) == 1536
    assert candidate_width(1537, 2.0, 10**6) == 3074
    assert candidate_width(1024, 4.0, 3000) == 3000                    # at most the datastore
    assert fits_gpu(1024, 64, 2.0, 10**6) and not fits_gpu(1025, 64, 2.0, 10**6)
    assert fits_gpu(GPU_MAX_K, GPU_MAX_K, 0.0, 10**6)
    assert not fits_gpu(8, GPU_MAX_K + 1, 0.0, 10**6)
    assert fits_gpu(1024, None, 4.0, GPU_MAX_K)                         # exact search: no nprobe


class FakeGpuIndex:
    """Stands in for a faiss GPU index (none on this machine): it refuses k above the GPU
    limit as GPU faiss does, and counts the searches it serves."""

    def __init__(self, cpu):
        self.cpu, self.calls = cpu, 0

    def search(self, q, k):
        if k > GPU_MAX_K:
            raise RuntimeError(f"GPU index: k = {k} > {GPU_MAX_K}")
        self.calls += 1
        return self.cpu.search(q, k)


def test_searches_beyond_the_gpu_limit_run_on_the_cpu_copy_and_say_so_once():
    rng = np.random.default_rng(9)
    keys = rng.standard_normal((3000, 8)).astype(np.float32)
    queries = rng.standard_normal((4, 8)).astype(np.float32)
    cpu = faiss.IndexFlatL2(8)
    cpu.add(keys)

    def on_gpu(nprobe, rerank):
        searcher = Searcher(metric="l2", key="final", ntotal=3000, d=8,
                            index=FakeGpuIndex(cpu), keys=keys)
        searcher._cpu_index, searcher.nprobe, searcher.rerank = cpu, nprobe, rerank
        return searcher

    within = on_gpu(64, 2.0)                                          # 2 x 1024 = the limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        within.search(queries, 1024)
    assert within.index.calls == 1
    reference = Searcher(metric="l2", key="final", ntotal=3000, d=8, index=cpu, keys=keys)
    reference.nprobe, reference.rerank = 64, 4.0                      # a plain CPU searcher
    wide = on_gpu(64, 4.0)                                            # 4 x 1024 > the limit
    with pytest.warns(UserWarning, match=rf"3000 candidates \(k=1024, rerank=4.0\) at "
                                         rf"nprobe=64.*at most {GPU_MAX_K}.*CPU copy") as seen:
        sims, ids = wide.search(queries, 1024)
        wide.search(queries, 1024)
    assert len(seen) == 1 and wide.index.calls == 0                   # once per searcher
    ref_sims, ref_ids = reference.search(queries, 1024)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(sims, ref_sims)
    # an nprobe beyond the limit: the GPU copy would probe fewer lists, so the CPU one serves
    deep = on_gpu(GPU_MAX_K + 1, 0.0)
    with pytest.warns(UserWarning, match=rf"nprobe={GPU_MAX_K + 1}"):
        deep.search(queries, 10)
    assert deep.index.calls == 0


@pytest.mark.parametrize("metric", ["cos", "ip", "l2"])
def test_a_query_s_neighbours_do_not_depend_on_the_queries_searched_with_it(tmp_path, metric):
    """Generation searches one query at a time, scoring thousands: a query's neighbours and
    similarities are the same bits either way, by exact search, a Flat index (faiss sums
    otherwise below 20 queries) and an IVF index re-ranked from the stored keys (a batched
    matmul would sum otherwise)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    wd = Workdir(tmp_path)
    write_features(wd.features("train"), x)
    write_valid(wd, d=32)
    build_index(wd, "final", metric, IndexConfig(factory="Flat", recall_queries=20))
    queries = rng.standard_normal((70, 32)).astype(np.float32)
    flat = Searcher.open(wd.index("final", metric), device="cpu")
    build_index(wd, "final", metric, IndexConfig(factory="IVF8,SQ8", recall_queries=20),
                rebuild=True)
    reranked = Searcher.for_workdir(wd, "final", metric, device="cpu", nprobe=2, rerank=2.0)
    for searcher in (Searcher.exact(wd, "final", metric, device="cpu"), flat, reranked):
        together = searcher.search(queries, 16)
        for i in (0, 33, 69):
            alone = searcher.search(queries[i:i + 1], 16)
            np.testing.assert_array_equal(alone[1][0], together[1][i])
            np.testing.assert_array_equal(alone[0][0], together[0][i])
