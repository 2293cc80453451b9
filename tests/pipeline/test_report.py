"""The report: recall buckets (GNN-LM Table 4), the registry of report rows (names, labels,
order), and results.json/results.md written from the pipeline's ``Results``."""
from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest

from gnnlm.models import protocols
from gnnlm.pipeline.report_analyses import recall_buckets
from gnnlm.pipeline.results import KeyRetrieval, Results
from gnnlm.utils.provenance import code_version
from gnnlm.workdir import rows
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.refusals import rebuild_flag
from tests.fakes import write_features


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
    assert rows.label("base") == "base LM" and rows.label("gnn+knn") == "+GNN+kNN"
    assert rows.label("knn[att]") == "+kNN, att keys"
    assert rows.label("learned_wds") == "learned W_ds alone"
    assert rows.label("learned_wds+base") == "base LM + learned W_ds"
    assert rows.label("learned_wds[n=4]+base") == "base LM + learned W_ds (n = 4)"
    assert rows.label("something-new") == "something-new"
    assert rows.label("spalm_xl_variant", ["gate bias"]) == \
        "SPALM (short + long-term memory) (+gate bias)"


def test_a_row_carries_the_head_that_scored_it_and_that_head_s_model_folder():
    """What reads a report's rows (the report's protocols, ``gnnlm.load``) takes the head and
    its folder from the ``Row``; every name the pipeline makes gives its ``Row`` back."""
    made = {
        rows.BASE: (None, None, False), rows.knn_row("att", "final"): (None, None, True),
        rows.GNN: ("gnn", "gnn", False), rows.GNN_KNN: ("gnn", "gnn", True),
        rows.learned_wds_row(0, 1): ("learned_wds", "learned_wds", False),
        rows.learned_wds_row(1, 3): ("learned_wds[n=3]", "learned_wds_n3", False),
        rows.with_base(rows.learned_wds_row(1, 3)): ("learned_wds[n=3]", "learned_wds_n3", True),
        "spalm_xl_variant": ("spalm_xl_variant", "spalm_xl_variant", False),
        rows.with_knn("transformer_xl"): ("transformer_xl", "transformer_xl", True),
        rows.with_knn("transformer_xl_scratch", 4): ("transformer_xl_scratch",
                                                     "transformer_xl_scratch", True)}
    for name, (head, folder, interpolation) in made.items():
        row = rows.row(name)
        assert (row.name, row.head, row.folder, row.interpolation) == \
            (name, head, folder, interpolation), name
        assert row.on_base_lm == (head is None)
    for name in rows.HEAD_FIELDS:  # a trained row is its own head, in a folder of its name
        assert rows.row(name).trained and rows.row(name).head == rows.row(name).folder == name
    with pytest.raises(ValueError, match="'knn' is not a trained row"):
        rows.model_folder(rows.KNN)


def test_the_registry_orders_rows_and_names_the_config_s_head_fields():
    from gnnlm.pipeline.config import PipelineConfig

    names = ["learned_wds+base", "spalm_xl", "knn[ffn]", "gnn+knn", "learned_wds[n=3]", "knn",
             "base", "knn[att]", "transformer_xl", "learned_wds", "gnn", "spalm_ft", "spalm",
             "transformer_xl+knn[k=4]", "spalm_xl_scratch", "transformer_xl+knn",
             "transformer_xl_scratch"]
    # each Transformer-XL's ceiling rows right under it
    assert rows.order(names) == [
        "base", "knn", "knn[att]", "knn[ffn]", "gnn", "gnn+knn", "spalm", "spalm_ft",
        "transformer_xl", "transformer_xl+knn", "transformer_xl+knn[k=4]", "spalm_xl",
        "transformer_xl_scratch", "spalm_xl_scratch", "learned_wds", "learned_wds+base",
        "learned_wds[n=3]"]
    assert rows.label("transformer_xl_scratch+knn[k=4]") == \
        "Transformer-XL (from scratch) + kNN-LM (k = 4)"
    # every trained head is configured by the pipeline config's field of its name
    assert set(rows.HEAD_FIELDS) <= {f.name for f in fields(PipelineConfig)}
    assert set(PipelineConfig().heads()) <= set(rows.HEAD_FIELDS)
    assert [n for n in names if rows.row(n).interpolation] == [
        "learned_wds+base", "knn[ffn]", "gnn+knn", "knn", "knn[att]",
        "transformer_xl+knn[k=4]", "transformer_xl+knn"]
    assert rows.knn_row("final", "final") == "knn" and rows.knn_row("att", "final") == "knn[att]"
    assert rows.learned_wds_row(1, 3) == "learned_wds[n=3]"
    assert rows.model_folder("learned_wds[n=3]") == "learned_wds_n3"
    # and back: the folder of every trained row gives its row (what --rebuild names it by)
    for name in [*rows.HEAD_FIELDS, "learned_wds[n=3]"]:
        assert rows.of_folder(rows.model_folder(name)) == name
    assert rows.of_folder("base_lm") is None and rows.of_folder("gnn+knn") is None
    assert rebuild_flag("runs/x/models/learned_wds_n3", "trained_model") == \
        "--rebuild=[learned_wds[n=3]]"
    assert rebuild_flag("runs/x/models/base_lm", "trained_model") == "--rebuild=[base_lm]"
    assert rows.SPALM_BASELINES == {"spalm": "base", "spalm_ft": "base",
                                    "spalm_xl": "transformer_xl",
                                    "spalm_xl_variant": "transformer_xl",
                                    "spalm_xl_scratch": "transformer_xl_scratch"}


