"""The kNN-LM ablations of Xu et al. ("Why do nearest neighbor LMs work?"), one table.

All rows score the same prefix of the valid/test splits (``eval_tokens``; exact search over the
whole datastore costs N_train per query), with (k, T, λ) fitted on the valid prefix:

- key ``att`` vs ``final`` (§3, Table 1), on the pipeline's kNN caches;
- index neighbours + index scores vs index neighbours + exact scores vs exact neighbours + exact
  scores (§5.1: approximate search helps, "FAISS mask, FAISS score" being the best);
- similarity cos vs ip vs l2 on exact neighbours (§3);
- a temperature curve (§5.2): test perplexity at each T with k and λ fitted on valid;
- datastore subsampling (§4.2, Figure 2): exact search in a seeded random 5 % … 100 % of the
  train positions.

Each row is labelled by what was searched, read from the kNN caches' manifests
(``gnnlm.retrieval.knn_cache.search_facts``), not by what the row was meant to be: the pipeline's
neighbours may be exact (``neighbors.backend: exact``, a ``Flat`` index), and an index searched
with re-ranking returns exact scores. So the §5.1 "FAISS score" row is its own search: the index
at the neighbours' nprobe without re-ranking. Two rows that would be the same computation carry
the same label; only the first is scored, and ``skipped`` says why the others are absent.

The learned-W_ds rows (§4.1–4.2) are heads trained by the pipeline; the Transformer-XL memory
rows (SPALM's short-term memory) evaluate a memory LM with and without its memory
(``memory_rows``).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.models import protocols
from gnnlm.pipeline.settings import AblationConfig
from gnnlm.retrieval.features import open_features
from gnnlm.retrieval.knn import fit_and_score
from gnnlm.retrieval.knn_cache import (
    exact_score_index,
    exhaustive_index,
    open_knn_cache,
    search_facts,
)
from gnnlm.retrieval.neighbors import neighbor_hits, open_neighbors
from gnnlm.retrieval.search import Searcher, exact_search, rescore
from gnnlm.utils.devices import faiss_has_gpu
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.workdir.checkpoints import datamodule_args, load_checkpoint
from gnnlm.workdir.layout import EVAL_SPLITS, Workdir
from gnnlm.workdir.manifests import is_complete, read_manifest
from gnnlm.workdir.refusals import ArtifactError
from gnnlm.workdir.rows import BASE
from gnnlm.workdir.rows import label as report_label

# The rows' meaning: 2 labels rows by what was searched and adds the index-scores row. It belongs
# in the ablation artifact's fingerprint config, so a table of another version is rebuilt.
ABLATIONS_VERSION = 2


def _prefix(n: int, eval_tokens: Optional[int]) -> int:
    return n if eval_tokens is None else min(n, eval_tokens)


def outdated(path: Path) -> bool:
    """Whether ``path`` holds a complete ablation table of an older ``ABLATIONS_VERSION`` (its
    rows labelled by intent): the pipeline rebuilds it rather than show its labels."""
    if not is_complete(path):
        return False
    config = read_manifest(path).get("config") or {}
    return int(config.get("version", 1)) < ABLATIONS_VERSION


def neighbours_label(facts: dict) -> str:
    """What the neighbours are (``gnnlm.retrieval.knn_cache.SEARCH_FACTS``): "exact neighbours" for
    exact search or an exhaustive index, else the index with its search settings, e.g.
    "IVF4096,SQ8 neighbours (nprobe 4, re-ranked 1x)"."""
    factory = facts.get("factory")
    if facts.get("backend") == "exact" or exhaustive_index(factory):
        return "exact neighbours"
    settings = []
    if "IVF" in str(factory) and facts.get("nprobe") is not None:  # only IVF lists are probed
        settings.append(f"nprobe {facts['nprobe']}")
    rerank = float(facts.get("rerank") or 0)
    if rerank:
        settings.append(f"re-ranked {rerank:g}x")
    return f"{factory} neighbours" + (f" ({', '.join(settings)})" if settings else "")


def scores_label(facts: dict) -> str:
    """What the scores are: "exact" (recomputed, re-ranked by the search, or from an index that
    stores the keys uncompressed) or "approximate (index)"."""
    return "exact" if facts["scores_are_exact"] else "approximate (index)"


def search_description(facts: dict) -> str:
    """Neighbours and scores in the words every report uses (results.md, the printed table,
    sweep.md), e.g. "IVF4096,SQ8 neighbours (nprobe 4, re-ranked 1x) + exact scores"."""
    return f"{neighbours_label(facts)} + {scores_label(facts)} scores"


def row_label(key: str, metric: str, facts: dict) -> str:
    """The table's label of a kNN-LM row: key, similarity, neighbours and scores (Xu et al. §5.1
    "mask" and "score"), e.g. "kNN-LM, key final, cos: IVF4096,SQ8 neighbours (nprobe 4,
    re-ranked 1x) + exact scores"."""
    return f"kNN-LM, key {key}, {metric}: {search_description(facts)}"


