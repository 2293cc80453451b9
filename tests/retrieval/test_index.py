"""The index stage: the ``auto`` factory, and build / resume / skip / refuse on synthetic features
written as real artifacts (searching them is tested in test_search.py, the choice of search
settings in test_tuning.py)."""
from __future__ import annotations

import json
import shutil

import faiss
import numpy as np
import pytest

from gnnlm.retrieval.index import IndexConfig, auto_factory, build_index, pq_subquantizers
from gnnlm.retrieval.search import Searcher, exact_search, recall_at
from gnnlm.retrieval.tuning import measured_recall
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError
from tests.fakes import write_features


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


pytestmark = pytest.mark.usefixtures("one_faiss_thread")


@pytest.fixture(scope="module")
def clustered_features(tmp_path_factory):
    """20,000 train keys and 400 held-out valid queries of the same clusters."""
    wd = Workdir(tmp_path_factory.mktemp("clustered"))
    x = clustered(n=20400)
    write_features(wd.features("train"), x[:20000])
    write_features(wd.features("valid"), x[20000:], split="valid")
    return wd, x[:20000]


def train_features(root, x, valid=None, **kw) -> Workdir:
    """Train features ``x`` and valid features ``valid`` (default: 64 random rows), the
    held-out queries the index's tuning measures recall on; ``kw`` goes to both."""
    wd = Workdir(root)
    write_features(wd.features("train"), x, **kw)
    if valid is None:
        valid = np.random.default_rng(99).standard_normal((64, x.shape[1]))
    kw.pop("att", None)  # valid att keys = valid final keys
    write_features(wd.features("valid"), np.asarray(valid, np.float32), split="valid", **kw)
    return wd


@pytest.mark.parametrize("budget,factory", [(8.0, "IVF512,SQ8"), (0.0, "IVF512,PQ16x8np")])
def test_auto_index_reaches_the_target_recall_on_clustered_set(clustered_features, budget,
                                                               factory):
    wd, x = clustered_features
    # exact_below below N makes "auto" choose IVF: nlist = 4·sqrt(20000) -> 512; SQ8 within
    # the code budget, else PQ with m = 64/4
    cfg = IndexConfig(exact_below=1000, code_budget_gb=budget, recall_queries=300,
                      target_recall=0.9)
    manifest = build_index(wd, "final", "cos", cfg, rebuild=True)
    assert manifest["factory"] == factory
    assert manifest["n"] == 20000 and manifest["d"] == 64 and manifest["key"] == "final"
    assert manifest["metric"] == "cos" and manifest["config"]["key"] == "final"
    assert set(manifest["recall"]) == {"10", "100"}
    assert manifest["recall"]["10"] >= 0.9, manifest["tuning"]
    assert manifest["base_lm"]["fingerprint"] == "weights-a"
    # every setting was measured, and the chosen one is the fastest that reached the target
    table = manifest["tuning"]
    assert {(r["nprobe"], r["rerank"]) for r in table} == {
        (p, r) for p in (4, 8, 16, 32, 64) for r in (0.0, 1.0, 2.0, 4.0)}
    reached = [r for r in table if r["recall@10"] >= 0.9]
    assert manifest["search"] == max(reached, key=lambda r: r["queries_per_s"])
    # Held-out queries from the same distribution, through the public Searcher.
    queries = clustered(n=400, seed=0)[:400] + 0.02
    searcher = Searcher.for_workdir(wd, "final", "cos")
    assert (searcher.metric, searcher.key, searcher.ntotal, searcher.d) == ("cos", "final",
                                                                           20000, 64)
    assert (searcher.nprobe, searcher.rerank) == (manifest["nprobe"], manifest["rerank"])
    _, approx = searcher.search(queries, 10)
    _, exact = exact_search(x.astype(np.float16), queries, 10, "cos")
    assert recall_at(approx, exact, 10) >= 0.85
    # nprobe is honoured: a single probed list loses neighbours.
    one = Searcher.for_workdir(wd, "final", "cos", nprobe=1, rerank=0)
    assert recall_at(one.search(queries, 10)[1], exact, 10) < recall_at(approx, exact, 10)


