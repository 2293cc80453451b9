"""Integration on the WikiText-2 slice of ``configs/tests/pipeline.yaml``: SPALM trained end to
end (the paper's form, and with its two options) against the transformer and Transformer-XL
trained the same way, each scoring the same test tokens once on contiguous segments, and
SPALM's analyses in the report."""
from __future__ import annotations

import numpy as np
import pytest

from gnnlm.workdir.artifacts import open_array, read_manifest
from gnnlm.workdir.layout import Workdir

pytestmark = pytest.mark.integration

ROWS = ("transformer", "transformer_xl", "spalm_xl", "spalm_xl_variant")


def test_the_four_rows_score_every_token_of_the_same_splits(results, workdir):
    wd = Workdir(workdir)
    assert set(ROWS) <= set(results["ppl"]) and set(ROWS) <= set(results["valid_ppl"])
    for row in ROWS:
        for split in ("valid", "test"):
            logprob = np.asarray(open_array(wd.model(row), f"{split}_logprob"))
            assert len(logprob) == wd.n_positions(split) and np.all(logprob <= 0)
    assert read_manifest(wd.model("spalm_xl"))["spalm"]["k"] == 16  # spalm_xl_cpu.yaml
    assert read_manifest(wd.model("transformer_xl"))["model_class"] == "SpalmXL"


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
    assert curve["k"] == [1, 2, 4, 8, 16] and curve["trained_k"] == 16
    assert curve["tokens"] == wd.n_positions("valid")
    trained = curve["ppl"][curve["k"].index(16)]
    assert trained == pytest.approx(results["valid_ppl"]["spalm_xl"], rel=1e-3)
    buckets = analysis["frequency_buckets"]
    assert buckets["baseline"] == "transformer_xl"
    assert sum(r["tokens"] for r in buckets["rows"]) == results["tokens"]
    assert all({"gate_mean", "ppl", "baseline_ppl"} <= set(r) for r in buckets["rows"])
    report = workdir / "reports" / results["name"]
    assert (report / "spalm_xl_gate_hist.png").is_file()
    assert "number of neighbours" in (report / "results.md").read_text()