class Evaluator:
    """Shared inputs of the ablations: the valid/test prefixes, the train datastore, the grid."""

    def __init__(self, workdir: Workdir, key: str, stage: AblationConfig, grid: tuple, K: int):
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

    def approximate(self, metric: str, nprobe: int) -> dict:
        """The index's neighbours and its own scores at ``nprobe``, without re-ranking: Xu et
        al.'s "FAISS mask, FAISS score" (§5.1)."""
        # ``device`` is torch's (exact search): without faiss-gpu the index is searched on the CPU
        device = self.stage.device if faiss_has_gpu() else "cpu"
        searcher = Searcher.for_workdir(self.workdir, self.key, metric, device=device,
                                        nprobe=nprobe, rerank=0.0)
        caches = {}
        for split in EVAL_SPLITS:
            sims, ids = searcher.search(self.queries(split), self.K)
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


def run_ablations(stage: AblationConfig, workdir: Workdir, keys: list[str], metric: str,
                  scores: str, grid: tuple, out_dir: Path) -> dict:
    """The ablation table and curves from the pipeline's kNN caches (``scores`` scores) of
    ``keys`` under ``metric``; the first key is the one every other row uses. Rows are labelled
    by what their caches' manifests say was searched (``row_label``); ``skipped`` lists the rows
    not scored and why (the same computation as a row above, or an index with exact scores)."""
    primary = keys[0]

    cached = {key: {s: open_knn_cache(workdir.knn_cache(key, metric, scores, s))
                    for s in EVAL_SPLITS} for key in keys}                # (manifest, arrays)

    def facts_of(key: str) -> dict:
        per_split = {s: search_facts(manifest, workdir) for s, (manifest, _) in cached[key].items()}
        if per_split["valid"] != per_split["test"]:  # one label must describe both splits
            raise ArtifactError(f"The valid and test kNN caches of key {key} come from different "
                                f"searches ({per_split['valid']} vs {per_split['test']}): rebuild "
                                f"them (--rebuild=[neighbors,knn_cache]).")
        return per_split["test"]

    K = int(cached[primary]["valid"][1]["sims"].shape[1])
    ev = Evaluator(workdir, primary, stage, grid, K)
    n = {s: len(ev.splits[s]["targets"]) for s in ev.splits}

    def sliced(key: str) -> dict:
        return {s: {name: np.asarray(a[: n[s]]) for name, a in arrays.items()}
                for s, (_, arrays) in cached[key].items()}

    rows: list[dict[str, Any]] = [
        {"row": report_label(BASE),  # the report's base row, on the same prefix
         "test_ppl": ppl_from_logprobs(ev.splits["test"]["lm_logprob"]),
         "valid_ppl": ppl_from_logprobs(ev.splits["valid"]["lm_logprob"])}]
    skipped: list[dict] = []

    def add(label: str, caches: Callable[[], dict], row_grid: Optional[tuple] = None,
            same: str = "") -> None:
        """Score the row unless a row above has its label (the same computation): then record
        ``same``, why, instead. ``caches`` is called only when the row is scored."""
        if any(r["row"] == label for r in rows):
            skipped.append({"row": label, "why": same or "the same computation as the row above"})
            return
        rows.append({"row": label, **ev.score(caches(), row_grid)})

    facts = {key: facts_of(key) for key in keys}
    for key in keys:  # Xu et al. Table 1: which representation is the key
        add(row_label(key, metric, facts[key]), partial(sliced, key))
    mine = facts[primary]
    add(row_label(primary, metric, {**mine, "scores_are_exact": True}),
        lambda: ev.rescored(metric),
        same="the pipeline's scores are exact already: recomputing them is its row above")
    # §5.1's "FAISS score": the index's own scores, searched as the neighbours were but without
    # re-ranking (re-ranked neighbours have exact scores); the index exists for either backend.
    index = read_manifest(workdir.index(primary, metric), kind="index")
    approx = {"backend": "index", "factory": index["factory"], "rerank": 0.0,
              "nprobe": int(mine["nprobe"] if mine["backend"] == "index" and mine["nprobe"]
                            else index.get("nprobe", 1)),
              "scores_are_exact": exact_score_index(index["factory"])}
    if approx["scores_are_exact"]:  # the row that is not there: index scores
        skipped.append({"row": row_label(primary, metric, {**approx, "scores_are_exact": False}),
                        "why": f"the index {index['factory']} holds the keys uncompressed: its "
                               f"scores are exact"})
    else:
        add(row_label(primary, metric, approx), lambda: ev.approximate(metric, approx["nprobe"]),
            same="the pipeline's row above is this search")
    exact_facts = {"backend": "exact", "factory": "exact", "nprobe": None, "rerank": None,
                   "scores_are_exact": True}
    for m in stage.metrics:  # the similarity function, on exact neighbours
        m_grid = grid if m == "cos" else (grid[0], stage.unbounded_temperatures, grid[2])
        add(row_label(primary, m, exact_facts), partial(ev.exact, m), m_grid,
            same="the pipeline's neighbours are exact: its row above")

    ks, ts, ls = grid
    pipeline_caches = sliced(primary)
    temperature_curve = [{"temperature": t, **ev.score(pipeline_caches, (ks, [t], ls))}
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
    return {"version": ABLATIONS_VERSION, "tokens": n, "key": primary, "rows": rows,
            "skipped": skipped, "temperature_curve": temperature_curve,
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


def memory_rows(workdir: Workdir, name: str) -> list[dict]:
    """Transformer-XL short-term memory on and off: the memory LM trained as ``name`` on its
    test split, served as contiguous segments of parallel streams; the memory is carried, or
    dropped."""
    import pytorch_lightning as pl

    from datamodules.lm import LMDataModule

    ckpt = workdir.model(name) / "model.ckpt"
    model = load_language_model(ckpt)
    data = LMDataModule(**{**datamodule_args(ckpt), "workdir": str(workdir.root),
                           "segments": True})
    model.check_vocabulary(data.vocab_fingerprint, f"the tokens in {workdir.tokens}")
    rows = []
    for length in (model.memory_length, 0):
        if length != model.memory_length:  # the same weights, read with another memory
            model = load_language_model(ckpt, {"memory_length": length})
        trainer = pl.Trainer(accelerator="auto", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        (metrics,) = trainer.test(model, datamodule=data, verbose=False)
        protocol = data.scoring_protocol(length)
        tokens = int(metrics["test/tokens"])
        rows.append({"row": f"Transformer-XL base LM, memory "
                            f"{f'M = {length}' if length else 'off'}",
                     "test_ppl": float(metrics["test/ppl"]), "tokens": tokens,
                     "segment": data.hparams["block_size"], "protocol": protocol,
                     "mean_left_context": float(protocols.left_context(protocol, tokens).mean())})
    return rows


def load_language_model(ckpt: str | Path, hparams: Optional[dict] = None):
    """A ``gnnlm.lit.lm.LanguageModel`` from a checkpoint, read as plain data."""
    from gnnlm.lit.lm import LanguageModel

    checkpoint = load_checkpoint(ckpt)
    saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items()
             if not k.startswith("_")}
    model = LanguageModel(**{**saved, **(hparams or {})})
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()

