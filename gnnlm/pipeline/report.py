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

Rows are named, labelled and ordered by ``gnnlm.pipeline.rows``; everything is read from the
pipeline's ``gnnlm.pipeline.results.Results``, which holds the manifests its stages read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.pipeline import data_checks, per_word, rows
from gnnlm.pipeline.precision import row_precision
from gnnlm.pipeline.results import KeyRetrieval, Results
from gnnlm.pipeline.sweep import write_heatmap
from gnnlm.retrieval import sanity
from gnnlm.retrieval.search import exhaustive_index
from gnnlm.retrieval.tuning import measured_recall
from gnnlm.spalm.analysis import markdown as spalm_markdown
from gnnlm.spalm.analysis import results_section as spalm_section
from gnnlm.utils import environment
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.utils.provenance import code_version
from gnnlm.workdir.artifacts import write_json_atomic
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.reports import seal

# the plots every report with a kNN row writes (``{key}``: each key type), beside the SPALM rows'
# ``<row>_gate_hist.png`` and the ablations' curves when those ran
PLOTS = ("knn_sweep_{key}.png", "knn_recall_buckets.png")


def recall_buckets(hits_count: np.ndarray, base: np.ndarray, model: np.ndarray,
                   n_buckets: int = 5) -> list[dict]:
    """GNN-LM Table 4: tokens split by kNN recall R(c_t) = #neighbours whose value is the target
    (eq. 6) into about equal-count buckets; mean log p of the base LM and of ``model`` per bucket.

    Tokens of equal recall always share a bucket (a bucket boundary moves up to the next change
    of recall), so the recall ranges are disjoint; with many ties there are fewer buckets."""
    order = np.argsort(hits_count, kind="stable")
    sorted_hits = hits_count[order]
    n = len(order)
    equal_count = np.rint(np.arange(1, n_buckets) * n / n_buckets).astype(np.int64)
    equal_count = equal_count[equal_count > 0]
    # each cut moves up to the first index whose recall differs from the one before it
    moved = np.searchsorted(sorted_hits, sorted_hits[equal_count - 1], side="right")
    cuts = np.unique(np.concatenate([[0], moved[moved < n], [n]]))
    buckets = []
    for start, stop in zip(cuts[:-1], cuts[1:]):
        part = order[start:stop]
        b, m = float(base[part].mean()), float(model[part].mean())
        buckets.append({"recall_range": [int(sorted_hits[start]), int(sorted_hits[stop - 1])],
                        "tokens": int(len(part)), "base_logprob": b, "model_logprob": m,
                        "absolute_improvement": m - b,
                        "relative_improvement": (m - b) / abs(b) if b else 0.0})
    return buckets


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


def _screen_clause(screen: Optional[dict]) -> str:
    """How an exact search of the test queries screened (``gnnlm.retrieval.exact``)."""
    if not screen:
        return ""
    precisions = " and ".join(f"{name} ({screen[name]:,} queries)"
                              for name in ("float16", "float32") if screen.get(name))
    again = (f"{screen.get('rescreened', 0):,} screened again in float32, "
             if screen.get("float16") else "")
    return (f", screened in {precisions or 'no precision recorded'}, {again}"
            f"{screen.get('exhaustive', 0):,} scored against every key")


