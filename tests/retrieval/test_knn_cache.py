"""The per-token kNN-LM cache against recomputation from the features and neighbours."""
from __future__ import annotations

import shutil

import faiss
import numpy as np
import pytest

from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.knn import evaluate, sweep
from gnnlm.retrieval.knn_cache import (
    SEARCH_FACTS,
    build_knn_cache,
    check_scores,
    exact_score_index,
    exhaustive_index,
    open_knn_cache,
    search_facts,
)
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors, open_neighbors
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.refusals import ArtifactError
from tests import fakes


def write_features(path, final, targets, lm_logprob=None, **kw):
    """Features whose ``att`` keys are ``-final`` (so the two key types differ)."""
    return fakes.write_features(path, final, -final, targets, lm_logprob, **kw)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Train/valid features, an IVF-PQ index (approximate scores, some -1 slots), neighbours,
    and both kinds of cache for valid."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return _build_caches(tmp_path_factory)
    finally:
        faiss.omp_set_num_threads(before)


def _build_caches(tmp_path_factory):
    wd = Workdir(tmp_path_factory.mktemp("knn"))
    rng = np.random.default_rng(4)
    train = rng.standard_normal((2000, 16)).astype(np.float32)
    valid = (train[rng.integers(0, 2000, 300)] + 0.3 * rng.standard_normal((300, 16))
             ).astype(np.float32)
    train_targets = rng.integers(0, 20, 2000).astype(np.int32)
    valid_targets = rng.integers(0, 20, 300).astype(np.int32)
    write_features(wd.features("train"), train, train_targets)
    write_features(wd.features("valid"), valid, valid_targets,
                   lm_logprob=np.log(rng.uniform(0.01, 0.5, 300)), split="valid")
    build_index(wd, "final", "l2",
                IndexConfig(factory="IVF8,PQ4x4np", recall_queries=50))
    # one probed list and the index's own (approximate) scores
    build_neighbors(wd, "valid", "final", "l2", NeighborsConfig(K=300, nprobe=1, rerank=0),
                    leakage_window=None)
    for scores in ("faiss", "exact"):
        build_knn_cache(wd, "valid", "final", "l2", scores=scores, chunk=64)
    return wd, train, valid, train_targets, valid_targets


def copy_inputs(wd: Workdir, root) -> Workdir:
    """Another work directory with the same features, index and neighbours (no caches)."""
    for name in ("features", "index", "neighbors"):
        shutil.copytree(wd.root / name, root / name)
    return Workdir(root)


def test_cache_hits_scores_and_logprob(caches):
    wd, train, valid, train_targets, valid_targets = caches
    _, nb = open_neighbors(wd.neighbors("final", "l2", "valid"))
    ids = np.asarray(nb["ids"]).astype(np.int64)
    assert np.any(ids < 0)  # one probed list of ~250 keys cannot fill K = 300
    manifest, faiss_cache = open_knn_cache(wd.knn_cache("final", "l2", "faiss", "valid"))
    assert (manifest["key"], manifest["metric"], manifest["K"], manifest["scores"],
            manifest["n"], manifest["split"]) == ("final", "l2", 300, "faiss", 300, "valid")
    expected_hits = (ids >= 0) & (train_targets[np.maximum(ids, 0)] == valid_targets[:, None])
    np.testing.assert_array_equal(faiss_cache["hits"], expected_hits)
    np.testing.assert_array_equal(faiss_cache["sims"], nb["sims"])
    _, valid_arrays = open_knn_cache(wd.knn_cache("final", "l2", "exact", "valid"))
    np.testing.assert_array_equal(valid_arrays["hits"], expected_hits)
    np.testing.assert_array_equal(valid_arrays["lm_logprob"], faiss_cache["lm_logprob"])
    # Exact scores: recomputed from the stored float16 keys, in the neighbours' order.
    keys = train.astype(np.float16).astype(np.float64)
    q = valid.astype(np.float16).astype(np.float64)
    ref = -((q[:, None, :] - keys[np.maximum(ids, 0)]) ** 2).sum(-1)
    ref[ids < 0] = -np.inf
    np.testing.assert_allclose(valid_arrays["sims"], ref, rtol=1e-5, atol=1e-5)
    valid_slots = ids >= 0
    assert not np.allclose(faiss_cache["sims"][valid_slots], ref[valid_slots], atol=1e-3)
    assert manifest["hit_coverage"] == pytest.approx(expected_hits.any(axis=1).mean())
    assert 0 < manifest["hit_coverage"] <= 1
    lm = np.asarray(faiss_cache["lm_logprob"], dtype=np.float64)
    assert manifest["base_ppl"] == pytest.approx(np.exp(-lm.mean()), rel=1e-6)
    assert manifest["base_lm"]["fingerprint"] == "weights-a"


