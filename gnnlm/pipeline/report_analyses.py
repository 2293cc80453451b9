"""The report's analyses and their plots: kNN recall buckets (Meng et al. 2022, GNN-LM Table 4)
and their bars, GNN-LM's valid perplexity by evaluation k and its leakage rule's shares, every
SPALM row's gate analysis (``gnnlm.spalm.analysis``), and per key with a kNN-LM row how much its
retrieval discriminates (``gnnlm.retrieval.sanity``) beside its λ × T heatmap."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from gnnlm.pipeline.results import Results
from gnnlm.pipeline.sweep import write_heatmap
from gnnlm.spalm.analysis import results_section as spalm_section
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.workdir import rows
from gnnlm.workdir.layout import Workdir


def analyses(workdir: Workdir, results: Results, out: Path) -> dict:
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


def plot_recall_buckets(path: Path, buckets: list[dict], model: str) -> None:
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


def retrieval_sanity(results: Results, out: Path) -> dict:
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
