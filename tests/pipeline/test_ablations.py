"""The Xu et al. ablation table: rows labelled by what was searched (§5.1), none computed twice,
and the index's own scores as a row of their own."""
from __future__ import annotations

import json
import shutil
from itertools import combinations

import faiss
import numpy as np
import pytest

from gnnlm.pipeline.ablations import (
    ABLATIONS_VERSION,
    AblationConfig,
    Evaluator,
    outdated,
    run_ablations,
)
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.knn_cache import build_knn_cache
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
from gnnlm.retrieval.search import rescore
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import EVAL_SPLITS, Workdir
from tests import fakes

GRID = ([4, 16, 32], [0.05, 0.1, 0.3, 1.0], [0.0, 0.1, 0.25, 0.5])
STAGE = AblationConfig(enabled=True, eval_tokens=200, metrics=["cos", "l2"], subsample=[0.5, 1.0],
                      device="cpu")
INDEX = "IVF8,PQ4x4np"
RERANKED = "kNN-LM, key final, cos: IVF8,PQ4x4np neighbours (nprobe 2, re-ranked 2x) + exact scores"


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Train/valid/test features around 20 clusters whose id is (mostly) the target, so that
    retrieval helps; ``att`` keys are ``-final`` so the two key types differ."""
    wd = Workdir(tmp_path_factory.mktemp("ablations"))
    rng = np.random.default_rng(7)
    centres = 2 * rng.standard_normal((20, 16))

    def split(n: int, name: str) -> None:
        cluster = rng.integers(0, 20, n)
        final = (centres[cluster] + rng.standard_normal((n, 16))).astype(np.float32)
        targets = np.where(rng.uniform(size=n) < 0.7, cluster, rng.integers(0, 20, n))
        fakes.write_features(wd.features(name), final, -final, targets.astype(np.int32),
                             np.log(rng.uniform(0.02, 0.3, n)), split=name)

    split(2000, "train")
    for name in EVAL_SPLITS:
        split(300, name)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        build_index(wd, "final", "cos", IndexConfig(factory=INDEX, recall_queries=50))
    finally:
        faiss.omp_set_num_threads(before)
    return wd


def retrieval(features: Workdir, root, config: NeighborsConfig, index: Workdir | None = None
              ) -> Workdir:
    """A work directory with the features (and the index of ``index``, default ``features``),
    neighbours of valid/test under ``config`` and their kNN caches with "faiss" scores."""
    root.mkdir(parents=True)
    (root / "features").symlink_to(features.root / "features")
    (root / "index").symlink_to((index or features).root / "index")
    wd = Workdir(root)
    for split in EVAL_SPLITS:
        build_neighbors(wd, split, "final", "cos", config)
        build_knn_cache(wd, split, "final", "cos", "faiss")
    return wd


def ablate(wd: Workdir) -> dict:
    return run_ablations(STAGE, wd, ["final"], "cos", "faiss", GRID, wd.root / "out")


@pytest.fixture(scope="module")
def reranked(features, tmp_path_factory):
    """The CPU demo's case: neighbours from an IVF index searched with re-ranking."""
    wd = retrieval(features, tmp_path_factory.mktemp("reranked") / "w",
                   NeighborsConfig(K=32, nprobe=2, rerank=2))
    return wd, ablate(wd)


def labels(result: dict) -> list[str]:
    return [r["row"] for r in result["rows"]]


def test_labels_say_what_was_searched(reranked):
    """Re-ranked neighbours carry exact scores: the table says so instead of "FAISS scores"."""
    _, result = reranked
    assert labels(result) == [
        "base LM", RERANKED,
        "kNN-LM, key final, cos: IVF8,PQ4x4np neighbours (nprobe 2) + approximate (index) scores",
        "kNN-LM, key final, cos: exact neighbours + exact scores",
        "kNN-LM, key final, l2: exact neighbours + exact scores"]
    assert result["version"] == ABLATIONS_VERSION
    assert not any("FAISS" in label for label in labels(result))


def test_no_two_rows_are_the_same_computation(reranked):
    """Recomputing re-ranked scores exactly gives the pipeline's row again: it is not scored a
    second time, and the result says why."""
    _, result = reranked
    assert result["skipped"] == [{"row": RERANKED, "why": "the pipeline's scores are exact "
                                                         "already: recomputing them is its row "
                                                         "above"}]
    assert len(set(labels(result))) == len(result["rows"])
    for a, b in combinations(result["rows"], 2):
        assert (a["valid_ppl"], a["test_ppl"]) != (b["valid_ppl"], b["test_ppl"]), (a, b)