def _retrieval_line(key: str, info: dict) -> str:
    if info["backend"] == "exact":
        searched = f"exact search, K = {info['K']:,}{_screen_clause(info.get('screen'))}; "
        searched += (f"index {info['index_factory']} built for {info['index_use']}"
                     if info.get("index_factory") and info.get("index_use")
                     else "no index (nothing reads one)")
    elif exhaustive_index(info["factory"]):  # every key scored: what it measured is ties
        measured = info["recall"]
        searched = (f"exact neighbours (index {info['factory']}: every key scored), "
                    f"K = {info['K']:,}")
        if measured is not None:
            values = [v for v in (measured["recall@10"], measured["recall@100"],
                                  measured["recall@K"]) if v is not None]
            searched += (f"; the same top 10/100/K as a second exact search for "
                         f"{'/'.join(str(v) for v in values)} of neighbours (the rest tie "
                         f"within float rounding)")
    else:
        measured = info["recall"]
        searched = (f"index {info['factory']}, nprobe {info['nprobe']}, re-ranking "
                    f"{info['rerank']}x, K = {info['K']:,}: ")
        if measured is None:
            searched += "recall of this setting not measured"
        else:
            values = [(f"recall@{at}", measured[f"recall@{name}"])
                      for at, name in ((10, 10), (100, 100), (info["K"], "K"))]
            searched += ", ".join(f"{name} {'not measured' if v is None else v}"
                                  for name, v in dict(values).items())
            searched += f" against exact search (searched {measured['depth']} deep)"
    if "leakage_window" not in info:
        masked = ""
    elif not info["leakage_window"]:
        masked = "; train neighbours not masked for leakage (neighbors.leakage_window 0)"
    else:
        masked = (f"; train neighbours masked for leakage (W = {info['leakage_window']}): "
                  f"{info['masked_fraction']:.3f}")
    return (f"- key {key}: {searched}; neighbour search {info.get('queries_per_s')} "
            f"queries/s{masked}")


def base_lm_line(identity: dict) -> str:
    """The frozen base LM: its name, weights, and for a Hugging Face model the precision and the
    module paths its features were read at."""
    line = (f"{identity['name']} (weights {identity['fingerprint']}, {identity['vocab_size']:,} "
            f"outputs, width {identity['hidden_size']}")
    if identity.get("keys"):
        keys = ", ".join(f"{key} at {path}" for key, path in identity["keys"].items())
        line += f", {identity.get('dtype', 'float32')} weights; {keys}"
    if identity.get("logit_scale"):
        line += f"; logits scaled by {identity['logit_scale']:g}"
    if identity.get("logit_softcap"):
        line += f"; logits soft-capped at {identity['logit_softcap']:g}"
    return line + ")"


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


def protocol_tables(results: dict) -> list[tuple[Protocol, list[str]]]:
    """The rows grouped by layout (``gnnlm.models.protocols.layout``), in table order."""
    groups: dict[tuple, tuple[Protocol, list[str]]] = {}
    for name in results["ppl"]:
        protocol = results["protocols"][name]
        groups.setdefault(protocols.layout(protocol), (protocol, []))[1].append(name)
    return list(groups.values())


def _label(results: dict, name: str) -> str:
    return rows.label(name, results.get("deviations", {}).get(name))


def _ppl_headers(results: dict) -> list[str]:
    """The perplexity columns: valid and test, and for a subword tokenizer each per token and
    per word (``gnnlm.pipeline.per_word``)."""
    if "ppl_per_word" not in results:
        return ["valid ppl", "test ppl"]
    return ["valid ppl / token", "test ppl / token", "valid ppl / word", "test ppl / word"]


def _ppl_cells(results: dict, name: str) -> list[str]:
    """``name``'s perplexities in ``_ppl_headers``' order; empty where a row has none."""
    values = [results["valid_ppl"].get(name), results["ppl"][name]]
    if "ppl_per_word" in results:
        values += [results["valid_ppl_per_word"].get(name), results["ppl_per_word"].get(name)]
    return ["" if v is None else f"{v:.2f}" for v in values]


def _table_markdown(results: dict, protocol: Protocol, names: list[str]) -> list[str]:
    left = results["mean_left_context"]
    headers = _ppl_headers(results)
    if protocol["kind"] == "segments":
        lines = [f"Scored as {protocols.describe(protocol, with_memory=False)}:", "",
                 "| model | memory M | mean left context | kept step / steps | "
                 + " | ".join(headers) + " |",
                 "|---|---:|---:|---:|" + "---:|" * len(headers)]
        for name in names:
            lines.append(f"| {_label(results, name)} | {results['protocols'][name]['memory']} | "
                         f"{left[name]:.1f} | {_kept_step(results, name)} | "
                         + " | ".join(_ppl_cells(results, name)) + " |")
        return lines
    lines = [f"Scored with {protocols.describe(protocol, mean_left_context=left.get(names[0]))}:",
             "",
             "| model | " + " | ".join(headers) + " |", "|---|" + "---:|" * len(headers)]
    for name in names:
        lines.append(f"| {_label(results, name)} | " + " | ".join(_ppl_cells(results, name))
                     + " |")
    return lines


