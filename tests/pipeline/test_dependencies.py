"""``--rebuild=[X]`` rebuilds X and every stage that reads X, transitively, and says which in one
line; an artifact made from inputs since rebuilt is built again rather than refused (a trained
head is retrained), while one made with other settings of its own is still refused, naming the
``--rebuild`` that cascades. The closure on the test pipeline's configs; then, on a WikiText-2
slice through a GNN-LM head, one run after ``--rebuild=[neighbors]``, and one after a changed
``neighbors.K``."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.config_checks import STAGES
from gnnlm.pipeline.dependencies import (
    STAGE_READS,
    cascade_line,
    downstream,
    rebuild_set,
    stage_graph,
)
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError
from tests.conftest import PIPELINE
from tests.fakes import error_of

pytestmark = pytest.mark.usefixtures("in_repo")

# the heads of the test pipeline (configs/tests/pipeline.yaml), by row
HEADS = {"gnn", "spalm", "spalm_ft", "transformer", "transformer_xl", "spalm_xl",
         "spalm_xl_variant", "transformer_xl_scratch", "spalm_xl_scratch", "learned_wds",
         "learned_wds[n=3]"}


def pipeline(*rebuild: str, extra: tuple[str, ...] = ()):
    return load_config([*PIPELINE, f"--rebuild=[{','.join(rebuild)}]", *extra])


# -- the closure ---------------------------------------------------------------------------------

def test_the_closure_is_transitive_and_only_downward():
    graph = {"a": (), "b": ("a",), "c": ("b",), "d": ("c", "e"), "e": ()}
    assert downstream(graph, {"b"}) == {"b", "c", "d"}
    assert downstream(graph, {"e"}) == {"e", "d"}
    assert downstream(graph, {"d"}) == {"d"}
    assert downstream(graph, set()) == set()


def test_rebuilding_the_neighbours_rebuilds_every_stage_that_reads_them():
    cfg = pipeline("neighbors")
    assert rebuild_set(cfg) == {"neighbors", "knn_cache", "ablations", *HEADS}
    assert cfg.rebuilds("knn_cache") and cfg.rebuilds("learned_wds[n=3]")
    assert not any(cfg.rebuilds(s) for s in ("tokens", "base_lm", "features", "index", "pq",
                                             "base_lm_xl"))


def test_pq_codes_cascade_to_the_gnn_only_when_its_nodes_read_them():
    assert rebuild_set(pipeline("pq")) == {"pq", "gnn"}        # node_features: pq
    raw = load_config(["-c", "configs/tests/hf_family.yaml", "--base_lm.ckpt=hf:gpt2",
                       "--corpus.path=.", "--rebuild=[pq]"])   # node_features: raw
    assert rebuild_set(raw) == {"pq"}


def test_upstream_stages_cascade_through_everything_that_reads_them():
    graph = stage_graph(pipeline())
    assert rebuild_set(pipeline("tokens")) == set(graph)
    assert rebuild_set(pipeline("index")) == {"index", "neighbors", "knn_cache", "ablations",
                                              *HEADS}
    assert rebuild_set(pipeline("heads")) == {*HEADS, "base_lm_xl", "ablations"}
    assert rebuild_set(pipeline("gnn")) == {"gnn"}
    assert rebuild_set(pipeline("ablations")) == {"ablations"}
    assert rebuild_set(load_config([*PIPELINE, "--rebuild=true"])) == set(graph)
    assert not load_config(PIPELINE).rebuilds("tokens")


def test_the_graph_names_every_stage_rebuild_may_name():
    assert set(STAGES) | {"base_lm_xl"} == set(STAGE_READS) | {"heads"}
    graph = stage_graph(pipeline())
    assert list(graph).index("pq") < list(graph).index("gnn") < list(graph).index("ablations")
    assert all(set(reads) <= set(graph) for reads in graph.values())


def test_the_graph_covers_what_each_head_records_reading():
    from tests.pipeline.test_identity import (
        HEAD_READS,  # checked there against the test pipeline's manifests
    )

    graph = stage_graph(pipeline())
    for row, reads in HEAD_READS.items():
        assert {relative.split("/")[0] for relative in reads} <= set(graph[row]), row


def test_one_line_names_the_finished_stages_that_are_also_rebuilt(tmp_path):
    wd = Workdir(tmp_path)
    for folder in ("neighbors/final-cos/train", "knn_cache/final-cos-faiss/test", "models/gnn",
                   "models/learned_wds_n3", "ablations"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "manifest.json").write_text("{}")
    (tmp_path / "models" / "spalm").mkdir()       # no manifest: not finished, built anyway
    cfg = pipeline("neighbors", extra=(f"--workdir={tmp_path}",))
    assert cascade_line(cfg, wd) == (
        "--rebuild=[neighbors] also rebuilds knn_cache, gnn, learned_wds[n=3], ablations, which "
        "read neighbors (directly or through another stage); gnn, learned_wds[n=3] are "
        "retrained, as their weights were fit to what is rebuilt.")
    assert cascade_line(pipeline("index", "knn_cache"), wd).startswith(  # knn_cache: named
        "--rebuild=[index,knn_cache] also rebuilds neighbors, gnn, learned_wds[n=3], ablations, "
        "which read index or knn_cache (directly")
    assert cascade_line(pipeline("pq", "ablations"), wd) == (   # pq: not finished
        "--rebuild=[pq,ablations] also rebuilds gnn, which reads pq (directly or through another "
        "stage); gnn is retrained, as its weights were fit to what is rebuilt.")
    for nothing_more in ("ablations", "gnn", "all"):
        assert cascade_line(pipeline(nothing_more), wd) is None


# -- what a builder does with an artifact made from inputs since rebuilt -------------------------

def _build(path, config, inputs, kind="knn_cache", rebuild=False):
    builder = ArtifactBuilder(path, kind=kind, config=config, inputs=inputs, rebuild=rebuild)
    if builder.is_complete():
        return None
    with builder:
        builder.array("values", np.float32, (2,))[:] = 1
        return builder.finish()


def test_an_artifact_whose_inputs_were_rebuilt_is_built_again_saying_why(tmp_path, capsys):
    path = tmp_path / "knn_cache"
    old = _build(tmp_path / "neighbors", {"K": 8}, {}, kind="neighbors")["fingerprint"]
    first = _build(path, {"split": "test"}, {"neighbors": old})
    assert _build(path, {"split": "test"}, {"neighbors": old}) is None     # reused
    new = _build(tmp_path / "neighbors", {"K": 16}, {}, kind="neighbors",
                 rebuild=True)["fingerprint"]
    again = _build(path, {"split": "test"}, {"neighbors": new})
    assert again["inputs"] == {"neighbors": new} and again["fingerprint"] != first["fingerprint"]
    assert (f"[gnnlm] knn_cache {path}: rebuilding: it was made from inputs since rebuilt "
            f"(neighbors: {old} → {new})") in capsys.readouterr().err


def test_its_own_settings_or_an_input_from_outside_changed_are_still_refused(tmp_path):
    """Refused naming the ``--rebuild`` that cascades: other settings of its own, inputs of
    other names, or an input that names no artifact (a base LM given by its weights)."""
    path = tmp_path / "knn_cache"
    upstream = _build(tmp_path / "neighbors", {"K": 8}, {}, kind="neighbors")["fingerprint"]
    _build(path, {"split": "test"}, {"neighbors": upstream})
    before = (path / "manifest.json").read_text()
    for config, inputs in (({"split": "valid"}, {"neighbors": upstream}),
                           ({"split": "valid"}, {"neighbors": "0123456789abcdef"}),
                           ({"split": "test"}, {"neighbors": "0123456789abcdef"}),
                           ({"split": "test"}, {"neighbors": upstream, "features": upstream})):
        with pytest.raises(ArtifactError) as err:
            _build(path, config, inputs)
        assert str(err.value).startswith(f"{path} holds a knn_cache made with other settings")
        assert str(err.value).endswith(
            "or rerun with --rebuild=[knn_cache], which rebuilds it and every stage that reads it.")
    assert (path / "manifest.json").read_text() == before


def test_a_flipped_byte_is_still_refused(tmp_path):
    path = tmp_path / "knn_cache"
    _build(path, {"split": "test"}, {})
    data = bytearray((path / "values.bin").read_bytes())
    data[0] ^= 1
    (path / "values.bin").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match the sha256 in its manifest"):
        _build(path, {"split": "test"}, {})


# -- on a WikiText-2 slice, through a GNN-LM head ------------------------------------------------

@pytest.fixture(scope="module")
def built(hf_family_built):
    """The retrieval pipeline with GNN-LM on a WikiText-2 slice (``tests.conftest``): (its
    arguments without the work directory, the work directory)."""
    return hf_family_built


RETRIEVAL = ("neighbors/final-cos/train", "neighbors/final-cos/valid", "neighbors/final-cos/test",
             "knn_cache/final-cos-faiss/valid", "knn_cache/final-cos-faiss/test", "models/gnn")
KEPT = ("tokens", "features/train", "features/valid", "features/test")  # exact search: no index


def manifests(work) -> dict[str, dict]:
    return {name: read_manifest(work / name) for name in RETRIEVAL + KEPT}


def rerun(args, work, capsys, *extra) -> tuple[str, str]:
    """``gnnlm pipeline`` on ``work``: (stdout, stderr); the report must have finite
    perplexities."""
    from gnnlm.cli import main

    main(["pipeline", *args, f"--workdir={work}", *extra])
    out, err = capsys.readouterr()
    ppl = json.loads((work / "reports" / "hf-family" / "results.json").read_text())["ppl"]
    assert all(math.isfinite(ppl[row]) for row in ("base", "knn", "gnn", "gnn+knn")), ppl
    return out, err


@pytest.mark.integration
def test_rebuilding_the_neighbours_rebuilds_the_caches_and_retrains_the_head_in_one_run(
        built, tmp_path, capsys):
    args, source = built
    work = shutil.copytree(source, tmp_path / "work")
    assert not (work / "index").exists()          # exact neighbours read no index
    before = manifests(work)
    capsys.readouterr()
    out, err = rerun(args, work, capsys, "--rebuild=[neighbors]")
    assert ("--rebuild=[neighbors] also rebuilds knn_cache, gnn, which read neighbors (directly "
            "or through another stage); gnn is retrained, as its weights were fit to what is "
            "rebuilt.") in out.splitlines()
    after = manifests(work)
    for name in RETRIEVAL:  # built again (the same settings: the same fingerprints)
        assert after[name]["created"] > before[name]["created"], name
        assert after[name]["fingerprint"] == before[name]["fingerprint"], name
        assert f"{work / name}: built in" in err
    for name in KEPT:
        assert after[name] == before[name], name
    assert "refus" not in err


@pytest.mark.integration
def test_a_changed_neighbors_k_is_refused_once_then_cascades_in_one_run(built, tmp_path, capsys):
    args, source = built
    work = shutil.copytree(source, tmp_path / "work")
    before = manifests(work)
    capsys.readouterr()
    train = work / "neighbors" / "final-cos" / "train"
    assert error_of(["pipeline", *args, f"--workdir={work}", "--neighbors.K=24"], capsys) == (
        f"gnnlm pipeline: error: {train} holds a neighbors made with other settings than this "
        f"run asks for: config.K: 16 → 24. Use another work directory, delete the folder, or "
        f"rerun with --rebuild=[neighbors], which rebuilds it and every stage that reads it.")
    assert manifests(work) == before

    out, _ = rerun(args, work, capsys, "--neighbors.K=24", "--rebuild=[neighbors]")
    assert out.startswith("--rebuild=[neighbors] also rebuilds knn_cache, gnn, which read ")
    after = manifests(work)
    neighbours = {s: after[f"neighbors/final-cos/{s}"] for s in ("train", "valid", "test")}
    assert all(m["config"]["K"] == 24 for m in neighbours.values())
    for split in ("valid", "test"):
        cache = after[f"knn_cache/final-cos-faiss/{split}"]
        assert cache["inputs"]["neighbors"] == neighbours[split]["fingerprint"]
    gnn = after["models/gnn"]
    assert gnn["inputs"]["neighbors_final-cos"] == neighbours["train"]["fingerprint"]
    assert gnn["inputs"] != before["models/gnn"]["inputs"]
    assert gnn["created"] > before["models/gnn"]["created"]
    for name in KEPT:
        assert after[name] == before[name], name


# -- which runs search train queries -------------------------------------------------------------

def test_train_queries_are_searched_only_for_a_head_that_reads_neighbours():
    """GNN-LM's graphs and SPALM's memories read the train neighbours (its gate through
    ``retrieved`` > 0); a learned output embedding and kNN-LM read none, so a run with only
    those searches valid and test alone."""
    from gnnlm.pipeline.dependencies import heads_read_neighbors
    from gnnlm.workdir.rows import HEAD_CONFIGS

    no_heads = [f"--{name}.config=null" for name in HEAD_CONFIGS]
    wds_only = pipeline(extra=tuple(no_heads))
    assert heads_read_neighbors(pipeline())
    assert not heads_read_neighbors(wds_only)
    assert set(wds_only.heads()) == {"learned_wds", "learned_wds[n=3]"}
    only = {name: tuple(a for a in no_heads if not a.startswith(f"--{name}."))
            for name in ("gnn", "spalm", "spalm_ft")}
    assert all(heads_read_neighbors(pipeline(extra=args)) for args in only.values())