def test_the_report_names_the_base_lm_and_lists_k_in_numeric_order():
    from gnnlm.pipeline.report_markdown import markdown as _markdown

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
            "deviations": {"spalm_xl": ["gate bias", "memory scale"]},
            "training": {"spalm_xl": {"steps": 400, "kept_step": 300}}}


def test_rows_scored_differently_are_in_separate_tables_each_headed_by_its_protocol():
    """The segment models (cold-start streams, memory) and the sliding-window rows used to
    share one table under a header naming the sliding window for all of them."""
    from gnnlm.pipeline.report_markdown import markdown as _markdown

    text = _markdown(_segment_and_window_results())
    window, segments = text.split("Scored with sliding windows")[1].split("Scored as contiguous")
    assert window.startswith(" of 128 tokens, stride 64: every token scored once, with >= 64 "
                             "tokens of left context (mean 95.5 on test; all of it near the "
                             "split's start):")
    assert "| base LM |  | 369.60 |" in window and "| +kNN |  | 341.90 |" in window
    assert "transformer" not in window.lower()
    assert segments.startswith(" segments: the split cut into 16 streams, each read 128 tokens "
                               "at a time from a cold start; every token scored once:")
    assert "| model | memory M | mean left context | kept step / steps | valid ppl |" in segments
    assert "| transformer (no memory) | 0 | 63.5 |  |  | 366.80 |" in segments
    assert "| Transformer-XL (short-term memory) | 128 | 190.4 |  |  | 364.20 |" in segments
    # a deviation from the paper's equations is named in the row's label; the step whose
    # weights were kept, of those trained, where the head recorded it
    assert ("| SPALM (short + long-term memory) (+gate bias, +memory scale) | 128 | 190.4 | "
            "300 / 400 |  | 358.80 |") in segments


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
    from gnnlm.pipeline.report import _retrieval_facts
    from gnnlm.pipeline.report_markdown import _retrieval_line

    table = [{"nprobe": 4, "rerank": 1.0, "depth": 128, "recall@10": 0.93, "recall@100": 0.82,
              "recall@128": 0.8, "queries_per_s": 900.0, "gpu_ok": True},
             {"nprobe": 8, "rerank": 0.0, "depth": 128, "recall@10": 0.75, "recall@100": 0.7,
              "recall@128": 0.69, "queries_per_s": 2000.0, "gpu_ok": True}]
    index = {"factory": "IVF4096,SQ8", "nprobe": 4, "rerank": 1.0, "tuning": table,
             "recall": {"10": 0.93, "100": 0.82}}
    train = {"masked_fraction": 0.005, "leakage_window": 128}

    def line(**test) -> str:
        neighbours = {"test": {"K": 128, "queries_per_s": 1000.0, **test}, "train": train}
        return _retrieval_line("final", _retrieval_facts(KeyRetrieval(index, neighbours, {})))

    used = line(backend="index", factory="IVF4096,SQ8", nprobe=8, rerank=0.0)
    assert ("index IVF4096,SQ8, nprobe 8, re-ranking 0.0x, K = 128: recall@10 0.75, recall@100 "
            "0.7, recall@128 0.69 against exact search (searched 128 deep)") in used
    assert "0.93" not in used                     # never the index's own chosen setting's
    assert "recall of this setting not measured" in line(backend="index", factory="IVF4096,SQ8",
                                                         nprobe=16, rerank=2.0)
    exact = line(backend="exact", factory="exact", nprobe=None, rerank=None)
    assert "exact search, K = 128" in exact and "recall" not in exact
    assert "masked for leakage (W = 128): 0.005" in exact
    assert "index IVF4096,SQ8 built for ablations (approximate search)" in _retrieval_line(
        "final", _retrieval_facts(KeyRetrieval(index, {"test": {"K": 8, "backend": "exact"}},
                                               {}, "ablations (approximate search)")))
    screened = {"K": 8, "backend": "exact",
                "screen": {"float16": 900, "float32": 0, "widened": 40, "rescreened": 12,
                           "exhaustive": 1}}
    alone = _retrieval_line("final", _retrieval_facts(KeyRetrieval(None, {"test": screened}, {})))
    assert ("exact search, K = 8, screened in float16 (900 queries), 40 widened, 12 screened "
            "again in float32, 1 scored against every key; no index (nothing reads one)") in alone
    screened["screen"] = {"float16": 0, "float32": 900, "rescreened": 0, "exhaustive": 3}
    alone = _retrieval_line("final", _retrieval_facts(KeyRetrieval(None, {"test": screened}, {})))
    assert ("screened in float32 (900 queries), 0 widened, 3 scored against every key; "
            "no index") in alone
    train.update(leakage_window=None, masked_fraction=None)
    assert "not masked for leakage" in line(backend="exact", factory="exact")