def _kept_step(results: dict, name: str) -> str:
    """The step whose weights scored a trained row, of the steps it trained (its head's, for
    an interpolation); 0 is the starting weights."""
    training = results.get("training", {}).get(rows.row(name).head or "")
    if not training or "kept_step" not in training:
        return ""
    return f"{training['kept_step']} / {training['steps']}"


def data_line(results: dict) -> str:
    """The share of each split unknown to the vocabulary and of valid/test that retrieves a
    near-copy of its own text from the datastore (``gnnlm.pipeline.data_checks``)."""
    def shares(values: dict) -> str:
        return ", ".join(f"{split} {data_checks.percent(v)}" for split, v in values.items()
                         if v is not None)

    unk = results["unk_share"]
    if all(v is None for v in unk.values()):
        line = "Data: the tokenizer has no unknown token"
    else:
        line = (f"Data: tokens unknown to the vocabulary (`{results.get('unk_token')}`): "
                f"{shares(unk)}")
    overlap = results.get("datastore_overlap") or {}
    if any(v is not None for v in overlap.values()):
        near = results.get("near_copy", {})
        line += (f"; positions whose nearest train key is a near-copy (the "
                 f"{near.get('context', data_checks.DEFAULT_NEAR_COPY_CONTEXT)} tokens before "
                 f"both equal): {shares(overlap)}")
    return line + "."


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


def training_lines(results: dict) -> list[str]:
    """One line per ``training_notes`` entry of a report."""
    lines = []
    for note in results.get("training_notes") or []:
        said = []
        if note.get("resumed_from_steps"):
            said.append("resumed from step " + ", ".join(map(str, note["resumed_from_steps"])))
        if note.get("stopped_by") == "max_time":
            bound = note.get("max_steps", -1)  # -1: bound by epochs, not steps
            said.append(f"stopped by max_time at step {note['steps']}"
                        + (f" of max_steps {bound}" if bound > 0 else ""))
        if note.get("stopped_by") == "diverged":  # its validation metric became NaN or inf
            said.append(f"diverged at step {note['steps']} (kept step {note.get('kept_step')})")
        lines.append(f"{_label(results, note['row'])}: {'; '.join(said)}")
    return lines


def made_by_line(made_by: dict) -> str:
    """The code a report or an artifact came from, in words."""
    line = f"gnnlm {made_by.get('gnnlm')}"
    if made_by.get("commit"):
        line += (f", commit {made_by['commit'][:12]}"
                 f"{' with uncommitted changes' if made_by.get('dirty') else ''}")
    return line