@pytest.mark.parametrize("factory", ["IVF512,PQ16x8np", "IVF512,SQ8"])
def test_torch_clustering_reaches_the_recall_faiss_training_reaches(clustered_features, tmp_path,
                                                                    factory):
    """An IVF index whose k-means and list assignment ran in torch (a GPU's path without
    faiss-gpu, here on the CPU) is an ordinary faiss index that finds what faiss's own does."""
    wd, x = clustered_features
    built = {}
    for clustering in ("faiss", "torch"):
        copy = Workdir(tmp_path / clustering)
        copy.root.mkdir()
        (copy.root / "features").symlink_to(wd.root / "features")
        cfg = IndexConfig(factory=factory, recall_queries=300, target_recall=0.9,
                          clustering=clustering)
        built[clustering] = build_index(copy, "final", "cos", cfg)
        assert built[clustering]["clustering"] == clustering
        index = faiss.read_index(str(copy.index("final", "cos") / "index.faiss"))
        ivf = faiss.extract_index_ivf(index)   # a view into index, which must stay alive
        assert ivf.ntotal == 20000 and ivf.invlists.imbalance_factor() < 3  # lists balanced
    for setting in ({"nprobe": 8, "rerank": 0.0}, {"nprobe": 16, "rerank": 2.0}):
        recall = {how: measured_recall(m, setting["nprobe"], setting["rerank"], None)[
            "recall@10"] for how, m in built.items()}
        assert recall["torch"] >= recall["faiss"] - 0.03, (setting, recall)
    assert built["torch"]["recall"]["10"] >= 0.9
    assert built["torch"]["fingerprint"] == built["faiss"]["fingerprint"]  # how, not what


def test_an_index_behind_a_transform_is_trained_by_faiss(tmp_path):
    x = clustered(n=3000, d=32)
    wd = train_features(tmp_path, x)
    manifest = build_index(wd, "final", "l2", IndexConfig(factory="OPQ8,IVF16,PQ8x8np",
                                                          recall_queries=32, clustering="torch"))
    assert manifest["clustering"] == "faiss"


def test_reranking_returns_exact_scores_in_exact_order(clustered_features):
    wd, x = clustered_features
    build_index(wd, "final", "l2", IndexConfig(factory="IVF64,PQ8x8np", recall_queries=50))
    queries = clustered(n=50, seed=3) + 0.01
    sims, ids = Searcher.for_workdir(wd, "final", "l2", nprobe=64, rerank=4).search(queries, 5)
    keys = x.astype(np.float16).astype(np.float64)
    ref = -((queries[:, None, :] - keys[ids]) ** 2).sum(-1)
    np.testing.assert_allclose(sims, ref, rtol=1e-4, atol=1e-3)
    assert np.all(np.diff(sims, axis=1) <= 1e-5)                        # best first
    with pytest.raises(ValueError, match="re-ranks with the stored keys"):
        Searcher.open(wd.index("final", "l2"), rerank=2)


def test_auto_is_flat_below_threshold_and_exact(tmp_path):
    wd = train_features(tmp_path, clustered(n=3000, d=32, centres=30))
    manifest = build_index(wd, "final", "ip", IndexConfig(recall_queries=200))
    assert manifest["factory"] == "Flat" and manifest["factory_requested"] == "auto"
    assert manifest["recall"]["10"] >= 0.99 and manifest["recall"]["100"] >= 0.99
    assert (manifest["nprobe"], manifest["rerank"]) == (1, 0.0)
    assert (wd.index("final", "ip") / manifest["index_file"]).is_file()


def test_keys_and_metrics_get_their_own_index(tmp_path):
    x = clustered(n=500, d=16, centres=10)
    wd = train_features(tmp_path, x, att=x[:, ::-1].copy())
    cfg = IndexConfig(factory="Flat", recall_queries=20)
    final = build_index(wd, "final", "l2", cfg)
    att = build_index(wd, "att", "l2", cfg)
    assert (final["key"], att["key"]) == ("final", "att")
    assert final["fingerprint"] != att["fingerprint"]
    assert wd.index("final", "l2").is_dir() and wd.index("att", "l2").is_dir()
    # the att index holds the att keys: a train att key finds itself first
    _, ids = Searcher.open(wd.index("att", "l2")).search(x[:5, ::-1], 1)
    np.testing.assert_array_equal(ids[:, 0], np.arange(5))


def test_auto_factory_rule():
    rng = np.random.default_rng(0)
    balanced = rng.standard_normal((20000, 128)).astype(np.float32)
    cfg = IndexConfig(exact_below=300_000)
    assert auto_factory(100_000, 128, balanced, cfg) == "Flat"
    assert auto_factory(2_000_000, 128, balanced, cfg) == "IVF512,SQ8"  # capped by sample
    big_sample = np.repeat(balanced, 9, axis=0)  # 180k points: 4096 lists x 39
    assert auto_factory(2_000_000, 128, big_sample, cfg) == "IVF4096,SQ8"
    # beyond the code budget (103M keys of d = 512 at a byte per dimension): PQ
    assert auto_factory(103_000_000, 128, big_sample, cfg) == "IVF4096,PQ32x8np"
    skewed = balanced.copy()
    skewed[:, :4] *= 10  # a few outlier dimensions, as in transformer features
    assert auto_factory(103_000_000, 128, skewed, cfg).startswith("OPQ32,IVF")
    assert pq_subquantizers(768) == 192 and pq_subquantizers(100) == 25
    assert pq_subquantizers(30) in (6, 10) and 30 % pq_subquantizers(30) == 0


