"""Reports: ``reports/<name>/results.json``, ``results.md``, per-token scores and plots.

Every perplexity is exp(−Σ log p / N) over the same N test tokens (the split's every position,
scored once), computed here from per-token log-probabilities, never averaged from batches. Each
row records how its tokens were scored (``gnnlm.models.protocols``): rows read with different
windows or segments go in separate tables, each headed by its protocol and the left context it
gives (a segments table also gives the step each trained row kept, of the steps it trained; the
manifests' valid curves are in results.json's ``training``). Above them, the data's checks
(``gnnlm.pipeline.data_checks``: unknown tokens, near-copies of valid/test in the datastore)
and, when something makes the numbers untrustworthy, one Warnings block. Under them, the trained
parts whose training was resumed or cut short by ``max_time``. Below those, the papers'
analyses: kNN recall buckets (Meng et al. 2022), GNN-LM's evaluation k, and for every SPALM row
the mean gate per token, its k curve and frequency buckets (Yogatama et al. 2021;
``gnnlm.spalm.analysis``). With the retrieval facts, how much retrieval discriminates per key
(``gnnlm.retrieval.sanity``): a datastore whose neighbours all score alike is warned of, since
its kNN-LM "gain" is smoothing, not retrieval.

Plots (``PLOTS``): per key, valid perplexity over λ × T at the fitted k (``gnnlm sweep``'s
heatmap); the recall buckets; each SPALM row's gate histogram; the ablations' curves.

With a subword tokenizer every row also has its perplexity per word beside per token
(``gnnlm.pipeline.per_word``), comparable with word-level rows.

Rows are named, labelled and ordered by ``gnnlm.workdir.rows``; everything is read from the
pipeline's ``gnnlm.pipeline.results.Results``, which holds the manifests its stages read.

Here: what results.json holds (every row's perplexities and how it was scored, the retrieval
behind the kNN rows, the stage times, the trainings that were not one run) and the stages' two
entries, ``write_report`` and ``print_table``. results.md is laid out by
``gnnlm.pipeline.report_markdown`` from the tables and lines it shares with the printed table
(``gnnlm.pipeline.report_tables``); the papers' analyses and their plots are
``gnnlm.pipeline.report_analyses``'s, the Warnings block ``gnnlm.pipeline.report_warnings``'s.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.pipeline import per_word
from gnnlm.pipeline.precision import row_precision
from gnnlm.pipeline.report_analyses import analyses, plot_recall_buckets, retrieval_sanity
from gnnlm.pipeline.report_markdown import markdown
from gnnlm.pipeline.report_tables import (
    data_line,
    ppl_cells,
    ppl_headers,
    protocol_tables,
    row_label,
    sanity_line,
    training_lines,
)
from gnnlm.pipeline.report_warnings import warnings_block
from gnnlm.pipeline.results import KeyRetrieval, Results
from gnnlm.retrieval.tuning import measured_recall
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.utils.provenance import code_version
from gnnlm.workdir import rows
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import write_json_atomic
from gnnlm.workdir.reports import seal

# the plots every report with a kNN row writes (``{key}``: each key type), beside the SPALM rows'
# ``<row>_gate_hist.png`` and the ablations' curves when those ran
PLOTS = ("knn_sweep_{key}.png", "knn_recall_buckets.png")


def write_report(workdir: Workdir, results: Results) -> dict:
    """``reports/<name>/``: results.json and results.md (the tables by protocol, the data's
    checks and warnings, the analyses, retrieval and build times), the per-token test scores
    and the plots. results.json is sealed (``gnnlm.workdir.reports``: the artifacts it was
    computed from, its own sha256). Returns results.json's dict."""
    out = workdir.report(results.name)
    out.mkdir(parents=True, exist_ok=True)
    test_n = results.test_tokens
    for name, per_split in results.scores.items():
        if len(per_split["test"]) != test_n:
            raise RuntimeError(f"{name} scored {len(per_split['test'])} test tokens, not {test_n}.")
    report = _tables(results)
    report["timing_s"] = _stage_seconds(results)
    if results.environment is not None:
        report["environment"] = results.environment
    report.update(results.data_checks)
    report["retrieval_sanity"] = retrieval_sanity(results, out)
    report["warnings"] = warnings_block(report, results.heads)
    report["training_notes"] = training_notes(results)
    report["made_by"] = code_version()
    if results.level == "char":
        report["bpc"] = {name: float(np.log2(p)) for name, p in report["ppl"].items()}
    report.update(analyses(workdir, results, out))
    if results.ablations:
        report["ablations"] = results.ablations
        for png in workdir.ablations.glob("*.png"):
            (out / png.name).write_bytes(png.read_bytes())
    if report.get("knn_recall_buckets"):
        plot_recall_buckets(out / "knn_recall_buckets.png", report["knn_recall_buckets"],
                             row_label(report, report["knn_recall_buckets_model"]))
    report["plots"] = sorted(p.name for p in out.glob("*.png"))
    test_scores: dict[str, Any] = {k: v["test"] for k, v in results.scores.items()}
    np.savez_compressed(out / "test_logprobs.npz", **test_scores)
    report = seal(report, workdir.root)  # what it was computed from, and its own sha256
    write_json_atomic(out / "results.json", report)
    (out / "results.md").write_text(markdown(report))
    return report


