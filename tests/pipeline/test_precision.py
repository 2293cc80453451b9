"""Each report row's scoring precision (``gnnlm.pipeline.precision``): a head's as its manifest
records it (older manifests: their config's trainer precision, else float32), float32 for the
base LM's rows, and the autocast that serves each the same way."""
from __future__ import annotations

import pytest
import torch

from gnnlm.pipeline.precision import FLOAT32, row_precision, scored_precision, served_in


def _manifest(recorded=None, trainer=None) -> dict:
    manifest: dict = {"config": {"values": {"trainer": trainer or {}}}}
    if recorded is not None:
        manifest["precision"] = recorded
    return manifest


def test_a_head_s_precision_is_its_record_else_its_config_s_else_float32():
    assert scored_precision(_manifest("bf16-mixed", {"precision": "32-true"})) == "bf16-mixed"
    # scored before the record: predict ran under the training run's trainer precision
    assert scored_precision(_manifest(trainer={"precision": "bf16-mixed"})) == "bf16-mixed"
    assert scored_precision(_manifest(trainer={"precision": None})) == FLOAT32
    assert scored_precision({}) == FLOAT32


def test_a_row_is_scored_in_its_head_s_precision_and_the_base_lm_s_rows_in_float32():
    heads = {"gnn": _manifest("bf16-mixed"), "learned_wds": _manifest("16-mixed")}
    assert {name: row_precision(name, heads) for name in
            ("base", "knn", "knn[att]", "gnn", "gnn+knn", "learned_wds+base")} == {
        "base": FLOAT32, "knn": FLOAT32, "knn[att]": FLOAT32, "gnn": "bf16-mixed",
        "gnn+knn": "bf16-mixed", "learned_wds+base": "16-mixed"}
    assert row_precision("spalm", heads) == FLOAT32  # no manifest given: float32


def test_served_in_autocasts_as_recorded_and_float32_turns_a_caller_s_autocast_off():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with served_in("bf16-mixed"):
        mixed = a @ b
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed, (a.bfloat16() @ b.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16), served_in(FLOAT32):
        full = a @ b
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, a @ b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^a row scored in precision 'bf16-true' cannot be "
                                         r"served the same way: train its head under one of "
                                         r"32-true, 32, 64-true, 64, bf16-mixed"):
        served_in("bf16-true")