def test_killed_build_resumes_to_identical_bytes(tmp_path):
    x = clustered(n=6000, d=32, centres=40, seed=4)
    a, b = train_features(tmp_path / "a", x), train_features(tmp_path / "b", x)
    cfg = IndexConfig(factory="IVF64,PQ8x4np", add_chunk=1000, recall_queries=100)
    whole = build_index(a, "final", "l2", cfg)
    assert build_index(b, "final", "l2", cfg, stop_after_chunks=0) == {}
    partial = b.index("final", "l2").with_name("final-l2.partial")
    assert json.loads((partial / "progress.json").read_text())["progress"]["trained"]
    assert faiss.read_index(str(partial / "index.faiss")).ntotal == 0
    assert build_index(b, "final", "l2", cfg, stop_after_chunks=2) == {}
    assert faiss.read_index(str(partial / "index.faiss")).ntotal == 2000
    resumed = build_index(b, "final", "l2", cfg)
    assert not partial.exists()
    assert (a.index("final", "l2") / "index.faiss").read_bytes() == \
        (b.index("final", "l2") / "index.faiss").read_bytes()
    assert resumed["factory"] == "IVF64,PQ8x4np"
    assert resumed["fingerprint"] == whole["fingerprint"]


def test_bad_settings_are_refused(tmp_path):
    wd = train_features(tmp_path, np.random.default_rng(5).standard_normal((50, 16)))
    with pytest.raises(ValueError, match="faiss cannot build index factory"):
        build_index(wd, "final", "l2", IndexConfig(factory="IVF4,PQ5"))
    with pytest.raises(ValueError, match=r"metric must be one of .*\(got 'dot'\)"):
        build_index(wd, "final", "dot")
    with pytest.raises(ValueError, match=r"key must be one of .*\(got 'mid'\)"):
        build_index(wd, "mid", "cos")
    with pytest.raises(ValueError, match=r"index.target_recall must lie in \(0, 1\] \(got 0\)"):
        IndexConfig(target_recall=0)
    with pytest.raises(ValueError, match="device must be one of"):
        IndexConfig(device="tpu")
    with pytest.raises(ArtifactError, match="No complete features"):
        build_index(Workdir(tmp_path / "empty"), "final", "cos")


def test_complete_index_is_skipped_other_settings_refused_and_rebuilt_features_reindexed(
        tmp_path):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    wd = train_features(tmp_path, x)
    cfg = IndexConfig(recall_queries=20)
    first = build_index(wd, "final", "cos", cfg)
    again = build_index(wd, "final", "cos", cfg)
    assert again["created"] == first["created"] and again["fingerprint"] == first["fingerprint"]
    # the number of recall queries or the recall target only change the measurement
    assert build_index(wd, "final", "cos", IndexConfig(recall_queries=5,
                                                       target_recall=0.5))["created"] == \
        first["created"]
    with pytest.raises(ArtifactError, match=r"config\.train_sample: 131072 → 1000"):
        build_index(wd, "final", "cos", IndexConfig(train_sample=1000))

    def replace_train(features, **kw):
        shutil.rmtree(wd.features("train"))
        write_features(wd.features("train"), features, **kw)
        shutil.rmtree(wd.features("valid"))  # the held-out queries: of the same base LM
        write_features(wd.features("valid"), x[:20] - 1, split="valid", **kw)

    replace_train(x + 1, lm=("other-lm", "weights-b"))
    with pytest.raises(ArtifactError, match=r"base_lm_fingerprint: \"weights-a\" → \"weights-b\""):
        build_index(wd, "final", "cos", cfg)
    replace_train(x + 2)  # same base LM, features rebuilt: the index is built again over them
    again = build_index(wd, "final", "cos", cfg)
    assert again["inputs"]["features"] == read_manifest(wd.features("train"))["fingerprint"]
    assert again["fingerprint"] != first["fingerprint"]
    replace_train(x + 1, lm=("other-lm", "weights-b"))
    rebuilt = build_index(wd, "final", "cos", cfg, rebuild=True)
    assert rebuilt["base_lm"]["name"] == "other-lm"
    assert rebuilt["fingerprint"] != first["fingerprint"]