def test_the_cache_feeds_the_sweep(caches):
    wd = caches[0]
    _, cache = open_knn_cache(wd.knn_cache("final", "l2", "exact", "valid"))
    grid = sweep(cache, [1, 16, 300], [1.0], [0.0, 0.25])
    assert grid[2, 0, 1] == pytest.approx(evaluate(cache, 300, 1.0, 0.25), rel=1e-5)
    assert grid[0, 0, 0] == pytest.approx(np.exp(-np.mean(cache["lm_logprob"], dtype=np.float64)))


def test_cache_resumes_to_identical_bytes(caches, tmp_path):
    wd = caches[0]
    other = copy_inputs(wd, tmp_path / "w")
    assert build_knn_cache(other, "valid", "final", "l2", scores="exact", chunk=64,
                           stop_after_chunks=2) == {}
    partial = other.knn_cache("final", "l2", "exact", "valid").with_name("valid.partial")
    assert partial.is_dir()
    resumed = build_knn_cache(other, "valid", "final", "l2", scores="exact", chunk=64)
    for name in ("sims.bin", "hits.bin", "lm_logprob.bin"):
        assert (other.knn_cache("final", "l2", "exact", "valid") / name).read_bytes() == \
            (wd.knn_cache("final", "l2", "exact", "valid") / name).read_bytes()
    first = open_knn_cache(wd.knn_cache("final", "l2", "exact", "valid"))[0]
    assert resumed["hit_coverage"] == first["hit_coverage"]
    assert resumed["base_ppl"] == first["base_ppl"]
    assert resumed["fingerprint"] == first["fingerprint"]


def test_bad_scores_and_missing_logprob_are_refused(caches, tmp_path):
    wd = caches[0]
    with pytest.raises(ValueError, match=r"\(got 'real'\)"):
        build_knn_cache(wd, "valid", "final", "l2", scores="real")
    with pytest.raises(ValueError, match=r"\(got 'real'\)"):
        check_scores("real")
    check_scores("exact")
    # neighbours of train queries exist, but train features carry no lm_logprob
    other = copy_inputs(wd, tmp_path / "w")
    build_neighbors(other, "train", "final", "l2", NeighborsConfig(K=4, train_queries=50),
                    leakage_window=2)
    with pytest.raises(ArtifactError, match="no lm_logprob"):
        build_knn_cache(other, "train", "final", "l2")


def test_neighbours_of_other_features_are_refused(caches, tmp_path):
    """Valid features rebuilt after the neighbours: ids would point at the wrong queries."""
    wd, _, valid, _, valid_targets = caches
    other = copy_inputs(wd, tmp_path / "w")
    old = other.features_manifest("valid")["fingerprint"]
    shutil.rmtree(other.features("valid"))
    write_features(other.features("valid"), valid + 1, valid_targets,
                   lm_logprob=np.full(300, -1.0), split="valid")
    new = other.features_manifest("valid")["fingerprint"]
    with pytest.raises(ArtifactError, match=f"features: {old} → {new}.*Rebuild the neighbours"):
        build_knn_cache(other, "valid", "final", "l2")