def _markdown(results: dict) -> str:
    # a run named after its corpus (one's own corpus, by default) says the name once
    heading = results["name"] + ("" if results["dataset"] == results["name"]
                                 else f": {results['dataset']}")
    lines = [f"# {heading}", "",
             f"Test tokens: {results['tokens']:,}, every one scored once by every row; rows "
             f"read with different windows or segments are in separate tables.", ""]
    if "unk_share" in results:
        lines += [data_line(results), ""]
    if results.get("warnings"):
        lines += ["Warnings:", ""] + [f"- ⚠ {w['message']}" for w in results["warnings"]]
        lines += [""]
    lines += [f"Base LM: {base_lm_line(results['base_lm'])}.", ""]
    for protocol, names in protocol_tables(results):
        lines += _table_markdown(results, protocol, names) + [""]
    if "ppl_per_word" in results:
        lines += [per_word.counted_line(results), ""]
    if results.get("training_notes"):
        lines += ["Not trained in one uninterrupted run:", ""]
        lines += [f"- {line}" for line in training_lines(results)] + [""]
    lines.pop()
    lines += ["", "Interpolation hyper-parameters (fitted on valid):", ""]
    for name, hp in results["hparams"].items():
        shown = {k: v for k, v in hp.items() if k not in ("valid_ppl", "test_ppl")}
        lines.append(f"- {_label(results, name)}: " + ", ".join(f"{k}={v}" for k, v in
                                                                          shown.items()))
    if results.get("knn_recall_buckets"):
        lines += ["", f"kNN recall buckets (GNN-LM Table 4; mean log p, "
                      f"{results['knn_recall_buckets_model']} vs base):", "",
                  "| recall range | tokens | base | model | abs. | rel. |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in results["knn_recall_buckets"]:
            lines.append(f"| [{r['recall_range'][0]}, {r['recall_range'][1]}] | {r['tokens']} | "
                         f"{r['base_logprob']:.2f} | {r['model_logprob']:.2f} | "
                         f"{r['absolute_improvement']:.2f} | {r['relative_improvement']:.0%} |")
    if results.get("gnn_eval_k"):
        curve = results["gnn_eval_k"]
        lines += ["", f"GNN-LM valid ppl by the number of windows each token reads at "
                      f"evaluation (chosen: k = {curve['chosen']}, reported on test):", "",
                  "| k | valid ppl | seconds |", "|---:|---:|---:|"]
        lines += [f"| {k} | {curve['valid_ppl'][k]:.2f} | {curve['seconds'][k]} |"
                  for k in sorted(curve["valid_ppl"], key=int)]  # JSON gives keys as text
    for name in rows.SPALM_BASELINES:  # SPALM §5: gates (valid, test), k curve, frequencies
        lines += spalm_markdown(results.get(f"{name}_analysis"), _label(results, name))
    lines += _ablation_markdown(results.get("ablations"))
    lines += ["", "Retrieval:", ""]
    lines += [_retrieval_line(key, info) for key, info in results["retrieval"].items()]
    lines += [f"- key {key}: {sanity_line(facts)}"
              for key, facts in (results.get("retrieval_sanity") or {}).items()]
    if results.get("gnn_leakage"):
        lines.append("- GNN-LM train graphs, leakage rule: " + ", ".join(
            f"{name.replace('_', ' ')} {value:.4f}" for name, value in
            results["gnn_leakage"].items()))
    lines += ["", "Stage build times (s): " + ", ".join(f"{k} {v}" for k, v in
                                                         results["timing_s"].items())]
    if results.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in results["plots"]) + "."]
    if results.get("environment"):
        lines += ["", f"Report written on: {environment.one_line(results['environment'])}."]
    if results.get("made_by"):
        lines += ["", f"Written by {made_by_line(results['made_by'])}."]
    lines.append("")
    return "\n".join(lines)