def test_an_index_is_built_only_for_what_reads_it(in_repo):
    """Exact neighbours read no index; the ablations' approximate rows read the primary key's."""
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import index_use

    gpu = ["-c", "configs/wikitext2/pipeline.yaml"]
    assert [index_use(load_config(gpu), key) for key in ("final", "att")] == [None, None]
    analysis = load_config([*gpu, "-c", "configs/wikitext2/analysis.yaml"])
    assert [index_use(analysis, key) for key in ("final", "att")] == [
        "ablations (approximate search)", None]
    demo = load_config([*gpu, "-c", "configs/wikitext2/pipeline_cpu.yaml"])
    assert index_use(demo, "final") == "neighbours"


SIZES = {"train": 60, "valid": 30, "test": 40}


def _trained(wd: Workdir, name: str, gates: bool, **extra) -> dict:
    """A trained model's artifact; SPALM rows store their mean gate per token, per split."""
    rng = np.random.default_rng(len(name))
    builder = ArtifactBuilder(wd.model(name), kind="trained_model", config={"name": name})
    with builder:
        for split in ("valid", "test") if gates else ():
            builder.array(f"{split}_gate", np.float32, (SIZES[split],))[...] = rng.uniform(
                0, 1, SIZES[split])
        return builder.finish(extra=extra)


