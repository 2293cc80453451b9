"""SPALM's analyses of a trained model (Yogatama et al. 2021, §5), from what its predict runs
stored beside the scores.

A SPALM head's artifact (``models/<name>/``) holds ``<split>_logprob``, ``<split>_gate`` (the
gate g_t averaged over its d dimensions, one value per token) and, in its manifest, the
``k_curve``. From them:

- the distribution of gate values on valid and test (Fig. 4-5), counting tokens;
- perplexity on valid against the number of neighbours k the trained model reads (Table 5);
- gate value and loss per train-frequency bucket of the target token, SPALM against a baseline
  (Transformer-XL) on the same tokens.

Arrays in, dicts out; ``results_section`` gathers them for ``gnnlm.pipeline.report``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from gnnlm.retrieval.features import open_features
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.workdir.layout import EVAL_SPLITS, Workdir
from gnnlm.workdir.manifests import open_array

FREQUENCY_EDGES = (1, 10, 100, 1000, 10000)
GATE_AXIS = "mean gate over the d dimensions, per token (1 = local context and short-term " \
            "memory, 0 = long-term memory)"


def gate_histogram(gate_means: np.ndarray, bins: int = 20) -> dict:
    """Tokens per bin of their mean gate over [0, 1] (NaN = not scored, left out)."""
    values = np.asarray(gate_means, dtype=np.float64)
    values = values[~np.isnan(values)]
    counts, edges = np.histogram(np.clip(values, 0.0, 1.0), bins=bins, range=(0.0, 1.0))
    return {"counts": counts.tolist(), "edges": edges.tolist(), "tokens": int(len(values)),
            "mean": float(values.mean()) if len(values) else float("nan"),
            "unit": "tokens", "value": "gate mean over dimensions"}


def frequency_buckets(targets: np.ndarray, train_counts: np.ndarray, logprob: np.ndarray,
                      gate_means: Optional[np.ndarray] = None,
                      baseline_logprob: Optional[np.ndarray] = None,
                      edges: tuple[int, ...] = FREQUENCY_EDGES) -> list[dict]:
    """Tokens bucketed by how often their target occurs in train (``[0, e0), [e0, e1), …,
    [e_last, ∞)``; empty buckets left out): per bucket the token count, the model's perplexity
    and, when given, its mean gate and the baseline's perplexity on the same tokens."""
    counts = np.asarray(train_counts)[np.asarray(targets, dtype=np.int64)]
    highs: list[Optional[int]] = [*edges, None]
    rows = []
    for lo, hi in zip([0, *edges], highs):
        part = (counts >= lo) & (counts < hi) if hi is not None else counts >= lo
        if not part.any():
            continue
        row = {"train_count": [int(lo), None if hi is None else int(hi) - 1],
               "tokens": int(part.sum()), "ppl": ppl_from_logprobs(logprob[part]),
               "logprob": float(np.mean(logprob[part], dtype=np.float64))}
        if gate_means is not None:
            row["gate_mean"] = float(np.nanmean(gate_means[part]))
        if baseline_logprob is not None:
            row["baseline_ppl"] = ppl_from_logprobs(baseline_logprob[part])
            row["baseline_logprob"] = float(np.mean(baseline_logprob[part], dtype=np.float64))
        rows.append(row)
    return rows


def plot_gate_histograms(histograms: dict[str, dict], path: Path) -> None:
    """SPALM Fig. 4-5: one panel per split, tokens per bin of their mean gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histograms), figsize=(5 * len(histograms), 3), squeeze=False)
    for ax, (split, hist) in zip(axes[0], histograms.items()):
        edges = np.asarray(hist["edges"])
        ax.bar(edges[:-1], hist["counts"], width=np.diff(edges), align="edge")
        ax.set_title(f"{split} ({hist['tokens']:,} tokens, mean {hist['mean']:.3f})")
        ax.set_xlabel(GATE_AXIS, fontsize=7)
        ax.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_section(workdir: Workdir, manifest: dict, scores: dict,
                    baseline: Optional[str] = "transformer_xl",
                    plot: Optional[Path] = None) -> dict:
    """The analyses of the SPALM head whose artifact manifest is ``manifest``; ``scores`` are
    the report's per-token log-probabilities by row and split (the baseline's are used when
    present). Writes the gate histograms to ``plot`` when given."""
    head = workdir.model(manifest["config"]["name"])
    name = manifest["config"]["name"]
    arrays = manifest.get("arrays", {})
    gates = {s: np.asarray(open_array(head, f"{s}_gate"), dtype=np.float32)
             for s in EVAL_SPLITS if f"{s}_gate" in arrays}
    section: dict = {"gate_histogram": {s: gate_histogram(g) for s, g in gates.items()}}
    if "k_curve" in manifest:
        section["k_curve"] = manifest["k_curve"]
    train_counts = np.bincount(np.asarray(open_features(workdir.features("train"))[1]["targets"],
                                          dtype=np.int64),
                               minlength=int(workdir.features_manifest("train")["vocab_size"]))
    targets = np.asarray(open_features(workdir.features("test"))[1]["targets"])
    base = scores.get(baseline, {}).get("test") if baseline else None
    section["frequency_buckets"] = {
        "split": "test", "baseline": baseline if base is not None else None,
        "rows": frequency_buckets(targets, train_counts, scores[name]["test"], gates.get("test"),
                                  base)}
    if plot is not None and section["gate_histogram"]:
        plot_gate_histograms(section["gate_histogram"], plot)
    return section


def markdown(section: Optional[dict], row: str = "SPALM") -> list[str]:
    """results.md lines for ``results_section``'s output."""
    if not section:
        return []
    lines = []
    for split, hist in section.get("gate_histogram", {}).items():
        lines += ["", f"{row} gate on {split} (tokens per bin of the {GATE_AXIS}; mean "
                      f"{hist['mean']:.3f}): " + ", ".join(str(c) for c in hist["counts"])]
    curve = section.get("k_curve")
    if curve:
        lines += ["", f"{row} valid perplexity against the number of neighbours it reads "
                      f"(trained with k = {curve['trained_k']}; {curve['tokens']:,} valid "
                      f"tokens):", "", "| k | " + " | ".join(str(k) for k in curve["k"]) + " |",
                  "|---|" + "---:|" * len(curve["k"]),
                  "| valid ppl | " + " | ".join(f"{p:.2f}" for p in curve["ppl"]) + " |"]
    buckets = section.get("frequency_buckets")
    if buckets and buckets["rows"]:
        other = buckets["baseline"]
        lines += ["", f"{row} by train frequency of the target ({buckets['split']} tokens"
                      + (f"; baseline: {other}" if other else "") + "):", "",
                  "| train count | tokens | mean gate | ppl | baseline ppl |",
                  "|---|---:|---:|---:|---:|"]
        for r in buckets["rows"]:
            lo, hi = r["train_count"]
            span = f"≥ {lo}" if hi is None else (f"{lo}" if lo == hi else f"{lo}–{hi}")
            gate = f"{r['gate_mean']:.3f}" if "gate_mean" in r else ""
            other_ppl = f"{r['baseline_ppl']:.2f}" if "baseline_ppl" in r else ""
            lines.append(f"| {span} | {r['tokens']:,} | {gate} | {r['ppl']:.2f} | {other_ppl} |")
    return lines
