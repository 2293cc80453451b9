"""Report helpers: recall buckets (GNN-LM Table 4) and the names of report rows."""
from __future__ import annotations

import numpy as np
import pytest

from gnnlm.models import protocols
from gnnlm.pipeline.report import recall_buckets, row_name


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
    from gnnlm.pipeline.report import _markdown

    results = {
        "name": "run", "dataset": "corpus", "tokens": 1000, "protocol": "sliding window",
        "base_lm": {"name": "hf:gemma", "fingerprint": "abc", "vocab_size": 512,
                    "hidden_size": 32, "dtype": "bfloat16", "logit_softcap": 30.0,
                    "keys": {"final": "model.norm:output", "att": "model.layers.-1.mlp:input"}},
        "ppl": {"base": 10.0}, "valid_ppl": {"base": 11.0}, "hparams": {}, "retrieval": {},
        "protocols": {"base": {"kind": "sliding_window", "context": 64, "stride": 32}},
        "mean_left_context": {"base": 40.0},
        "timing_s": {},
        # as a head's manifest gives it back: JSON object keys are text, sorted as text
        "gnn_eval_k": {"chosen": 32, "valid_ppl": {"128": 9.0, "16": 8.0, "32": 7.0},
                       "seconds": {"128": 3.0, "16": 1.0, "32": 2.0}}}
    text = _markdown(results)
    assert ("Base LM: hf:gemma (weights abc, 512 outputs, width 32, bfloat16 weights; final at "
            "model.norm:output, att at model.layers.-1.mlp:input; logits soft-capped at 30).") \
        in text
    assert "| 16 | 8.00 | 1.0 |\n| 32 | 7.00 | 2.0 |\n| 128 | 9.00 | 3.0 |" in text


def _segment_and_window_results() -> dict:
    window = protocols.sliding_window(128, 64)
    xl = {"kind": "segments", "segment": 128, "streams": 16}
    return {"name": "run", "dataset": "corpus", "tokens": 245569,
            "base_lm": {"name": "gpt", "fingerprint": "abc", "vocab_size": 512,
                        "hidden_size": 32},
            "ppl": {"base": 369.6, "knn": 341.9, "transformer": 366.8,
                    "transformer_xl": 364.2, "spalm_xl": 358.8},
            "valid_ppl": {}, "hparams": {}, "retrieval": {}, "timing_s": {},
            "protocols": {"base": window, "knn": window, "transformer": {**xl, "memory": 0},
                          "transformer_xl": {**xl, "memory": 128},
                          "spalm_xl": {**xl, "memory": 128}},
            "mean_left_context": {"base": 95.5, "knn": 95.5, "transformer": 63.5,
                                  "transformer_xl": 190.4, "spalm_xl": 190.4},
            "deviations": {"spalm_xl": ["gate bias", "memory scale"]}}


def test_rows_scored_differently_are_in_separate_tables_each_headed_by_its_protocol():
    """The segment models (cold-start streams, memory) and the sliding-window rows used to
    share one table under a header naming the sliding window for all of them."""
    from gnnlm.pipeline.report import _markdown

    text = _markdown(_segment_and_window_results())
    window, segments = text.split("Scored with sliding windows")[1].split("Scored as contiguous")
    assert window.startswith(" of 128 tokens, stride 64: every token scored once, with >= 64 "
                             "tokens of left context (mean 95.5 on test; all of it near the "
                             "split's start):")
    assert "| base LM |  | 369.60 |" in window and "| +kNN |  | 341.90 |" in window
    assert "transformer" not in window.lower()
    assert segments.startswith(" segments: the split cut into 16 streams, each read 128 tokens "
                               "at a time from a cold start; every token scored once:")
    assert "| transformer (no memory) | 0 | 63.5 |  | 366.80 |" in segments
    assert "| Transformer-XL (short-term memory) | 128 | 190.4 |  | 364.20 |" in segments
    # a deviation from the paper's equations is named in the row's label
    assert ("| SPALM (short + long-term memory) (+gate bias, +memory scale) | 128 | 190.4 | "
            " | 358.80 |") in segments


def test_row_protocols_of_heads_interpolations_and_old_manifests():
    from gnnlm.pipeline.report import row_protocols

    window = protocols.sliding_window(128, 64)
    xl = protocols.segments(128, 16, 128)
    heads = {"gnn": {"model_class": "GNNLM"}, "spalm_xl": {"protocol": xl},
             "transformer_xl": {"model_class": "SpalmXL"}}
    rows = row_protocols(["base", "knn", "gnn", "gnn+knn", "spalm_xl", "transformer_xl"], heads,
                         window)
    assert rows["base"] == rows["knn"] == rows["gnn"] == rows["gnn+knn"] == window
    assert rows["spalm_xl"] == xl
    # a segment model trained before protocols were recorded is not assumed to be anything
    assert rows["transformer_xl"]["kind"] == "unrecorded"


def test_the_retrieval_line_gives_the_recall_of_the_setting_the_neighbours_used():
    """Not the index's tuned setting: the neighbours may have been searched exactly, or with
    another nprobe / re-ranking; and the recall at the neighbours' depth K, when measured."""
    from gnnlm.pipeline.report import _retrieval_facts, _retrieval_line

    table = [{"nprobe": 4, "rerank": 1.0, "depth": 128, "recall@10": 0.93, "recall@100": 0.82,
              "recall@128": 0.8, "queries_per_s": 900.0, "gpu_ok": True},
             {"nprobe": 8, "rerank": 0.0, "depth": 128, "recall@10": 0.75, "recall@100": 0.7,
              "recall@128": 0.69, "queries_per_s": 2000.0, "gpu_ok": True}]
    index = {"factory": "IVF4096,SQ8", "nprobe": 4, "rerank": 1.0, "tuning": table,
             "recall": {"10": 0.93, "100": 0.82}}
    train = {"masked_fraction": 0.005, "leakage_window": 128}

    def line(**test) -> str:
        neighbours = {"test": {"K": 128, "queries_per_s": 1000.0, **test}, "train": train}
        return _retrieval_line("final", _retrieval_facts({"index": index,
                                                          "neighbors": neighbours}))

    used = line(backend="index", factory="IVF4096,SQ8", nprobe=8, rerank=0.0)
    assert ("index IVF4096,SQ8, nprobe 8, re-ranking 0.0x, K = 128: recall@10 0.75, recall@100 "
            "0.7, recall@128 0.69 against exact search (searched 128 deep)") in used
    assert "0.93" not in used                     # never the index's own chosen setting's
    assert "recall of this setting not measured" in line(backend="index", factory="IVF4096,SQ8",
                                                         nprobe=16, rerank=2.0)
    exact = line(backend="exact", factory="exact", nprobe=None, rerank=None)
    assert "exact search, K = 128" in exact and "recall" not in exact
    assert "masked for leakage (W = 128): 0.005" in exact
    train.update(leakage_window=None, masked_fraction=None)
    assert "not masked for leakage" in line(backend="exact", factory="exact")
