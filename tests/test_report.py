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
