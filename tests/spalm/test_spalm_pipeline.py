"""Integration on the WikiText-2 slice of ``configs/tests/pipeline.yaml``: SPALM trained end to
end (the paper's form, and with its two options; warm and from scratch) against the transformer
and Transformer-XL trained the same way, each keeping its best validation's weights and scoring
the same test tokens once on contiguous segments; the ceiling rows of Transformer-XL with
kNN-LM; no train position's retrieved values come from inside its leakage window; SPALM's
analyses in the report."""
from __future__ import annotations

import numpy as np
import pytest

from datamodules.spalm import SpalmDataModule
from gnnlm.retrieval.features import open_features
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest

pytestmark = pytest.mark.integration

ROWS = ("transformer", "transformer_xl", "spalm_xl", "spalm_xl_variant",
        "transformer_xl_scratch", "spalm_xl_scratch")


def test_the_segment_rows_score_every_token_of_the_same_splits(results, workdir):
    wd = Workdir(workdir)
    assert set(ROWS) <= set(results["ppl"]) and set(ROWS) <= set(results["valid_ppl"])
    for row in ROWS:
        for split in ("valid", "test"):
            logprob = np.asarray(open_array(wd.model(row), f"{split}_logprob"))
            assert len(logprob) == wd.n_positions(split) and np.all(logprob <= 0)
    assert read_manifest(wd.model("spalm_xl"))["spalm"]["k"] == 4  # the paper's, spalm_xl.yaml
    assert read_manifest(wd.model("transformer_xl"))["model_class"] == "SpalmXL"
    assert read_manifest(wd.model("spalm_xl_scratch"))["spalm"]["init"] == "scratch"
    assert read_manifest(wd.model("spalm_xl"))["spalm"]["init"] == "warm"


def test_every_segment_row_keeps_its_best_validation_s_weights(results, workdir):
    """Validated before training and every 40 of its 80 steps on the same valid subset
    (tiny_spalm_xl.yaml): the kept step is the best score's, and the manifest and the report's
    table say which it is."""
    text = (workdir / "reports" / results["name"] / "results.md").read_text()
    for row in ROWS:
        training = read_manifest(Workdir(workdir).model(row))["training"]
        curve = training["valid_curve"]
        assert curve["metric"] == "val/ppl" and curve["steps"] == [0, 40, 80], curve
        best = curve["steps"][int(np.argmin(curve["scores"]))]
        assert training["kept_step"] == best and training["steps"] == 80
        assert results["training"][row]["kept_step"] == best
        assert f"| {best} / 80 |" in text


def test_kNN_LM_with_transformer_xl_is_the_ceiling_row_of_each_pair(results):
    """Transformer-XL interpolated with kNN-LM on the same segments, k fitted on valid and
    SPALM's k = 4, in the segments' table: retrieval adds to Transformer-XL on this slice."""
    for head in ("transformer_xl", "transformer_xl_scratch"):
        fitted, at_4 = f"{head}+knn", f"{head}+knn[k=4]"
        assert results["hparams"][at_4]["k"] == 4
        assert results["hparams"][fitted]["k"] in (8, 16, 32, 64)  # the pipeline's grid
        assert results["protocols"][fitted] == results["protocols"][head]
        for row in (fitted, at_4):
            assert results["ppl"][row] < results["ppl"][head], (row, results["ppl"])