def test_the_index_scores_row_is_its_own_search(reranked):
    """§5.1's "FAISS mask, FAISS score": the same index at the neighbours' nprobe, not re-ranked;
    its scores are the index's (PQ codes), not the exact similarities of its neighbours."""
    wd, result = reranked
    ev = Evaluator(wd, "final", STAGE, GRID, K=32)
    approx = ev.approximate("cos", nprobe=2)
    index = faiss.read_index(str(wd.index("final", "cos") / "index.faiss"))
    faiss.extract_index_ivf(index).nprobe = 2
    for split in EVAL_SPLITS:
        q = ev.queries(split)
        scores, ids = index.search(q / np.linalg.norm(q, axis=1, keepdims=True), 32)
        np.testing.assert_allclose(approx[split]["sims"], scores, rtol=1e-6)
        exact = rescore(q, ids.astype(np.int64), ev.train["final"], "cos")
        found = ids >= 0
        assert np.abs(approx[split]["sims"][found] - exact[found]).mean() > 1e-3
    row = next(r for r in result["rows"] if "approximate (index) scores" in r["row"])
    assert row == {"row": row["row"], **ev.score(approx)}
    assert row["valid_ppl"] != result["rows"][1]["valid_ppl"]  # the re-ranked, exact row


def test_exact_backend_rows_never_say_index_neighbours(features, tmp_path):
    """``neighbors.backend: exact`` (the GPU config): the pipeline's row is exact neighbours,
    which the cos row of the metric comparison would repeat; the index still gives the
    approximate row, at its tuned nprobe."""
    wd = retrieval(features, tmp_path / "w", NeighborsConfig(K=32, backend="exact"))
    result = ablate(wd)
    nprobe = json.loads((wd.index("final", "cos") / "manifest.json").read_text())["nprobe"]
    assert labels(result) == [
        "base LM", "kNN-LM, key final, cos: exact neighbours + exact scores",
        f"kNN-LM, key final, cos: IVF8,PQ4x4np neighbours (nprobe {nprobe}) + approximate "
        f"(index) scores",
        "kNN-LM, key final, l2: exact neighbours + exact scores"]
    pipeline_rows = [label for label in labels(result) if "approximate" not in label]
    assert not any("FAISS" in label or "IVF" in label for label in pipeline_rows)
    assert [s["row"] for s in result["skipped"]] == [
        "kNN-LM, key final, cos: exact neighbours + exact scores"] * 2


def test_an_index_without_rerank_and_a_flat_index(features, tmp_path):
    """Neighbours searched without re-ranking are the index-scores row already; a Flat index has
    exact scores, so there is no approximate row to add."""
    wd = retrieval(features, tmp_path / "w", NeighborsConfig(K=32, nprobe=2, rerank=0))
    result = ablate(wd)
    approx = ("kNN-LM, key final, cos: IVF8,PQ4x4np neighbours (nprobe 2) + approximate (index) "
              "scores")
    assert labels(result)[1:3] == [
        approx, "kNN-LM, key final, cos: IVF8,PQ4x4np neighbours (nprobe 2) + exact scores"]
    assert result["skipped"] == [{"row": approx, "why": "the pipeline's row above is this search"}]

    flat = Workdir(tmp_path / "flat")
    (flat.root / "index").mkdir(parents=True)
    (flat.root / "features").symlink_to(features.root / "features")
    build_index(flat, "final", "cos", IndexConfig(factory="Flat", recall_queries=50))
    wd = retrieval(features, tmp_path / "f", NeighborsConfig(K=32), index=flat)
    result = ablate(wd)
    assert labels(result) == ["base LM", "kNN-LM, key final, cos: exact neighbours + exact scores",
                              "kNN-LM, key final, l2: exact neighbours + exact scores"]
    assert {s["row"]: s["why"] for s in result["skipped"]}[
        "kNN-LM, key final, cos: exact neighbours + approximate (index) scores"] == (
        "the index Flat holds the keys uncompressed: its scores are exact")


def test_caches_of_the_old_code_get_the_same_labels(reranked, tmp_path):
    """Caches built before their manifests recorded the search are labelled from their
    neighbours: an existing work directory needs no rebuild."""
    wd, result = reranked
    old = tmp_path / "w"
    for name in ("features", "index"):
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        (old / name).symlink_to(wd.root / name)
    for name in ("neighbors", "knn_cache"):
        shutil.copytree(wd.root / name, old / name)
    for manifest in (old / "knn_cache").rglob("manifest.json"):
        data = json.loads(manifest.read_text())
        for name in ("nprobe", "rerank", "scores_are_exact", "manifest_sha256"):
            del data[name]  # (nor a checksum of its own content)
        manifest.write_text(json.dumps(data))
    for manifest in (old / "neighbors").rglob("manifest.json"):  # written by that code too
        data = json.loads(manifest.read_text())
        del data["manifest_sha256"]
        manifest.write_text(json.dumps(data))
    assert labels(ablate(Workdir(old))) == labels(result)


def test_a_table_of_the_old_code_is_outdated(tmp_path):
    """``stage_ablations`` rebuilds a table whose config has no version (rows labelled by
    intent) rather than show it."""
    assert not outdated(tmp_path / "none")
    for version, stale in ((None, True), (1, True), (ABLATIONS_VERSION, False)):
        path = tmp_path / f"v{version}"
        config = {"enabled": True} if version is None else {"enabled": True, "version": version}
        builder = ArtifactBuilder(path, kind="ablations", config=config)
        with builder:
            builder.finish(extra={"result": {}})
        assert outdated(path) is stale
