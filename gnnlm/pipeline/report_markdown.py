"""results.md: the report in markdown, from results.json's dict. The data's checks, the Warnings
block and the base LM above the tables (one per protocol; a segments table also gives each row's
memory and the step it kept); under them the fitted hyper-parameters, the papers' analyses, the
ablations, the retrieval behind each key, the stage times, the plots and the code that wrote it.
The rows' labels, cells and lines it shares with the printed table are
``gnnlm.pipeline.report_tables``'s."""
from __future__ import annotations

from typing import Optional

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.pipeline import per_word
from gnnlm.pipeline.report_tables import (
    data_line,
    ppl_cells,
    ppl_headers,
    protocol_tables,
    row_label,
    sanity_line,
    training_lines,
)
from gnnlm.retrieval.search import exhaustive_index
from gnnlm.spalm.analysis import markdown as spalm_markdown
from gnnlm.utils import environment
from gnnlm.workdir import rows


def markdown(results: dict) -> str:
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
        lines.append(f"- {row_label(results, name)}: " + ", ".join(f"{k}={v}" for k, v in
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
        lines += spalm_markdown(results.get(f"{name}_analysis"), row_label(results, name))
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


def _table_markdown(results: dict, protocol: Protocol, names: list[str]) -> list[str]:
    left = results["mean_left_context"]
    headers = ppl_headers(results)
    if protocol["kind"] == "segments":
        lines = [f"Scored as {protocols.describe(protocol, with_memory=False)}:", "",
                 "| model | memory M | mean left context | kept step / steps | "
                 + " | ".join(headers) + " |",
                 "|---|---:|---:|---:|" + "---:|" * len(headers)]
        for name in names:
            lines.append(f"| {row_label(results, name)} | {results['protocols'][name]['memory']} | "
                         f"{left[name]:.1f} | {_kept_step(results, name)} | "
                         + " | ".join(ppl_cells(results, name)) + " |")
        return lines
    lines = [f"Scored with {protocols.describe(protocol, mean_left_context=left.get(names[0]))}:",
             "",
             "| model | " + " | ".join(headers) + " |", "|---|" + "---:|" * len(headers)]
    for name in names:
        lines.append(f"| {row_label(results, name)} | " + " | ".join(ppl_cells(results, name))
                     + " |")
    return lines


def _kept_step(results: dict, name: str) -> str:
    """The step whose weights scored a trained row, of the steps it trained (its head's, for
    an interpolation); 0 is the starting weights."""
    training = results.get("training", {}).get(rows.row(name).head or "")
    if not training or "kept_step" not in training:
        return ""
    return f"{training['kept_step']} / {training['steps']}"


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


def _screen_clause(screen: Optional[dict]) -> str:
    """How an exact search of the test queries screened (``gnnlm.retrieval.exact``)."""
    if not screen:
        return ""
    precisions = " and ".join(f"{name} ({screen[name]:,} queries)"
                              for name in ("float16", "float32") if screen.get(name))
    again = (f"{screen.get('rescreened', 0):,} screened again in float32, "
             if screen.get("float16") else "")
    return (f", screened in {precisions or 'no precision recorded'}, "
            f"{screen.get('widened', 0):,} widened, {again}"
            f"{screen.get('exhaustive', 0):,} scored against every key")


def made_by_line(made_by: dict) -> str:
    """The code a report or an artifact came from, in words."""
    line = f"gnnlm {made_by.get('gnnlm')}"
    if made_by.get("commit"):
        line += (f", commit {made_by['commit'][:12]}"
                 f"{' with uncommitted changes' if made_by.get('dirty') else ''}")
    return line