def test_recall_is_measured_at_the_neighbours_depth_and_not_fingerprinted(tmp_path):
    """``search_k`` (the neighbours' K) makes tuning search that deep and record recall@K, the
    very recall a search at K gets; it is a measurement, so an index built without it is
    accepted as it is."""
    x = clustered(n=6300, d=32, centres=40, seed=4)
    train, valid = x[:6000], x[6000:]
    cfg = IndexConfig(factory="IVF64,PQ8x4np", recall_queries=300)   # every valid row
    wd = train_features(tmp_path / "a", train, valid=valid)
    manifest = build_index(wd, "final", "l2", cfg, search_k=300)
    table = manifest["tuning"]
    assert len(table) == 20 and all(row["depth"] == 300 for row in table)
    assert all({"recall@10", "recall@100", "recall@300"} <= set(row) for row in table)
    assert set(manifest["recall"]) == {"10", "100", "300"}
    assert (manifest["tuning_k"], manifest["tuning_width"]) == (300, 300)
    # recall@300 is what searching the valid queries at K = 300 with that setting finds
    _, exact = exact_search(train.astype(np.float16), valid, 300, "l2")
    for row in (table[5], manifest["search"]):
        searcher = Searcher.for_workdir(wd, "final", "l2", nprobe=row["nprobe"],
                                        rerank=row["rerank"])
        _, ids = searcher.search(valid, 300)
        assert row["recall@300"] == pytest.approx(recall_at(ids, exact, 300), abs=1e-4)
    # a lossy setting finds fewer of the 300 than of the 10 nearest: worth measuring
    assert min(r["recall@300"] - r["recall@10"] for r in table) < -0.02
    # ... and the report reads it back for the neighbours' setting
    got = measured_recall(manifest, table[5]["nprobe"], table[5]["rerank"], 300)
    assert got is not None and (got["depth"], got["recall@K"]) == (300, table[5]["recall@300"])

    # built without search_k (as before it existed): accepted as it is, not rebuilt
    old = build_index(train_features(tmp_path / "b", train, valid=valid), "final", "l2", cfg)
    again = build_index(Workdir(tmp_path / "b"), "final", "l2", cfg, search_k=300)
    assert again["created"] == old["created"] and set(again["recall"]) == {"10", "100"}
    assert old["fingerprint"] == manifest["fingerprint"]
    assert measured_recall(again, 4, 0.0, 300)["recall@K"] is None            # not measured
    assert measured_recall(again, 4, 0.0, 300)["depth"] == 128


def test_train_keys_are_refused_as_recall_queries(tmp_path):
    """Each train key finds itself: tuning without held-out (valid) queries is refused, before
    any training, with what to do; ``recall_queries: 0`` skips the measurement."""
    x = clustered(n=3000, d=16, centres=20)
    wd = Workdir(tmp_path)
    write_features(wd.features("train"), x)
    cfg = IndexConfig(factory="IVF16,Flat", recall_queries=100)
    with pytest.raises(ArtifactError, match=r"needs held-out queries.*build the valid features "
                                            r"first.*index\.recall_queries: 0 to skip"):
        build_index(wd, "final", "l2", cfg)
    assert not wd.index("final", "l2").exists()
    assert not wd.index("final", "l2").with_name("final-l2.partial").exists()
    # valid features of another base LM are no held-out queries for these keys either
    write_features(wd.features("valid"), x[:50] + 0.1, split="valid", lm=("other-lm", "w-b"))
    with pytest.raises(ArtifactError, match=r"other-lm.*fake-lm.*index\.recall_queries: 0"):
        build_index(wd, "final", "l2", cfg)
    manifest = build_index(wd, "final", "l2", IndexConfig(factory="IVF16,Flat",
                                                          recall_queries=0))
    assert manifest["tuning"] == [] and manifest["recall"] == {}
    assert manifest["recall_queries"] == 0


@pytest.mark.integration
def test_torch_clustering_on_wikitext2_features_reaches_the_target_recall(workdir, tmp_path):
    """The GPU path's index (k-means and list assignment in torch), built here on the CPU over
    the test pipeline's WikiText-2 train keys: the recall the config targets, and what faiss's
    own training reaches at the same setting."""
    built = {}
    for clustering in ("torch", "faiss"):
        root = tmp_path / clustering
        root.mkdir()
        (root / "features").symlink_to(workdir / "features")
        built[clustering] = build_index(
            Workdir(root), "final", "cos",
            IndexConfig(factory="IVF1024,SQ8", recall_queries=300, target_recall=0.9,
                        clustering=clustering), search_k=64)
    assert built["torch"]["clustering"] == "torch"
    assert built["torch"]["search"]["recall@10"] >= 0.9
    same = {how: measured_recall(m, 8, 1.0, 64) for how, m in built.items()}
    assert same["torch"]["recall@10"] >= same["faiss"]["recall@10"] - 0.03, same
    assert same["torch"]["recall@K"] >= same["faiss"]["recall@K"] - 0.03, same