def _tables(results: Results) -> dict:
    """What the tables show: every row's test and valid perplexity, how it was scored (its
    protocol, mean left context and precision), its deviations from its paper, the fitted
    hyper-parameters, the base LM and the retrieval behind the kNN rows."""
    scores, heads, test_n = results.scores, results.heads, results.test_tokens
    names = rows.order(scores)
    valid_ppl = {name: ppl_from_logprobs(s["valid"]) for name, s in scores.items() if "valid" in s}
    valid_ppl.update({name: hp["valid_ppl"] for name, hp in results.hparams.items()
                      if "valid_ppl" in hp})
    # how many valid tokens each valid_ppl is over: a fitted one's as its fit recorded (-1: not
    # recorded, so not converted per word)
    valid_tokens = {name: len(s["valid"]) for name, s in scores.items() if "valid" in s}
    valid_tokens.update({name: results.fitted_on.get(name, -1) for name, hp in
                         results.hparams.items() if "valid_ppl" in hp})
    row_protocol = row_protocols(names, heads, protocols.of_features(results.features["test"]))
    ppl = {name: ppl_from_logprobs(scores[name]["test"]) for name in names}
    words = per_word.columns(results.level, ppl, valid_ppl, valid_tokens,
                             {"valid": int(results.features["valid"]["n"]), "test": test_n},
                             results.words) if results.words else {}
    return {
        "name": results.name, "dataset": results.dataset, "split": "test",
        "tokens": test_n, "protocol": results.features["test"]["protocol"],
        "protocols": row_protocol,
        # each row's scoring precision (a head's trainer precision), served the same way
        "precisions": {name: row_precision(name, heads) for name in names},
        "mean_left_context": {name: float(protocols.left_context(p, test_n).mean())
                              for name, p in row_protocol.items() if p["kind"] != "unrecorded"},
        "deviations": {name: heads[name]["deviations"] for name in names
                       if name in heads and heads[name].get("deviations")},
        # how each head's training went: its steps, the step it kept, its valid curve
        "training": {name: heads[name]["training"] for name in names
                     if name in heads and heads[name].get("training")},
        "level": results.level,
        "ppl": ppl, "valid_ppl": valid_ppl, **words,
        "hparams": results.hparams, "base_lm": results.base_lm,
        "retrieval": {key: _retrieval_facts(r) for key, r in results.retrieval.items()},
    }


def row_protocols(names: list[str], heads: dict, features: Protocol) -> dict[str, Protocol]:
    """The protocol of every row: a head's as its manifest records it; the datastore's sliding
    windows for the base LM and kNN-LM, and for an interpolation, its head's. A head trained
    before protocols were recorded reads the features, unless it is a segment model, whose
    protocol cannot be told after the fact."""
    def of_head(manifest: dict) -> Protocol:
        if "protocol" in manifest:
            return manifest["protocol"]
        if manifest.get("model_class") in ("SpalmXL", "LanguageModel"):
            return {"kind": "unrecorded",
                    "reason": "trained before protocols were recorded: rebuild this row"}
        return features

    protocol_of = {}
    for name in names:
        head = rows.row(name).head
        protocol_of[name] = of_head(heads[head]) if head in heads else features
    return protocol_of