def _results(tmp_path) -> tuple[Workdir, Results]:
    """What the stages hand the report, made up: every kind of row, from memory (no kNN cache
    or PQ folder exists: the report must not read their manifests again)."""
    wd = Workdir(tmp_path / "work")
    rng = np.random.default_rng(0)
    features = {}
    for split, n in SIZES.items():
        manifest = write_features(wd.features(split), rng.standard_normal((n, 4)),
                                  targets=rng.integers(0, 20, n).astype(np.int32), split=split,
                                  vocab_size=20)
        manifest["config"].update(context=8, stride=4)
        features[split] = {**manifest, "protocol": "sliding windows", "seconds": 1.5}

    def logprob(split: str) -> np.ndarray:
        return np.log(rng.uniform(0.05, 0.6, SIZES[split])).astype(np.float32)

    xl = protocols.segments(8, 2, 8)
    heads = {"gnn": _trained(wd, "gnn", False, train_seconds=12.0, model_class="GNNLM",
                             training={"steps": 50, "max_steps": 50, "stopped_by": "max_steps",
                                       "resumed_from_steps": [40]},
                             eval_k={"chosen": 4, "valid_ppl": {"2": 9.0, "4": 8.0},
                                     "seconds": {"2": 0.5, "4": 0.75}},
                             metrics={"leakage/windows_dropped": 0.125, "train/loss": 3.0}),
             "spalm": _trained(wd, "spalm", True, train_seconds=4.0),
             "spalm_ft": _trained(wd, "spalm_ft", True, train_seconds=5.0),
             "transformer_xl": _trained(wd, "transformer_xl", False, protocol=xl),
             "spalm_xl": _trained(wd, "spalm_xl", True, protocol=xl,
                                  k_curve={"split": "valid", "trained_k": 4, "k": [1, 4],
                                           "tokens": SIZES["valid"], "ppl": [10.0, 9.0]}),
             "learned_wds": _trained(wd, "learned_wds", False, deviations=["made up"])}
    scores = {name: {s: logprob(s) for s in ("valid", "test")} for name in ["base", *heads]}
    hp = {"k": 4, "temperature": 1.0, "lambda": 0.25, "valid_ppl": 7.0, "test_ppl": 7.5}
    index = {"factory": "Flat", "train_seconds": 0.5, "add_seconds": 0.25}
    neighbours = {"test": {"K": 4, "backend": "exact", "search_seconds": 1.0},
                  "valid": {"K": 4, "search_seconds": 1.0}}
    results = Results(
        name="run", dataset="tiny", level="word",
        base_lm={"name": "gpt", "fingerprint": "abc", "vocab_size": 20, "hidden_size": 4},
        base_lm_manifest={"train_seconds": 9.0, "training": {
            "steps": 150, "max_steps": 2000, "stopped_by": "max_time", "resumed_from_steps": []}},
        features=features, scores=scores, heads=heads,
        retrieval={"final": KeyRetrieval(index, neighbours,
                                         {"valid": {"seconds": 0.25}, "test": {"seconds": 0.5}})},
        pq={"seconds": 3.0}, knn_recall=rng.integers(0, 5, SIZES["test"]),
        data_checks={"unk_token": "<unk>", "unk_share": {"train": 0.02, "valid": 0.03,
                                                          "test": 0.03},
                     "datastore_overlap": {"valid": 0.0, "test": 0.0},
                     "near_copy": {"key": "final", "metric": "cos", "context": 32}})
    for name in ("knn", "knn[att]", "gnn+knn"):
        results.add_interpolation(name, logprob("test"), {**hp, "key": "final"})
    results.add_interpolation("learned_wds+base", logprob("test"),
                              {"lambda": 0.3, "valid_ppl": 7.2})
    return wd, results


def test_the_report_reads_the_pipeline_s_results(tmp_path):
    from gnnlm.pipeline.report import write_report

    wd, results = _results(tmp_path)
    report = write_report(wd, results)
    out = wd.report("run")
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(report))
    assert list(report["ppl"]) == ["base", "knn", "knn[att]", "gnn", "gnn+knn", "spalm",
                                   "spalm_ft", "transformer_xl", "spalm_xl", "learned_wds",
                                   "learned_wds+base"]
    assert report["tokens"] == SIZES["test"] and report["level"] == "word"
    assert report["timing_s"] == {
        "base_lm": 9.0, "features": 4.5, "index[final]": 0.75, "neighbors[final]": 2.0,
        "knn_cache[final]": 0.75, "pq": 3.0, "gnn": 12.0, "spalm": 4.0, "spalm_ft": 5.0,
        "transformer_xl": 0.0, "spalm_xl": 0.0, "learned_wds": 0.0}
    assert report["knn_recall_buckets_model"] == "gnn+knn"
    assert sum(b["tokens"] for b in report["knn_recall_buckets"]) == SIZES["test"]
    assert report["gnn_leakage"] == {"windows_dropped": 0.125}
    assert report["deviations"] == {"learned_wds": ["made up"]}
    with np.load(out / "test_logprobs.npz") as saved:
        assert sorted(saved.files) == sorted(results.scores)