def test_another_models_logprob_can_be_swapped_in(caches):
    wd = caches[0]
    path = wd.knn_cache("final", "l2", "faiss", "valid")
    gnn = np.full(300, -0.5, dtype=np.float32)
    manifest, arrays = open_knn_cache(path, lm_logprob=gnn)
    assert arrays["lm_logprob"] is gnn and manifest["n"] == 300
    np.testing.assert_array_equal(arrays["hits"], open_knn_cache(path)[1]["hits"])
    with pytest.raises(ValueError, match="lm_logprob has 10 tokens but the cache .* has 300"):
        open_knn_cache(path, lm_logprob=gnn[:10])


def test_manifest_records_what_the_neighbours_and_scores_are(caches, tmp_path):
    """Xu et al. §5.1: "FAISS scores" of an index searched with re-ranking are exact ones, and so
    are the scores of exact search; the manifest says so, not only what ``scores`` asked."""
    wd = caches[0]
    approx = open_knn_cache(wd.knn_cache("final", "l2", "faiss", "valid"))[0]
    assert {name: approx[name] for name in SEARCH_FACTS} == {
        "backend": "index", "factory": "IVF8,PQ4x4np", "nprobe": 1, "rerank": 0.0,
        "scores_are_exact": False}
    assert open_knn_cache(wd.knn_cache("final", "l2", "exact", "valid"))[0][
        "scores_are_exact"] is True
    other = copy_inputs(wd, tmp_path / "w")
    shutil.rmtree(other.neighbors("final", "l2", "valid"))
    build_neighbors(other, "valid", "final", "l2", NeighborsConfig(K=16, nprobe=2, rerank=2),
                    leakage_window=None)
    reranked = build_knn_cache(other, "valid", "final", "l2", scores="faiss")
    assert (reranked["nprobe"], reranked["rerank"], reranked["scores_are_exact"]) == (2, 2.0, True)
    shutil.rmtree(other.neighbors("final", "l2", "valid"))
    build_neighbors(other, "valid", "final", "l2", NeighborsConfig(K=16, backend="exact"),
                    leakage_window=None)
    exact = build_knn_cache(other, "valid", "final", "l2", scores="faiss", rebuild=True)
    assert {name: exact[name] for name in SEARCH_FACTS} == {
        "backend": "exact", "factory": "exact", "nprobe": None, "rerank": None,
        "scores_are_exact": True}
    assert search_facts(exact, other) == {name: exact[name] for name in SEARCH_FACTS}


def test_caches_built_before_the_fields_read_their_neighbours(caches, tmp_path):
    """An existing work directory keeps working: a cache manifest without the search fields
    takes them from the neighbours it was built from, and refuses other neighbours."""
    wd = caches[0]
    other = copy_inputs(wd, tmp_path / "w")
    path = other.knn_cache("final", "l2", "faiss", "valid")
    shutil.copytree(wd.knn_cache("final", "l2", "faiss", "valid"), path)
    # what the old code wrote lacked them
    fakes.as_older_code_wrote_it(path, lambda manifest: [manifest.pop(name) for name in (
        "nprobe", "rerank", "scores_are_exact")])
    old = open_knn_cache(path)[0]
    assert search_facts(old, other) == {"backend": "index", "factory": "IVF8,PQ4x4np",
                                        "nprobe": 1, "rerank": 0.0, "scores_are_exact": False}
    assert search_facts({**old, "scores": "exact"}, other)["scores_are_exact"] is True
    shutil.rmtree(other.neighbors("final", "l2", "valid"))
    build_neighbors(other, "valid", "final", "l2", NeighborsConfig(K=300, nprobe=2, rerank=1),
                    leakage_window=None)
    with pytest.raises(ArtifactError, match=r"other inputs .*--rebuild knn_cache"):
        search_facts(old, other)


@pytest.mark.parametrize("factory, exhaustive, exact_scores", [
    ("Flat", True, True), ("IDMap,Flat", True, True), ("IVF16,Flat", False, True),
    ("HNSW32", False, True), ("IVF4096,SQ8", False, False), ("IVF8,PQ4x4np", False, False),
    ("OPQ16,IVF64,PQ16x8np", False, False), ("PCA8,Flat", False, False)])
def test_which_indexes_search_or_score_exactly(factory, exhaustive, exact_scores):
    assert exhaustive_index(factory) is exhaustive
    assert exact_score_index(factory) is exact_scores