def _retrieval_facts(r: KeyRetrieval) -> dict:
    """What results.json says of one key's retrieval: how the test neighbours were searched
    (exact search, or the index at their nprobe/re-ranking), the recall the index stage measured
    for exactly that setting against exact search (None: not measured), the neighbour stage's
    speed, the leakage masking."""
    index, test = r.index or {}, r.neighbors["test"]
    backend = test.get("backend", "index")
    facts = {"backend": backend, "factory": test.get("factory", index.get("factory")),
             "index_factory": index.get("factory"), "index_use": r.index_use,
             "nprobe": test.get("nprobe"), "rerank": test.get("rerank"), "K": test["K"],
             "recall": (None if backend == "exact" or not index else
                        measured_recall(index, test.get("nprobe"), test.get("rerank"),
                                        test["K"])),
             "target_recall": index.get("target_recall"),
             "queries_per_s": test.get("queries_per_s"), "search_settings": index.get("tuning"),
             "screen": test.get("screen")}
    train = r.neighbors.get("train")
    if train is not None:
        facts.update({"masked_fraction": train.get("masked_fraction"),
                      "leakage_window": train["leakage_window"]})
    return facts


def _stage_seconds(results: Results) -> dict:
    """Build time of each stage as recorded in its artifacts (stable across reruns)."""
    timing = {"base_lm": results.base_lm_manifest.get("train_seconds", 0.0),
              "features": sum(m.get("seconds", 0.0) for m in results.features.values())}
    for key, r in results.retrieval.items():
        if r.index is not None:
            timing[f"index[{key}]"] = r.index.get("train_seconds", 0) + r.index.get(
                "add_seconds", 0)
        timing[f"neighbors[{key}]"] = sum(m.get("search_seconds", 0)
                                          for m in r.neighbors.values())
        timing[f"knn_cache[{key}]"] = sum(m.get("seconds", 0) for m in r.knn_caches.values())
    if rows.GNN in results.heads and results.pq is not None:
        timing["pq"] = results.pq.get("seconds", 0)
    for name, manifest in results.heads.items():
        timing[name] = manifest.get("train_seconds", 0.0)
        if "predict_seconds" in manifest:  # scoring valid and test (and the eval-k curve)
            timing[f"{name} scoring"] = manifest["predict_seconds"]
    return {k: round(float(v), 2) for k, v in timing.items()}


def training_notes(results: Results) -> list[dict]:
    """The trained parts (the base LM trained here, the heads) whose training was not one run to
    its end: resumed after a stop (weights, optimiser and loop counters are restored, so the
    result is close to an uninterrupted run's, not equal to it), stopped by ``max_time``
    before ``max_steps``, or diverged. Each: the row and its manifest's ``training`` record."""
    parts = {rows.BASE: results.base_lm_manifest, **results.heads}
    notes = []
    for name, manifest in parts.items():
        training = manifest.get("training") or {}
        if training.get("resumed_from_steps") or training.get("stopped_by") in (
                "max_time", "diverged"):
            notes.append({"row": name, **training})
    return notes


def print_table(results: dict, workdir: Workdir) -> None:
    """The results tables on stdout, one per protocol, as ``gnnlm pipeline`` ends."""
    print(f"\n{results['dataset']}: test {results['tokens']:,} tokens, every one scored once "
          f"by every row")
    for protocol, names in protocol_tables(results):
        print(f"{protocols.describe(protocol, with_memory=protocol['kind'] != 'segments')}:")
        headers = ppl_headers(results)
        width = max(10, *(len(h) for h in headers))
        print(f"  {'model':<44} {'left ctx':>8} " + " ".join(f"{h:>{width}}" for h in headers))
        for name in names:
            left = results["mean_left_context"].get(name)
            print(f"  {row_label(results, name):<44} {'' if left is None else f'{left:.1f}':>8} "
                  + " ".join(f"{c:>{width}}" for c in ppl_cells(results, name)))
    if "ppl_per_word" in results:
        print(per_word.counted_line(results))
    if results.get("training_notes"):
        print("Not trained in one uninterrupted run:")
        for line in training_lines(results):
            print(f"  {line}")
    knn_rows = [(name, hp) for name, hp in results["hparams"].items() if "neighbours" in hp]
    if knn_rows:
        print("Retrieval:")
        for name, hp in knn_rows:
            print(f"  {row_label(results, name)}: {hp['neighbours']} + {hp['scores']} scores")
        for key, facts in (results.get("retrieval_sanity") or {}).items():
            print(f"  key {key}: {sanity_line(facts)}")
    if "unk_share" in results:
        print(data_line(results))
    if results.get("warnings"):
        print("Warnings:")
        for warning in results["warnings"]:
            print(f"  ⚠ {warning['message']}")
    print(f"written to {workdir.report(results['name'])}")