def test_the_report_says_which_code_wrote_it_and_which_trainings_were_not_one_run(tmp_path,
                                                                                  capsys):
    from gnnlm.pipeline.report import print_table, write_report

    wd, results = _results(tmp_path)
    report = write_report(wd, results)
    assert report["made_by"] == code_version()
    assert report["training_notes"] == [
        {"row": "base", "steps": 150, "max_steps": 2000, "stopped_by": "max_time",
         "resumed_from_steps": []},
        {"row": "gnn", "steps": 50, "max_steps": 50, "stopped_by": "max_steps",
         "resumed_from_steps": [40]}]
    said = ["base LM: stopped by max_time at step 150 of max_steps 2000",
            "+GNN: resumed from step 40"]
    markdown = (wd.report("run") / "results.md").read_text()
    assert "Not trained in one uninterrupted run:\n\n" + "".join(
        f"- {line}\n" for line in said) in markdown
    assert markdown.endswith(f"\nWritten by gnnlm {code_version()['gnnlm']}, commit "
                             f"{code_version()['commit'][:12]}"
                             f"{' with uncommitted changes' if code_version()['dirty'] else ''}"
                             f".\n")
    print_table(report, wd)
    assert "Not trained in one uninterrupted run:\n" + "".join(
        f"  {line}\n" for line in said) in capsys.readouterr().out


def test_every_spalm_row_gets_the_gate_per_token_analysis(tmp_path):
    """One gate histogram for every SPALM row, the frozen-LM ones (against the base LM) as SPALM
    end to end (against Transformer-XL): the tokens per bin of their mean gate, from the
    ``<split>_gate`` arrays in the model's folder; no per-dimension histogram."""
    from gnnlm.pipeline.report import write_report

    wd, results = _results(tmp_path)
    report = write_report(wd, results)
    out = wd.report("run")
    text = (out / "results.md").read_text()
    assert not {"spalm_gate", "spalm_ft_gate"} & set(report)
    for name, baseline in (("spalm", "base"), ("spalm_ft", "base"),
                           ("spalm_xl", "transformer_xl")):
        analysis = report[f"{name}_analysis"]
        for split in ("valid", "test"):
            hist = analysis["gate_histogram"][split]
            assert sum(hist["counts"]) == hist["tokens"] == SIZES[split]  # tokens, not dims
        assert analysis["frequency_buckets"]["baseline"] == baseline
        assert (out / f"{name}_gate_hist.png").is_file()
        assert f"{rows.label(name)} gate on test (tokens per bin of the mean gate" in text
    assert "spalm_xl_variant_analysis" not in report
    assert "number of neighbours" in text  # spalm_xl's k curve


def test_a_time_stop_of_a_run_bound_by_epochs_names_no_step_bound():
    """Rows trained for epochs (max_steps -1, as Lightning records it) stop by time at a step;
    there is no step bound to name."""
    from gnnlm.pipeline.report_tables import training_lines

    results = {"training_notes": [
        {"row": "base", "steps": 54, "max_steps": -1, "stopped_by": "max_time",
         "resumed_from_steps": []},
        {"row": "base", "steps": 150, "max_steps": 2000, "stopped_by": "max_time",
         "resumed_from_steps": []}]}
    assert training_lines(results) == ["base LM: stopped by max_time at step 54",
                                       "base LM: stopped by max_time at step 150 of max_steps "
                                       "2000"]


def test_a_diverged_training_is_noted_with_its_step_and_the_weights_kept():
    """A trained part whose val/ppl became NaN (``stopped_by`` "diverged") is listed under the
    trainings that were not one run to its end, saying where it diverged and which weights the
    report scores."""
    from gnnlm.pipeline.report import training_notes
    from gnnlm.pipeline.report_tables import training_lines

    diverged = {"steps": 8, "max_steps": 24, "stopped_by": "diverged",
                "resumed_from_steps": [], "kept_step": 0}
    stopped = {**diverged, "stopped_by": "early stopping"}
    results = Results(name="run", dataset="tiny", level="word", base_lm={},
                      base_lm_manifest={"training": stopped}, features={},
                      heads={"gnn": {"training": diverged}})
    notes = training_notes(results)
    assert notes == [{"row": "gnn", **diverged}]
    assert training_lines({"training_notes": notes}) == ["+GNN: diverged at step 8 (kept step 0)"]
