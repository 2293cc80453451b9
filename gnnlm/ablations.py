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
rows (SPALM's short-term memory) evaluate a memory LM with and without its memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from gnnlm.artifacts import open_array
from gnnlm.datastore import features_dir, open_features
from gnnlm.index import exact_search
from gnnlm.knn import fit, knn_lm_logprob, similarity
from gnnlm.metrics import ppl_from_logprobs


@dataclass
class AblationStage:
    """``enabled`` turns the ablation table on; ``memory_lm`` (a ``gnnlm fit`` YAML of a
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
    memory_lm: Optional[str] = None


def _prefix(n: int, eval_tokens: Optional[int]) -> int:
    return n if eval_tokens is None else min(n, eval_tokens)


def _hits(ids: np.ndarray, train_targets: np.ndarray, targets: np.ndarray) -> np.ndarray:
    values = np.where(ids >= 0, train_targets[np.maximum(ids, 0)], -1)   # [n, K]
    return values == targets[:, None]


class Evaluator:
    """Shared inputs of the ablations: the valid/test prefixes, the train datastore, the grid."""

    def __init__(self, workdir: Path, key: str, stage: AblationStage, grid: tuple, K: int):
        self.workdir, self.key, self.stage, self.grid, self.K = workdir, key, stage, grid, K
        _, self.train = open_features(features_dir(workdir, "train"))
        self.train_targets = np.asarray(self.train["targets"])
        self.splits = {}
        for split in ("valid", "test"):
            _, arrays = open_features(features_dir(workdir, split))
            n = _prefix(len(arrays["targets"]), stage.eval_tokens)
            self.splits[split] = {name: np.asarray(arrays[name][:n])
                                  for name in ("lm_logprob", "targets", "final", "att")}

    def queries(self, split: str, key: Optional[str] = None) -> np.ndarray:
        return self.splits[split][key or self.key].astype(np.float32)

    def score(self, caches: dict, grid: Optional[tuple] = None) -> dict:
        """Fit (k, T, λ) on the valid prefix (over ``grid``, default the pipeline's), report
        valid and test perplexity."""
        ks, ts, ls = grid or self.grid
        best = fit(caches["valid"], sorted({min(k, self.K) for k in ks}), ts, ls)
        test = knn_lm_logprob(caches["test"], best["k"], best["temperature"], best["lambda"])
        return {"k": int(best["k"]), "temperature": float(best["temperature"]),
                "lambda": float(best["lambda"]), "valid_ppl": float(best["ppl"]),
                "test_ppl": ppl_from_logprobs(test)}

    def cache(self, split: str, sims: np.ndarray, ids: np.ndarray) -> dict:
        s = self.splits[split]
        return {"lm_logprob": s["lm_logprob"], "sims": sims,
                "hits": _hits(ids, self.train_targets, s["targets"])}

    def exact(self, metric: str, subset: Optional[np.ndarray] = None) -> dict:
        """Exact neighbours and scores (over ``subset`` train positions when given)."""
        keys = self.train[self.key]
        keys = keys if subset is None else keys[subset]
        caches = {}
        for split in ("valid", "test"):
            sims, ids = exact_search(keys, self.queries(split), self.K, metric,
                                     device=_device(self.stage.device))
            if subset is not None:
                ids = np.where(ids >= 0, subset[np.maximum(ids, 0)], -1)
            caches[split] = self.cache(split, sims, ids)
        return caches

    def rescored(self, neighbor_dirs: dict, metric: str, chunk: int = 2048) -> dict:
        """The index's neighbours with their similarities recomputed exactly in float32."""
        caches = {}
        for split, path in neighbor_dirs.items():
            n = len(self.splits[split]["targets"])
            ids = np.asarray(open_array(path, "ids")[:n]).astype(np.int64)          # [n, K]
            sims = np.empty(ids.shape, dtype=np.float32)
            queries = self.queries(split)
            for r in range(0, n, chunk):  # [chunk, K, d] keys at a time
                rows = ids[r: r + chunk]
                keys = np.asarray(self.train[self.key][np.maximum(rows, 0).ravel()],
                                  dtype=np.float32).reshape(*rows.shape, -1)
                sims[r: r + chunk] = similarity(queries[r: r + chunk, None, :], keys, metric)
            sims[ids < 0] = -np.inf
            caches[split] = self.cache(split, sims, ids)
        return caches


def _device(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def run_ablations(stage: AblationStage, workdir: Path, keys: list[str], metric: str,
                  grid: tuple, cache_dirs: dict, neighbor_dirs: dict, out_dir: Path) -> dict:
    """The ablation table and curves; ``cache_dirs[key][split]`` are the pipeline's kNN caches
    (FAISS neighbours and scores) and ``neighbor_dirs[split]`` the first key's neighbours."""
    from gnnlm.pipeline import load_cache

    primary = keys[0]
    K = int(np.asarray(load_cache(cache_dirs[primary]["valid"])["sims"]).shape[1])
    ev = Evaluator(workdir, primary, stage, grid, K)
    n = {s: len(ev.splits[s]["targets"]) for s in ev.splits}

    def sliced(key: str) -> dict:
        return {s: {name: np.asarray(a[: n[s]]) for name, a in load_cache(p).items()}
                for s, p in cache_dirs[key].items()}

    rows = [{"row": "base LM", "test_ppl": ppl_from_logprobs(ev.splits["test"]["lm_logprob"]),
             "valid_ppl": ppl_from_logprobs(ev.splits["valid"]["lm_logprob"])}]
    for key in keys:  # Xu et al. Table 1: which representation is the key
        rows.append({"row": f"kNN-LM, key {key}, {metric}, FAISS neighbours + FAISS scores",
                     **ev.score(sliced(key))})
    rows.append({"row": f"kNN-LM, key {primary}, {metric}, FAISS neighbours + exact scores",
                 **ev.score(ev.rescored(neighbor_dirs, metric))})
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
          base=rows[0]["test_ppl"])
    _plot(out_dir / "datastore_subsampling.png", [r["fraction"] for r in subsample_curve],
          [r["test_ppl"] for r in subsample_curve], "fraction of the train datastore",
          base=rows[0]["test_ppl"])
    return {"tokens": n, "key": primary, "rows": rows, "temperature_curve": temperature_curve,
            "subsample_curve": subsample_curve}


def _plot(path: Path, x: list, y: list, xlabel: str, base: float, log_x: bool = False) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, y, marker="o", label="kNN-LM")
    ax.axhline(base, color="gray", linestyle="--", label="base LM")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def memory_rows(head_dir: Path, workdir: Path) -> list[dict]:
    """Transformer-XL short-term memory on and off: the same memory LM on its test split, both
    served as contiguous segments of parallel streams; the memory is carried, or dropped."""
    import pytorch_lightning as pl

    from datamodules.lm import LMDataModule
    from gnnlm.lm_module import LanguageModel
    from gnnlm.training import datamodule_args

    ckpt = head_dir / "model.ckpt"
    model = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu")
    data = LMDataModule(**{**datamodule_args(str(ckpt)), "workdir": str(workdir),
                           "segments": True})
    memory = model.memory_length
    rows = []
    for length in (memory, 0):
        model.memory_length = model.model.memory_length = length
        trainer = pl.Trainer(accelerator="auto", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        (metrics,) = trainer.test(model, datamodule=data, verbose=False)
        rows.append({"row": f"Transformer-XL base LM, memory "
                            f"{f'M = {length}' if length else 'off'}",
                     "test_ppl": float(metrics["test/ppl"]),
                     "tokens": int(metrics["test/tokens"]),
                     "segment": data.hparams.block_size})
    return rows
