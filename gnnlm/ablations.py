"""The kNN-LM ablations of Xu et al. ("Why do nearest neighbor LMs work?"), one table.

All rows score the same prefix of the valid/test splits (``eval_tokens``; exact search over the
whole datastore costs N_train per query), with (k, T, λ) fitted on the valid prefix:

- key ``att`` vs ``final`` (§3, Table 1), FAISS neighbours and scores;
- FAISS neighbours + FAISS scores vs FAISS neighbours + exact scores vs exact neighbours + exact
  scores (§5.1: approximate search helps);
- similarity cos vs ip vs l2 on exact neighbours (§3);
- a temperature curve (§5.2): test perplexity at each T with k and λ fitted on valid;
- datastore subsampling (§4.2, Figure 2): exact search in a seeded random 5 % … 100 % of the
  train positions.

The learned-W_ds rows (§4.1–4.2) are heads trained by the pipeline; the Transformer-XL memory
rows (SPALM's short-term memory) evaluate a memory LM with and without its memory
(``gnnlm.runner.memory_rows``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np

from gnnlm.datastore import open_features
from gnnlm.devices import check_device
from gnnlm.knn import fit_and_score
from gnnlm.knn_cache import open_knn_cache
from gnnlm.metrics import ppl_from_logprobs
from gnnlm.neighbors import neighbor_hits, open_neighbors
from gnnlm.search import exact_search, rescore
from gnnlm.workdir import EVAL_SPLITS, Workdir


@dataclass
class AblationStage:
    """``enabled`` turns the ablation table on; ``memory_lm`` (``gnnlm fit`` YAMLs of a
    Transformer-XL base LM) adds the memory on/off rows."""
    enabled: bool = False
    eval_tokens: Optional[int] = 5000
    metrics: list[str] = field(default_factory=lambda: ["cos", "ip", "l2"])
    subsample: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.5, 1.0])
    # ip and l2 scores are not bounded like cos: their T grid must reach larger values
    unbounded_temperatures: list[float] = field(
        default_factory=lambda: [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0])
    seed: int = 0
    device: str = "auto"
    memory_lm: Union[str, list[str], None] = None

    def __post_init__(self):
        check_device(self.device)
        if any(not 0 < f <= 1 for f in self.subsample):
            raise ValueError(f"ablations.subsample fractions must lie in (0, 1] "
                             f"(got {self.subsample}).")


def _prefix(n: int, eval_tokens: Optional[int]) -> int:
    return n if eval_tokens is None else min(n, eval_tokens)


class Evaluator:
    """Shared inputs of the ablations: the valid/test prefixes, the train datastore, the grid."""

    def __init__(self, workdir: Workdir, key: str, stage: AblationStage, grid: tuple, K: int):
        self.workdir, self.key, self.stage, self.grid, self.K = workdir, key, stage, grid, K
        _, self.train = open_features(workdir.features("train"))
        self.train_targets = np.asarray(self.train["targets"])
        self.splits = {}
        for split in EVAL_SPLITS:
            _, arrays = open_features(workdir.features(split))
            n = _prefix(len(arrays["targets"]), stage.eval_tokens)
            self.splits[split] = {name: np.asarray(arrays[name][:n])
                                  for name in ("lm_logprob", "targets", "final", "att")}

    def queries(self, split: str, key: Optional[str] = None) -> np.ndarray:
        return self.splits[split][key or self.key].astype(np.float32)

    def score(self, caches: dict, grid: Optional[tuple] = None) -> dict:
        """Fit (k, T, λ) on the valid prefix (over ``grid``, default the pipeline's), report
        valid and test perplexity."""
        result = fit_and_score(caches["valid"], caches["test"], *(grid or self.grid))
        result.pop("test_logprob")
        return result

    def cache(self, split: str, sims: np.ndarray, ids: np.ndarray) -> dict:
        s = self.splits[split]
        return {"lm_logprob": s["lm_logprob"], "sims": sims,
                "hits": neighbor_hits(ids, self.train_targets, s["targets"])}

    def exact(self, metric: str, subset: Optional[np.ndarray] = None) -> dict:
        """Exact neighbours and scores (over ``subset`` train positions when given)."""
        keys = self.train[self.key]
        keys = keys if subset is None else keys[subset]
        caches = {}
        for split in EVAL_SPLITS:
            sims, ids = exact_search(keys, self.queries(split), self.K, metric,
                                     device=self.stage.device)
            if subset is not None:
                ids = np.where(ids >= 0, subset[np.maximum(ids, 0)], -1)
            caches[split] = self.cache(split, sims, ids)
        return caches

    def rescored(self, metric: str) -> dict:
        """The index's neighbours with their similarities recomputed exactly in float32."""
        caches = {}
        for split in EVAL_SPLITS:
            n = len(self.splits[split]["targets"])
            _, nb = open_neighbors(self.workdir.neighbors(self.key, metric, split))
            ids = np.asarray(nb["ids"][:n]).astype(np.int64)                 # [n, K]
            sims = rescore(self.queries(split), ids, self.train[self.key], metric)
            caches[split] = self.cache(split, sims, ids)
        return caches


def run_ablations(stage: AblationStage, workdir: Workdir, keys: list[str], metric: str,
                  scores: str, grid: tuple, out_dir: Path) -> dict:
    """The ablation table and curves from the pipeline's kNN caches (FAISS neighbours, ``scores``
    scores) of ``keys`` under ``metric``; the first key is the one every other row uses."""
    primary = keys[0]

    def cached(key: str) -> dict:
        return {s: open_knn_cache(workdir.knn_cache(key, metric, scores, s))[1]
                for s in EVAL_SPLITS}

    K = int(cached(primary)["valid"]["sims"].shape[1])
    ev = Evaluator(workdir, primary, stage, grid, K)
    n = {s: len(ev.splits[s]["targets"]) for s in ev.splits}

    def sliced(key: str) -> dict:
        return {s: {name: np.asarray(a[: n[s]]) for name, a in arrays.items()}
                for s, arrays in cached(key).items()}

    rows = [{"row": "base LM", "test_ppl": ppl_from_logprobs(ev.splits["test"]["lm_logprob"]),
             "valid_ppl": ppl_from_logprobs(ev.splits["valid"]["lm_logprob"])}]
    for key in keys:  # Xu et al. Table 1: which representation is the key
        rows.append({"row": f"kNN-LM, key {key}, {metric}, FAISS neighbours + "
                            f"{'FAISS' if scores == 'faiss' else 'exact'} scores",
                     **ev.score(sliced(key))})
    rows.append({"row": f"kNN-LM, key {primary}, {metric}, FAISS neighbours + exact scores",
                 **ev.score(ev.rescored(metric))})
    for m in stage.metrics:  # the similarity function, on exact neighbours
        m_grid = grid if m == "cos" else (grid[0], stage.unbounded_temperatures, grid[2])
        rows.append({"row": f"kNN-LM, key {primary}, {m}, exact neighbours + exact scores",
                     **ev.score(ev.exact(m), m_grid)})

    ks, ts, ls = grid
    faiss_caches = sliced(primary)
    temperature_curve = [{"temperature": t, **ev.score(faiss_caches, (ks, [t], ls))}
                         for t in ts]

    rng = np.random.default_rng(stage.seed)
    n_train = len(ev.train_targets)
    subsample_curve = []
    for fraction in sorted(stage.subsample):
        subset = np.sort(rng.choice(n_train, size=max(ev.K, int(round(fraction * n_train))),
                                    replace=False))
        subsample_curve.append({"fraction": fraction, **ev.score(ev.exact(metric, subset))})

    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(out_dir / "temperature_curve.png", [r["temperature"] for r in temperature_curve],
          [r["test_ppl"] for r in temperature_curve], "temperature T", log_x=True,
          base=rows[0]["test_ppl"], title="kNN-LM: test perplexity against T")
    _plot(out_dir / "datastore_subsampling.png", [r["fraction"] for r in subsample_curve],
          [r["test_ppl"] for r in subsample_curve], "fraction of the train datastore",
          base=rows[0]["test_ppl"], title="kNN-LM: test perplexity against datastore size")
    return {"tokens": n, "key": primary, "rows": rows, "temperature_curve": temperature_curve,
            "subsample_curve": subsample_curve}


def _plot(path: Path, x: list, y: list, xlabel: str, base: float, title: str,
          log_x: bool = False) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, y, marker="o", label="kNN-LM")
    ax.axhline(base, color="gray", linestyle="--", label="base LM")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test perplexity")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
