"""Reports: ``reports/<name>/results.json``, ``results.md``, per-token scores and plots.

Every perplexity is exp(−Σ log p / N) over the same N test tokens (the split's every position,
scored once), computed here from per-token log-probabilities, never averaged from batches. Each
row records how its tokens were scored (``gnnlm.models.protocols``): rows read with different
windows or segments go in separate tables, each headed by its protocol and the left context it
gives. Above them, the data's checks (``gnnlm.pipeline.data_checks``: unknown tokens, near-copies of
valid/test in the datastore) and, when something makes the numbers untrustworthy, one Warnings
block.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.pipeline import data_checks
from gnnlm.retrieval.tuning import measured_recall
from gnnlm.spalm.analysis import markdown as spalm_markdown
from gnnlm.spalm.analysis import results_section as spalm_section
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.workdir.artifacts import open_array, read_manifest, write_json_atomic
from gnnlm.workdir.layout import EVAL_SPLITS, Workdir

ROW_NAMES = {"base": "base LM", "knn": "+kNN", "gnn": "+GNN", "gnn+knn": "+GNN+kNN",
             "spalm": "SPALM: gate on frozen LM", "spalm_ft": "SPALM: gate + last block",
             "transformer": "transformer (no memory)",
             "transformer_xl": "Transformer-XL (short-term memory)",
             "spalm_xl": "SPALM (short + long-term memory)",
             # its options are named after it, from the head's manifest
             "spalm_xl_variant": "SPALM (short + long-term memory)"}


def row_name(name: str, deviations: Optional[list[str]] = None) -> str:
    """How a results.json ``ppl`` key reads in a table; ``deviations`` (the options on that
    depart from the model's paper) are named after it: "SPALM (…) (+memory scale)"."""
    if deviations:
        return f"{row_name(name)} ({', '.join('+' + d for d in deviations)})"
    if name in ROW_NAMES:
        return ROW_NAMES[name]
    if name.startswith("knn["):
        return f"+kNN, {name[4:-1]} keys"
    if name.startswith("learned_wds"):
        head, _, interpolated = name.partition("+")
        n = head[len("learned_wds"):].strip("[]").replace("n=", "n = ") or None
        label = "learned W_ds" + (f" ({n})" if n else "")
        return f"base LM + {label}" if interpolated else f"{label} alone"
    return name


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
    rows = []
    for start, stop in zip(cuts[:-1], cuts[1:]):
        part = order[start:stop]
        b, m = float(base[part].mean()), float(model[part].mean())
        rows.append({"recall_range": [int(sorted_hits[start]), int(sorted_hits[stop - 1])],
                     "tokens": int(len(part)), "base_logprob": b, "model_logprob": m,
                     "absolute_improvement": m - b,
                     "relative_improvement": (m - b) / abs(b) if b else 0.0})
    return rows


def _stage_seconds(cfg, workdir: Workdir, retrieval: dict, heads: dict, base_manifest: dict,
                   feature_manifests: dict) -> dict:
    """Build time of each stage as recorded in its artifacts (stable across reruns)."""
    timing = {"base_lm": base_manifest.get("train_seconds", 0.0),
              "features": sum(m.get("seconds", 0.0) for m in feature_manifests.values())}
    for key, r in retrieval.items():
        timing[f"index[{key}]"] = r["index"].get("train_seconds", 0) + r["index"].get(
            "add_seconds", 0)
        timing[f"neighbors[{key}]"] = sum(m.get("search_seconds", 0)
                                          for m in r["neighbors"].values())
        timing[f"knn_cache[{key}]"] = sum(
            read_manifest(workdir.knn_cache(key, cfg.knn.metric, cfg.knn.scores, s)).get(
                "seconds", 0) for s in EVAL_SPLITS)
    if "gnn" in heads and (workdir.pq(cfg.knn.primary) / "manifest.json").is_file():
        timing["pq"] = read_manifest(workdir.pq(cfg.knn.primary)).get("seconds", 0)
    for name, manifest in heads.items():
        timing[name] = manifest.get("train_seconds", 0.0)
    return {k: round(float(v), 2) for k, v in timing.items()}


def _retrieval_facts(r: dict) -> dict:
    """What results.json says of one key's retrieval: how the test neighbours were searched
    (exact search, or the index at their nprobe/re-ranking), the recall the index stage measured
    for exactly that setting against exact search (None: not measured), the neighbour stage's
    speed, the leakage masking."""
    index, test = r["index"], r["neighbors"]["test"]
    backend = test.get("backend", "index")
    facts = {"backend": backend, "factory": test.get("factory", index["factory"]),
             "index_factory": index["factory"], "nprobe": test.get("nprobe"),
             "rerank": test.get("rerank"), "K": test["K"],
             "recall": (None if backend == "exact" else
                        measured_recall(index, test.get("nprobe"), test.get("rerank"),
                                        test["K"])),
             "target_recall": index.get("target_recall"),
             "queries_per_s": test.get("queries_per_s"), "search_settings": index.get("tuning")}
    train = r["neighbors"].get("train")
    if train is not None:
        facts.update({"masked_fraction": train.get("masked_fraction"),
                      "leakage_window": train["leakage_window"]})
    return facts


def _retrieval_line(key: str, info: dict) -> str:
    if info["backend"] == "exact":
        searched = f"exact search, K = {info['K']:,}"
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

    rows = {}
    for name in names:
        head = name.split("+")[0] if name not in heads else name
        rows[name] = of_head(heads[head]) if head in heads else features
    return rows


def protocol_tables(results: dict) -> list[tuple[Protocol, list[str]]]:
    """The rows grouped by layout (``gnnlm.models.protocols.layout``), in table order."""
    groups: dict[tuple, tuple[Protocol, list[str]]] = {}
    for name in results["ppl"]:
        protocol = results["protocols"][name]
        groups.setdefault(protocols.layout(protocol), (protocol, []))[1].append(name)
    return list(groups.values())


def _label(results: dict, name: str) -> str:
    return row_name(name, results.get("deviations", {}).get(name))


def _table_markdown(results: dict, protocol: Protocol, names: list[str]) -> list[str]:
    left = results["mean_left_context"]
    ppl = results["ppl"]
    valid_ppl = results["valid_ppl"]
    if protocol["kind"] == "segments":
        lines = [f"Scored as {protocols.describe(protocol, with_memory=False)}:", "",
                 "| model | memory M | mean left context | valid ppl | test ppl |",
                 "|---|---:|---:|---:|---:|"]
        for name in names:
            valid = valid_ppl.get(name)
            lines.append(f"| {_label(results, name)} | {results['protocols'][name]['memory']} | "
                         f"{left[name]:.1f} | {'' if valid is None else f'{valid:.2f}'} | "
                         f"{ppl[name]:.2f} |")
        return lines
    lines = [f"Scored with {protocols.describe(protocol, mean_left_context=left.get(names[0]))}:",
             "",
             "| model | valid ppl | test ppl |", "|---|---:|---:|"]
    for name in names:
        valid = valid_ppl.get(name)
        lines.append(f"| {_label(results, name)} | "
                     f"{'' if valid is None else f'{valid:.2f}'} | {ppl[name]:.2f} |")
    return lines


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


def _markdown(results: dict) -> str:
    lines = [f"# {results['name']}: {results['dataset']}", "",
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
    lines.pop()
    lines += ["", "Interpolation hyper-parameters (fitted on valid):", ""]
    for name, hp in results["hparams"].items():
        shown = {k: v for k, v in hp.items() if k not in ("valid_ppl", "test_ppl")}
        lines.append(f"- {_label(results, name)}: " + ", ".join(f"{k}={v}" for k, v in
                                                                          shown.items()))
    if results.get("knn_recall_buckets"):
        rows = results["knn_recall_buckets"]
        lines += ["", f"kNN recall buckets (GNN-LM Table 4; mean log p, "
                      f"{results['knn_recall_buckets_model']} vs base):", "",
                  "| recall range | tokens | base | model | abs. | rel. |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
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
    lines += spalm_markdown(results.get("spalm_xl_analysis"), row_name("spalm_xl"))
    lines += _ablation_markdown(results.get("ablations"))
    lines += ["", "Retrieval:", ""]
    lines += [_retrieval_line(key, info) for key, info in results["retrieval"].items()]
    if results.get("gnn_leakage"):
        lines.append("- GNN-LM train graphs, leakage rule: " + ", ".join(
            f"{name.replace('_', ' ')} {value:.4f}" for name, value in
            results["gnn_leakage"].items()))
    lines += ["", "Stage build times (s): " + ", ".join(f"{k} {v}" for k, v in
                                                         results["timing_s"].items()), ""]
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


def plot_gate_histogram(histogram: list[int], path: Path, title: str = "") -> None:
    """SPALM Figure 5: the distribution of the gate's values over the test tokens (the gate is
    a vector: every dimension of every token is counted)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    edges = np.linspace(0, 1, len(histogram) + 1)
    fig = Figure(figsize=(5, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(edges[:-1], histogram, width=edges[1] - edges[0], align="edge")
    ax.set_xlabel("gate value (1 = local context, 0 = retrieved memory)")
    ax.set_ylabel("gate values (tokens x dimensions)")
    ax.set_title(title or "SPALM gate values on test")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rows_on_the_base_lm(names: list[str], heads: dict, row_protocol: dict) -> list[str]:
    """The rows that stand for a trained head on the base LM's features, read the base LM's way,
    and so should beat it on valid: the head's own row, or ``<head>+base`` where the report
    interpolates the head with the base LM (a learned W_ds is a datastore, not a whole LM).
    Segment models are separate LMs, not heads, and are not compared with the base LM."""
    base = protocols.layout(row_protocol["base"])
    return [f"{name}+base" if f"{name}+base" in names else name for name in names
            if name in heads and protocols.layout(row_protocol[name]) == base]


def write_report(cfg, workdir: Workdir, model, store, scores: dict, hparams: dict,
                 retrieval: dict, heads: dict, base_manifest: dict, feature_manifests: dict,
                 ablations: Optional[dict] = None) -> dict:
    out = workdir.report(cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    test_n = feature_manifests["test"]["n"]
    for name, per_split in scores.items():
        if len(per_split["test"]) != test_n:
            raise RuntimeError(f"{name} scored {len(per_split['test'])} test tokens, not {test_n}.")
    order = ["base", "knn", *sorted(n for n in scores if n.startswith("knn[")), "gnn", "gnn+knn",
             "spalm", "spalm_ft", "transformer", "transformer_xl", "spalm_xl",
             "spalm_xl_variant"]
    names = [n for n in order if n in scores] + sorted(n for n in scores if n not in order)
    ppl = {name: ppl_from_logprobs(scores[name]["test"]) for name in names}
    valid_ppl = {name: ppl_from_logprobs(s["valid"]) for name, s in scores.items() if "valid" in s}
    valid_ppl.update({name: hp["valid_ppl"] for name, hp in hparams.items() if "valid_ppl" in hp})
    features_protocol = protocols.of_features(feature_manifests["test"])
    row_protocol = row_protocols(names, heads, features_protocol)
    results = {
        "name": cfg.name, "dataset": store.manifest["config"]["corpus"], "split": "test",
        "tokens": int(test_n), "protocol": feature_manifests["test"]["protocol"],
        "protocols": row_protocol,
        "mean_left_context": {name: float(protocols.left_context(p, test_n).mean())
                              for name, p in row_protocol.items() if p["kind"] != "unrecorded"},
        "deviations": {name: heads[name]["deviations"] for name in names
                       if name in heads and heads[name].get("deviations")},
        "level": store.level, "ppl": ppl, "valid_ppl": valid_ppl, "hparams": hparams,
        "base_lm": model.identity(),
        "retrieval": {key: _retrieval_facts(r) for key, r in retrieval.items()},
        "timing_s": _stage_seconds(cfg, workdir, retrieval, heads, base_manifest,
                                   feature_manifests),
    }
    checks = data_checks.measure(workdir, cfg.knn.primary, cfg.knn.metric, store)
    results.update(checks)
    worse = data_checks.heads_worse_than_base(valid_ppl,
                                              rows_on_the_base_lm(names, heads, row_protocol))
    results["warnings"] = data_checks.report_warnings(
        checks["unk_share"], checks["datastore_overlap"], worse,
        label=lambda name: _label(results, name), unk_token=checks["unk_token"],
        context=checks["near_copy"]["context"])
    if store.level == "char":
        results["bpc"] = {name: float(np.log2(p)) for name, p in ppl.items()}
    best = "gnn+knn" if "gnn+knn" in scores else "knn"
    hits = open_array(workdir.knn_cache(cfg.knn.primary, cfg.knn.metric, cfg.knn.scores, "test"),
                      "hits")
    results["knn_recall_buckets"] = recall_buckets(np.asarray(hits).sum(1), scores["base"]["test"],
                                                   scores[best]["test"])
    results["knn_recall_buckets_model"] = best
    for head in ("spalm", "spalm_ft"):
        if head in heads and "gate" in heads[head]:
            results[f"{head}_gate"] = heads[head]["gate"]
            plot_gate_histogram(heads[head]["gate"]["histogram"], out / f"{head}_gate_hist.png",
                                f"{row_name(head)}: gate values on test")
    if "gnn" in heads and "eval_k" in heads["gnn"]:  # valid ppl by the windows read per token
        results["gnn_eval_k"] = heads["gnn"]["eval_k"]
    if "gnn" in heads:  # the leakage rule's share of train-graph windows and nodes
        results["gnn_leakage"] = {name.split("/")[1]: value
                                  for name, value in heads["gnn"].get("metrics", {}).items()
                                  if name.startswith("leakage/")}
    if "spalm_xl" in heads:  # SPALM §5: gates (valid, test), k curve, frequency buckets
        results["spalm_xl_analysis"] = spalm_section(workdir, heads["spalm_xl"], scores,
                                                     plot=out / "spalm_xl_gate_hist.png")
    if ablations:
        results["ablations"] = ablations
        for png in workdir.ablations.glob("*.png"):
            (out / png.name).write_bytes(png.read_bytes())
    np.savez_compressed(out / "test_logprobs.npz", **{k: v["test"] for k, v in scores.items()})
    write_json_atomic(out / "results.json", results)
    (out / "results.md").write_text(_markdown(results))
    return results


def print_table(results: dict, workdir: Workdir) -> None:
    """The results tables on stdout, one per protocol, as ``gnnlm pipeline`` ends."""
    print(f"\n{results['dataset']}: test {results['tokens']:,} tokens, every one scored once "
          f"by every row")
    for protocol, names in protocol_tables(results):
        print(f"{protocols.describe(protocol, with_memory=protocol['kind'] != 'segments')}:")
        print(f"  {'model':<44} {'left ctx':>8} {'valid ppl':>10} {'test ppl':>10}")
        for name in names:
            valid = results["valid_ppl"].get(name)
            left = results["mean_left_context"].get(name)
            print(f"  {_label(results, name):<44} {'' if left is None else f'{left:.1f}':>8} "
                  f"{'' if valid is None else f'{valid:.2f}':>10} {results['ppl'][name]:10.2f}")
    if "unk_share" in results:
        print(data_line(results))
    if results.get("warnings"):
        print("Warnings:")
        for warning in results["warnings"]:
            print(f"  ⚠ {warning['message']}")
    print(f"written to {workdir.report(results['name'])}")