def _ablation_markdown(ablations: Optional[dict]) -> list[str]:
    if not ablations:
        return []
    lines = []
    if "rows" in ablations:
        n = ablations["tokens"]
        lines += ["", f"Ablations (Xu et al.; first {n['test']:,} test / {n['valid']:,} valid "
                      f"tokens, k/T/λ fitted on valid):", "",
                  "| variant | k | T | λ | valid ppl | test ppl |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in ablations["rows"]:
            lines.append(f"| {r['row']} | {r.get('k', '')} | {r.get('temperature', '')} | "
                         f"{r.get('lambda', '')} | {r['valid_ppl']:.2f} | {r['test_ppl']:.2f} |")
        if ablations.get("skipped"):  # rows that would repeat one above, and why
            lines += [""] + [f"Not a separate row: {r['row']} ({r['why']})."
                             for r in ablations["skipped"]]
        lines += ["", "Temperature (k, λ fitted on valid per T): " + ", ".join(
            f"T={r['temperature']:g}: {r['test_ppl']:.2f}" for r in ablations["temperature_curve"])]
        lines += ["", "Datastore subsampling (exact search): " + ", ".join(
            f"{r['fraction']:.0%}: {r['test_ppl']:.2f}" for r in ablations["subsample_curve"])]
    if "memory" in ablations:
        memory = ablations["memory"]
        protocol = memory[0].get("protocol")
        scored = (protocols.describe(protocol, with_memory=False) if protocol else
                  f"contiguous segments of {memory[0]['segment']} tokens")
        lines += ["", f"Short-term memory (Transformer-XL), scored as {scored}:", "",
                  "| model | mean left context | test tokens | test ppl |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['row']} | {r.get('mean_left_context', float('nan')):.1f} | "
                  f"{r['tokens']:,} | {r['test_ppl']:.2f} |" for r in memory]
    return lines


def sanity_line(facts: dict) -> str:
    """How much one key's retrieval discriminates (``gnnlm.retrieval.sanity``), in words."""
    if not facts["queries"]:
        return "no valid query has k neighbours: retrieval's spread not measured"
    k, K = facts["k"], facts["K"]
    line = (f"median similarity spread (top-1 minus top-k) of a valid query's top {k} (fitted "
            f"k) {facts['spread_at_k']:.2e}")
    if K != k:
        line += f", of its top {K} {facts['spread_at_K']:.2e}"
    line += (f"; {data_checks.percent(facts['flat_share'])} of queries with their top {k} "
             f"within {facts['flat_tolerance']:.0e}")
    if facts["temperature_effect"] is not None:
        line += (f"; T changes valid ppl by {data_checks.percent(facts['temperature_effect'])} "
                 f"across the grid")
    if facts["temperature_on_grid_edge"]:
        line += f" (fitted T = {facts['temperature']:g}, on the grid's edge)"
    return line + (" — degenerate" if facts["degenerate"] else "")


def rows_on_the_base_lm(names: list[str], heads: dict, row_protocol: dict) -> list[str]:
    """The rows that stand for a trained head on the base LM's features, read the base LM's way,
    and so should beat it on valid: the head's own row, or ``<head>+base`` where the report
    interpolates the head with the base LM (a learned W_ds is a datastore, not a whole LM).
    Segment models are separate LMs, not heads, and are not compared with the base LM."""
    base = protocols.layout(row_protocol["base"])
    return [rows.with_base(name) if rows.with_base(name) in names else name for name in names
            if name in heads and protocols.layout(row_protocol[name]) == base]


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
    report["retrieval_sanity"] = _retrieval_sanity(results, out)
    report["warnings"] = _warnings(report, results.heads)
    report["training_notes"] = training_notes(results)
    report["made_by"] = code_version()
    if results.level == "char":
        report["bpc"] = {name: float(np.log2(p)) for name, p in report["ppl"].items()}
    report.update(_analyses(workdir, results, out))
    if results.ablations:
        report["ablations"] = results.ablations
        for png in workdir.ablations.glob("*.png"):
            (out / png.name).write_bytes(png.read_bytes())
    if report.get("knn_recall_buckets"):
        _plot_recall_buckets(out / "knn_recall_buckets.png", report["knn_recall_buckets"],
                             _label(report, report["knn_recall_buckets_model"]))
    report["plots"] = sorted(p.name for p in out.glob("*.png"))
    test_scores: dict[str, Any] = {k: v["test"] for k, v in results.scores.items()}
    np.savez_compressed(out / "test_logprobs.npz", **test_scores)
    report = seal(report, workdir.root)  # what it was computed from, and its own sha256
    write_json_atomic(out / "results.json", report)
    (out / "results.md").write_text(_markdown(report))
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


def _warnings(report: dict, heads: dict) -> list[dict]:
    """The Warnings block: the data's checks, heads worse than the base LM on valid, and keys
    whose retrieval does not discriminate."""
    worse = data_checks.heads_worse_than_base(
        report["valid_ppl"], rows_on_the_base_lm(list(report["ppl"]), heads, report["protocols"]))
    found = data_checks.report_warnings(
        report["unk_share"], report["datastore_overlap"], worse,
        label=lambda name: _label(report, name), unk_token=report["unk_token"],
        context=report["near_copy"]["context"])
    return found + [sanity.warning(key, facts, _label(report, facts["row"]))
                    for key, facts in report.get("retrieval_sanity", {}).items()
                    if facts["degenerate"]]


def _retrieval_sanity(results: Results, out: Path) -> dict:
    """Per key with a kNN-LM row: how much its retrieval discriminates on valid at the fitted
    (k, T, λ) (``gnnlm.retrieval.sanity``; ``row``: that kNN-LM row), and ``knn_sweep_<key>.png``,
    valid perplexity over λ × T at the fitted k with the fitted point starred."""
    facts = {}
    base_valid_ppl = ppl_from_logprobs(results.scores[rows.BASE]["valid"])
    for key, measured in results.retrieval_sanity.items():
        row = next(name for name, hp in results.hparams.items()
                   if hp.get("key") == key and name != rows.GNN_KNN)
        facts[key] = {**measured.facts, "row": row}
        ts, lams = measured.temperatures, measured.lambdas
        best = (int(np.argmin(np.abs(np.subtract(ts, measured.facts["temperature"])))),
                int(np.argmin(np.abs(np.subtract(lams, measured.facts["lambda"])))))
        write_heatmap(out / f"knn_sweep_{key}.png", measured.valid_grid, ts, lams,
                      measured.facts["k"], best, base_valid_ppl)
    return facts


def _plot_recall_buckets(path: Path, buckets: list[dict], model: str) -> None:
    """GNN-LM Table 4 as bars: mean log p of the target per recall bucket, base LM and
    ``model``."""
    # The object API with an Agg canvas, as ``gnnlm.pipeline.sweep.write_heatmap``.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    at = np.arange(len(buckets))
    ax.bar(at - 0.2, [b["base_logprob"] for b in buckets], width=0.4, label="base LM")
    ax.bar(at + 0.2, [b["model_logprob"] for b in buckets], width=0.4, label=model)
    ax.set_xticks(at, [f"[{b['recall_range'][0]}, {b['recall_range'][1]}]\n"
                       f"{b['tokens']:,} tokens" for b in buckets])
    ax.set_xlabel("neighbours whose value is the target (recall R(c_t))")
    ax.set_ylabel("mean log p(target), test")
    ax.set_title("kNN recall buckets (GNN-LM Table 4)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _analyses(workdir: Workdir, results: Results, out: Path) -> dict:
    """The papers' analyses: kNN recall buckets (Meng et al. 2022 Table 4), GNN-LM's valid
    perplexity by evaluation k and its leakage rule's shares, and for every SPALM row its gate
    histograms, k curve and frequency buckets (Yogatama et al. 2021 §5, plotted into ``out``)."""
    scores, heads = results.scores, results.heads
    best = rows.GNN_KNN if rows.GNN_KNN in scores else rows.KNN
    analyses: dict = {}
    if results.knn_recall is not None:
        analyses["knn_recall_buckets"] = recall_buckets(
            results.knn_recall, scores[rows.BASE]["test"], scores[best]["test"])
        analyses["knn_recall_buckets_model"] = best
    gnn = heads.get(rows.GNN)
    if gnn is not None and "eval_k" in gnn:  # valid ppl by the windows read per token
        analyses["gnn_eval_k"] = gnn["eval_k"]
    if gnn is not None:  # the leakage rule's share of train-graph windows and nodes
        analyses["gnn_leakage"] = {name.split("/")[1]: value
                                   for name, value in gnn.get("metrics", {}).items()
                                   if name.startswith("leakage/")}
    for name, baseline in rows.SPALM_BASELINES.items():
        if name in heads:
            analyses[f"{name}_analysis"] = spalm_section(workdir, heads[name], scores, baseline,
                                                         plot=out / f"{name}_gate_hist.png")
    return analyses


def print_table(results: dict, workdir: Workdir) -> None:
    """The results tables on stdout, one per protocol, as ``gnnlm pipeline`` ends."""
    print(f"\n{results['dataset']}: test {results['tokens']:,} tokens, every one scored once "
          f"by every row")
    for protocol, names in protocol_tables(results):
        print(f"{protocols.describe(protocol, with_memory=protocol['kind'] != 'segments')}:")
        headers = _ppl_headers(results)
        width = max(10, *(len(h) for h in headers))
        print(f"  {'model':<44} {'left ctx':>8} " + " ".join(f"{h:>{width}}" for h in headers))
        for name in names:
            left = results["mean_left_context"].get(name)
            print(f"  {_label(results, name):<44} {'' if left is None else f'{left:.1f}':>8} "
                  + " ".join(f"{c:>{width}}" for c in _ppl_cells(results, name)))
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
            print(f"  {_label(results, name)}: {hp['neighbours']} + {hp['scores']} scores")
        for key, facts in (results.get("retrieval_sanity") or {}).items():
            print(f"  key {key}: {sanity_line(facts)}")
    if "unk_share" in results:
        print(data_line(results))
    if results.get("warnings"):
        print("Warnings:")
        for warning in results["warnings"]:
            print(f"  ⚠ {warning['message']}")
    print(f"written to {workdir.report(results['name'])}")
