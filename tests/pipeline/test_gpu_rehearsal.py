"""The GPU table's rehearsal on the CPU: ``scripts/gpu_check.sh --rehearsal`` (the benchmark at
small shapes, then ``scripts/gpu_table.sh`` with ``pipeline.yaml`` and the fit YAMLs it names,
overlaid by ``configs/tests/gpu_rehearsal.yaml``: sizes, the device and the base LM's schedule,
as ``tests.rehearsal`` lists), run from a fresh folder. Every GPU option runs: bf16-mixed
autocast, exact search, both key types, PQ node features read by 8 DataLoader workers, the k
curriculum, the eval_ks list, SPALM's gate and the SPALM comparison's six rows with their kNN-LM
ceilings, and every time limit. About 6 minutes on two idle cores (bf16 matmuls run several
times slower than float32 on a CPU without bf16 units)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import gnnlm
from gnnlm.pipeline.config_files import merged_yaml
from gnnlm.workdir.manifests import read_manifest
from tests.conftest import REHEARSAL_SIZE_OVERLAYS, REPO, yaml_leaves
from tests.rehearsal import undeclared_changes

pytestmark = pytest.mark.integration

REHEARSAL = ["-c", "configs/tests/gpu_rehearsal.yaml"]
ROWS = {"base", "knn", "knn[att]", "gnn", "gnn+knn", "spalm",
        "transformer", "transformer_xl", "spalm_xl", "spalm_xl_variant",
        "transformer_xl_scratch", "spalm_xl_scratch",
        "transformer_xl+knn", "transformer_xl+knn[k=4]",
        "transformer_xl_scratch+knn", "transformer_xl_scratch+knn[k=4]"}
TRAINED = ["base_lm", "gnn", "spalm", "transformer", "transformer_xl", "spalm_xl",
           "spalm_xl_variant", "transformer_xl_scratch", "spalm_xl_scratch"]


@pytest.fixture(scope="module")
def rehearsal(wikitext_root, tmp_path_factory):
    """The rehearsal, once, in a fresh folder, through ``scripts/gpu_check.sh --rehearsal`` (the
    GPU machine's one command: the benchmark at small shapes on a CPU, then the table script);
    returns (folder, the table's folder, the command's OUT). Its time limits are lifted: they
    are a GPU's, and a loaded CPU takes minutes."""
    cwd = tmp_path_factory.mktemp("gpu-rehearsal")
    (cwd / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "PYTHON": sys.executable, "GNNLM_DATA": str(wikitext_root),
           "GNNLM_WHEELS": str(cwd / "no-wheels"), "GNNLM_SITE": str(cwd / "site"),
           "GNNLM_CHECK_TABLE": str(cwd / "table"), "BENCH_SECONDS": "900",
           "TABLE_SECONDS": "2700", "CHECK_SECONDS": "3600"}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "out",
                             "--rehearsal"], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise AssertionError(f"the GPU rehearsal failed:\n{result.stdout[-6000:]}\n"
                             f"{result.stderr[-3000:]}")
    return cwd, cwd / "table", cwd / "out"


@pytest.fixture(scope="module")
def results(rehearsal) -> dict:
    return json.loads((rehearsal[1] / "results.json").read_text())



def test_every_row_of_the_gpu_table_is_scored_on_the_same_tokens(rehearsal, results):
    assert set(results["ppl"]) == ROWS
    with np.load(rehearsal[1] / "test_logprobs.npz") as scores:
        assert set(scores.files) == ROWS
        for row in ROWS:
            assert scores[row].shape == (results["tokens"],) == (5_000,), row
            assert np.isfinite(scores[row]).all() and (scores[row] <= 0).all(), row
    stages = {s["stage"] for s in
              json.loads((rehearsal[1] / "stage_times.json").read_text())["stages"]}
    assert {"base_lm", "features", "neighbors[final]", "neighbors[att]", "pq",
            "interpolations", "report", *TRAINED[1:]} <= stages
    assert not any(stage.startswith("index") for stage in stages)  # exact search reads none
    assert "+GNN+kNN" in (rehearsal[1] / "pipeline.log").read_text()


