"""Report helpers: recall buckets (GNN-LM Table 4) and the names of report rows."""
from __future__ import annotations

import numpy as np
import pytest

from gnnlm.report import recall_buckets, row_name


def test_recall_buckets_never_split_a_recall_value():
    hits = np.array([0] * 45 + [1] * 10 + [2] * 20 + [7] * 25)
    base = -np.arange(100, dtype=float)
    rows = recall_buckets(hits, base, base + 1.0)
    ranges = [tuple(r["recall_range"]) for r in rows]
    assert ranges == [(0, 0), (1, 2), (7, 7)], ranges
    assert sum(r["tokens"] for r in rows) == 100
    assert rows[0]["base_logprob"] == pytest.approx(base[:45].mean())
    assert all(r["absolute_improvement"] == pytest.approx(1.0) for r in rows)
    spread = recall_buckets(np.arange(100), base, base, n_buckets=5)
    assert [r["tokens"] for r in spread] == [20] * 5


def test_recall_buckets_of_shuffled_tokens_average_the_right_tokens():
    rng = np.random.default_rng(0)
    hits = rng.integers(0, 30, 500)
    base, model = rng.normal(-4, 1, 500), rng.normal(-3.5, 1, 500)
    rows = recall_buckets(hits, base, model, n_buckets=4)
    for row in rows:
        lo, hi = row["recall_range"]
        part = (hits >= lo) & (hits <= hi)
        assert row["tokens"] == part.sum()
        assert row["base_logprob"] == pytest.approx(base[part].mean())
        assert row["model_logprob"] == pytest.approx(model[part].mean())
        assert row["relative_improvement"] == pytest.approx(
            (model[part].mean() - base[part].mean()) / abs(base[part].mean()))
    highs = [r["recall_range"][1] for r in rows]
    lows = [r["recall_range"][0] for r in rows]
    assert all(h < lo for h, lo in zip(highs, lows[1:]))           # disjoint, increasing


def test_row_names():
    assert row_name("base") == "base LM" and row_name("gnn+knn") == "+GNN+kNN"
    assert row_name("knn[att]") == "+kNN, att keys"
    assert row_name("learned_wds") == "learned W_ds alone"
    assert row_name("learned_wds+base") == "base LM + learned W_ds"
    assert row_name("learned_wds[n=4]+base") == "base LM + learned W_ds (n = 4)"
    assert row_name("something-new") == "something-new"


def test_the_report_names_the_base_lm_and_lists_k_in_numeric_order():
    from gnnlm.report import _markdown

    results = {
        "name": "run", "dataset": "corpus", "tokens": 1000, "protocol": "sliding window",
        "base_lm": {"name": "hf:gemma", "fingerprint": "abc", "vocab_size": 512,
                    "hidden_size": 32, "dtype": "bfloat16", "logit_softcap": 30.0,
                    "keys": {"final": "model.norm:output", "att": "model.layers.-1.mlp:input"}},
        "ppl": {"base": 10.0}, "valid_ppl": {"base": 11.0}, "hparams": {}, "retrieval": {},
        "timing_s": {},
        # as a head's manifest gives it back: JSON object keys are text, sorted as text
        "gnn_eval_k": {"chosen": 32, "valid_ppl": {"128": 9.0, "16": 8.0, "32": 7.0},
                       "seconds": {"128": 3.0, "16": 1.0, "32": 2.0}}}
    text = _markdown(results)
    assert ("Base LM: hf:gemma (weights abc, 512 outputs, width 32, bfloat16 weights; final at "
            "model.norm:output, att at model.layers.-1.mlp:input; logits soft-capped at 30).") \
        in text
    assert "| 16 | 8.00 | 1.0 |\n| 32 | 7.00 | 2.0 |\n| 128 | 9.00 | 3.0 |" in text