def test_no_spalm_train_position_reads_a_value_from_inside_its_leakage_window(workdir):
    """Every train position SPALM is served (each once), with the values of its first
    ``retrieved`` neighbours: none of those neighbours has read the position's own target (a
    train key at p has read the targets of [p - C, p]), and each value is that neighbour's next
    token."""
    wd = Workdir(workdir)
    C = int(wd.features_manifest("train")["config"]["context"])
    data = SpalmDataModule(workdir=str(workdir), retrieved=16, block_size=64, batch_size=16)
    segments = data.segments("train", 16)
    ids = np.asarray(open_array(wd.neighbors("final", "cos", "train"), "ids"))[:, :16]
    targets = np.asarray(open_features(wd.features("train"))[1]["targets"])
    served, found_count = [], 0
    for i in range(len(segments)):
        item = segments[i]
        positions = item["positions"].numpy()
        scored = positions >= 0
        p, values = positions[scored], item["nbr_values"].numpy()[scored]
        nbr = ids[p].astype(np.int64)
        found = nbr >= 0
        ahead = nbr - p[:, None]
        assert not np.any(found & (ahead >= 0) & (ahead <= C))
        assert np.array_equal(values[found], targets[nbr[found]])
        assert np.all(values[~found] == -1)
        served.append(p)
        found_count += int(found.sum())
    served = np.sort(np.concatenate(served))
    assert np.array_equal(served, np.arange(data.train_covered))  # every position, once
    assert found_count > 0.9 * 16 * len(served)  # masking leaves most neighbours


def test_spalm_with_its_options_beats_transformer_xl_on_the_same_tokens(results):
    """Warm-started from the test LM for 80 steps, SPALM needs the memory scale (and the gate
    bias) to gain over Transformer-XL; the paper's form is its own row."""
    for ppl in (results["ppl"], results["valid_ppl"]):
        assert ppl["spalm_xl_variant"] < ppl["transformer_xl"], ppl


def test_each_row_is_labelled_with_its_options_and_scored_by_its_protocol(results, workdir):
    """The paper's SPALM is the default (no option named); the variant's label names both
    options; the segment rows are in their own table, each with its memory and left context."""
    assert "spalm_xl" not in results["deviations"]
    assert results["deviations"]["spalm_xl_variant"] == ["gate bias", "memory scale"]
    spalm = read_manifest(Workdir(workdir).model("spalm_xl"))["spalm"]
    assert (spalm["gate_bias"], spalm["memory_scale"]) == (None, "none")
    segments = {"kind": "segments", "segment": 64, "streams": 16}
    assert results["protocols"]["transformer"] == {**segments, "memory": 0}
    for row in ("transformer_xl", "spalm_xl", "spalm_xl_variant"):
        assert results["protocols"][row] == {**segments, "memory": 64}
    assert results["protocols"]["base"]["kind"] == "sliding_window"
    left = results["mean_left_context"]
    assert left["transformer"] < left["base"] < left["transformer_xl"] == left["spalm_xl"]
    text = (workdir / "reports" / results["name"] / "results.md").read_text()
    table = text.split("Scored as contiguous segments")[1].split("\n\n")[1]
    assert "| SPALM (short + long-term memory) (+gate bias, +memory scale) | 64 |" in table
    assert "| SPALM (short + long-term memory) | 64 |" in table
    assert "base LM" not in table


def test_spalm_analyses_are_in_the_report(results, workdir):
    wd = Workdir(workdir)
    analysis = results["spalm_xl_analysis"]
    for split in ("valid", "test"):
        hist = analysis["gate_histogram"][split]
        assert sum(hist["counts"]) == hist["tokens"] == wd.n_positions(split)  # tokens, not dims
        assert 0 < hist["mean"] < 1
    curve = analysis["k_curve"]
    assert curve["k"] == [1, 2, 4, 8, 16] and curve["trained_k"] == 4
    assert curve["tokens"] == wd.n_positions("valid")
    trained = curve["ppl"][curve["k"].index(4)]
    assert trained == pytest.approx(results["valid_ppl"]["spalm_xl"], rel=1e-3)
    buckets = analysis["frequency_buckets"]
    assert buckets["baseline"] == "transformer_xl"
    assert sum(r["tokens"] for r in buckets["rows"]) == results["tokens"]
    assert all({"gate_mean", "ppl", "baseline_ppl"} <= set(r) for r in buckets["rows"])
    report = workdir / "reports" / results["name"]
    assert (report / "spalm_xl_gate_hist.png").is_file()
    assert "number of neighbours" in (report / "results.md").read_text()