def test_the_check_leaves_eight_files_the_bench_and_the_records(rehearsal, results):
    out = rehearsal[2]
    assert sorted(p.name for p in out.iterdir()) == [
        "bench_gpu.json", "pipeline.log", "records.tar.gz", "reproduce.json", "results.json",
        "results.md", "stage_times.json", "test_logprobs.npz"]
    assert json.loads((out / "results.json").read_text()) == results
    assert (out / "test_logprobs.npz").read_bytes() == (
        rehearsal[1] / "test_logprobs.npz").read_bytes()
    bench = json.loads((out / "bench_gpu.json").read_text())
    assert bench["shapes"]["keys"] == 20_000                       # small shapes on a CPU
    assert bench["exact_search"]["equal_to_float32_screening"] is True
    log = (out / "pipeline.log").read_text()
    assert "exact search (float32 screening)" in log and "the table ended with status 0" in log
    with tarfile.open(out / "records.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("models/gnn/manifest.json") for n in names)
    assert any(n.endswith("environment.txt") for n in names)


def test_retrieval_is_the_gpu_config_s_exact_search_with_both_keys(results):
    for key in ("final", "att"):
        facts = results["retrieval"][key]
        assert facts["backend"] == "exact" and facts["K"] == 64, facts
        assert facts["index_factory"] is None and facts["index_use"] is None  # none built
        assert facts["screen"]["float32"] > 0 and facts["screen"]["exhaustive"] >= 0
    for row in ("knn", "knn[att]", "gnn+knn", "transformer_xl+knn"):
        assert results["hparams"][row]["neighbours"] == "exact neighbours", row
    # real outcomes on the slice: retrieval helps the rehearsal's base LM
    assert results["ppl"]["knn"] < 0.9 * results["ppl"]["base"]
    assert results["ppl"]["gnn+knn"] < 0.9 * results["ppl"]["base"]


def test_gnn_lm_ran_its_curriculum_on_pq_features_and_scored_every_eval_k(rehearsal, results):
    workdir = rehearsal[0] / "runs" / "tests" / "gpu-rehearsal"
    pq = json.loads((workdir / "pq" / "final" / "manifest.json").read_text())
    assert pq["code_bytes"] == 16 and pq["factory"] == "PQ16x8np"
    data = json.loads((workdir / "models" / "gnn" / "manifest.json").read_text())[
        "config"]["values"]["data"]["init_args"]
    assert data["node_features"] == "pq" and data["num_workers"] == 8
    assert data["k_schedule"] == [[0, 4], [1, 8]]
    # both epochs of the curriculum trained, k = 4 then k = 8: time was not the bound
    training = results["training"]["gnn"]
    assert training["stopped_by"] == "max_epochs", training
    assert sorted(int(k) for k in results["gnn_eval_k"]["valid_ppl"]) == [4, 8, 16, 32]
    assert str(results["gnn_eval_k"]["chosen"]) in results["gnn_eval_k"]["valid_ppl"]


@pytest.mark.parametrize("part", TRAINED)
def test_every_trained_part_ran_the_gpu_config_s_options(rehearsal, part):
    """Each trained part's recorded config is its GPU chain's, but for the sizes, the device and
    the other changes ``tests.rehearsal`` lists (the base LM's schedule, with both values):
    bf16-mixed, the time limit, workers, schedules, callbacks. A field the size overlay sets
    that is not listed fails, whatever its value."""
    workdir = rehearsal[0] / "runs" / "tests" / "gpu-rehearsal"
    manifest = json.loads((workdir / "models" / part / "manifest.json").read_text())
    recorded = manifest["config"]["values"]
    section = merged_yaml([str(REPO / "configs/wikitext2/pipeline.yaml"),
                           str(REPO / "configs/tests/gpu_rehearsal.yaml")])[part]["config"]
    chain = [REPO / f for f in section]
    sized = [f for f in chain if str(f.relative_to(REPO)).startswith(REHEARSAL_SIZE_OVERLAYS)]
    assert len(sized) == 1, section
    gpu = merged_yaml([str(f) for f in chain if f not in sized])
    assert yaml_leaves(recorded)[("trainer", "precision")] == "bf16-mixed"
    assert yaml_leaves(recorded)[("trainer", "max_time")] == yaml_leaves(gpu)[
        ("trainer", "max_time")]
    assert undeclared_changes(part, gpu, merged_yaml([str(sized[0])]), recorded) == []


def test_gnnlm_load_serves_each_row_in_the_precision_the_report_scored_it(rehearsal, results):
    """The heads were scored under bf16-mixed autocast (on the CPU too), the base LM and kNN-LM
    in float32: the report and the heads' manifests record it, and ``gnnlm.load`` serves each
    row the same way. So, as the check's last part measured (``gnnlm reproduce``,
    reproduce.json), the test split's tokens give every row's report scores (equal to the bit;
    heads served in float32 were up to 5e-3 nats apart, 7e-6 for GNN-LM), and a prefix's
    next-token distribution gives the report's score of the token that follows, to bf16 kernel
    rounding (measured: 3.6e-5 and 2.8e-5 nats on average for the two Transformer rows, 5.2e-7
    for GNN+kNN; the Transformer rows in float32, 2.5e-4)."""
    workdir = rehearsal[0] / "runs" / "tests" / "gpu-rehearsal"
    heads = sorted(row for row in ROWS if row not in ("base", "knn", "knn[att]"))
    assert results["precisions"] == {row: "bf16-mixed" if row in heads else "32-true"
                                     for row in ROWS}
    for part in TRAINED[1:]:
        assert read_manifest(workdir / "models" / part)["precision"] == "bf16-mixed", part
    served = json.loads((rehearsal[2] / "reproduce.json").read_text())
    assert (served["workdir"], served["tokens"], served["served_on"]) == (
        "runs/tests/gpu-rehearsal", results["tokens"], "cpu")
    assert set(served["rows"]) == ROWS
    for row, figures in served["rows"].items():
        assert figures["equal"] and figures["max_abs"] == 0, row
        assert figures["ppl"] == pytest.approx(results["ppl"][row], rel=1e-5), row
    assert set(served["decoding"]) == {"transformer", "transformer_xl", "gnn+knn"}
    for row, figures in served["decoding"].items():  # within stream 0's first segment
        assert figures["positions"] == 63, row
        assert figures["mean_abs"] < 8e-5, (row, figures)
    log = (rehearsal[2] / "pipeline.log").read_text()
    assert "reproduce ended with status 0" in log
    # a report written before it recorded precisions: each head's manifest says the same
    lm = gnnlm.load(workdir)
    del lm.served.results["precisions"]
    assert {row: lm.served.row(row).precision for row in ROWS} == results["precisions"]
