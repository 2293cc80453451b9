"""The kNN-LM sweep report (Khandelwal et al. 2020): λ × T × k chosen on valid from cached
scores, reported on test.

``sweep_caches`` reads a valid and a test kNN cache (built by ``gnnlm.retrieval.knn_cache``),
evaluates the whole grid on valid in one vectorised sweep, picks the point with the lowest valid
perplexity and scores test at that point only (test never chooses anything): a ``Sweep``.
``write_sweep`` writes it into ``out_dir``:

- ``sweep.csv``: one row per grid point (k, temperature, lambda, valid_ppl);
- ``sweep.md``: the chosen point, base LM and kNN-LM perplexity on valid and test, the
  caches' neighbours and scores, and a note when T changes nothing (retrieval that does not
  discriminate: ``gnnlm.retrieval.sanity``);
- ``sweep_heatmap.png``: valid perplexity over λ × T at the chosen k;
- ``sweep.json``: ``Sweep.to_json()`` (machine-readable);

and logs the grid as a W&B table plus the best values to a run under ``out_dir/wandb`` (mode from
``WANDB_MODE``, offline by default: no account or network needed). ``run_sweep`` does both.
"""
from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, cast

import numpy as np

from gnnlm.pipeline.ablations import search_description
from gnnlm.retrieval.knn import (
    DEFAULT_LAMBDAS,
    base_perplexity,
    default_temperatures,
    evaluate,
    sweep,
)
from gnnlm.retrieval.knn_cache import open_knn_cache
from gnnlm.retrieval.sanity import TEMPERATURE_EFFECT_NOTE
from gnnlm.workdir.manifests import write_json_atomic

# what a sweep records of its caches' search (an index re-ranked exactly gives exact scores
# whatever ``scores`` says); caches from before these were recorded leave them None
CACHE_FIELDS = ("key", "metric", "scores", "K", "factory", "backend", "nprobe", "rerank",
                "scores_are_exact")
FILES = ("sweep.csv", "sweep.md", "sweep_heatmap.png", "sweep.json")


@dataclass
class Sweep:
    """The grid's valid perplexities ``valid_grid`` [k, T, λ] and the point chosen on valid
    (``k``, ``temperature``, ``lambda_``, at ``chosen`` in the grid) with its valid and test
    perplexity, beside the base LM's; ``cache``: what the valid cache records of its search
    (``CACHE_FIELDS``); ``on_grid_edge``: the axes whose best value is at an end of the grid
    (the optimum may lie beyond). ``files`` and ``wandb_dir`` are set when written
    (``write_sweep``)."""
    ks: list[int]
    temperatures: list[float]
    lambdas: list[float]
    valid_grid: np.ndarray
    chosen: tuple[int, int, int]
    k: int
    temperature: float
    lambda_: float
    valid_ppl: float
    test_ppl: float
    base_valid_ppl: float
    base_test_ppl: float
    valid_tokens: int
    test_tokens: int
    seconds: float
    cache: dict[str, Any]
    on_grid_edge: list[str]
    files: dict[str, str] = field(default_factory=dict)
    wandb_dir: Optional[str] = None

    @property
    def points(self) -> int:
        return int(self.valid_grid.size)

    @property
    def points_per_s(self) -> Optional[float]:
        return round(self.points / self.seconds, 2) if self.seconds > 0 else None

    def grid_rows(self) -> list[list]:
        """One ``[k, temperature, lambda, valid_ppl]`` per grid point (sweep.csv, W&B)."""
        return [[k, t, lam, float(self.valid_grid[a, b, c])]
                for a, k in enumerate(self.ks) for b, t in enumerate(self.temperatures)
                for c, lam in enumerate(self.lambdas)]

    def to_json(self) -> dict:
        """sweep.json: the chosen point, perplexities, sizes, speed, grid, cache and files."""
        return {"k": self.k, "temperature": self.temperature, "lambda": self.lambda_,
                "valid_ppl": self.valid_ppl, "test_ppl": self.test_ppl,
                "base_valid_ppl": self.base_valid_ppl, "base_test_ppl": self.base_test_ppl,
                "points": self.points, "valid_tokens": self.valid_tokens,
                "test_tokens": self.test_tokens, "seconds": round(self.seconds, 4),
                "points_per_s": self.points_per_s,
                "grid": {"k": self.ks, "temperature": self.temperatures,
                         "lambda": self.lambdas},
                "cache": self.cache, "on_grid_edge": self.on_grid_edge, "files": self.files,
                "wandb_dir": self.wandb_dir}


def _as_cache(cache: Any) -> tuple[dict, Any]:
    """A cache folder, or a mapping of arrays (nothing recorded about it)."""
    if isinstance(cache, (str, os.PathLike)):
        return open_knn_cache(cache)
    return {}, cache


def _check_same_setup(valid_manifest: dict, test_manifest: dict) -> None:
    if not valid_manifest or not test_manifest:
        return  # arrays given directly: nothing recorded to compare
    for name in ("key", "metric", "scores", "K", "base_lm"):
        if valid_manifest.get(name) != test_manifest.get(name):
            raise ValueError(
                f"The valid and test caches differ in {name} (valid "
                f"{valid_manifest.get(name)!r}, test {test_manifest.get(name)!r}): hyper-"
                f"parameters chosen on one do not transfer to the other. Build both the same way.")


def sweep_caches(valid_cache: Any, test_cache: Any, ks: Sequence[int],
                 temperatures: Optional[Sequence[float]] = None,
                 lambdas: Sequence[float] = DEFAULT_LAMBDAS) -> Sweep:
    """Sweep on valid, score test at the valid-chosen point.

    ``valid_cache``/``test_cache`` are cache folders or mappings of arrays. Every k must be at
    most the caches' K (an error otherwise: a larger k cannot be served). ``temperatures``
    defaults to the grid for the caches' similarity (``gnnlm.retrieval.knn.default_temperatures``).
    """
    valid_manifest, valid = _as_cache(valid_cache)
    test_manifest, test = _as_cache(test_cache)
    _check_same_setup(valid_manifest, test_manifest)
    ks = sorted({int(k) for k in ks})
    if temperatures is None:
        temperatures = default_temperatures(valid_manifest.get("metric", "cos"))
    ts, lams = [float(t) for t in temperatures], [float(x) for x in lambdas]

    t0 = time.perf_counter()
    grid = sweep(valid, ks, ts, lams)                                   # [nk, nT, nλ]
    seconds = time.perf_counter() - t0
    i, j, n = (int(x) for x in np.unravel_index(int(np.argmin(grid)), grid.shape))
    # A best value on the edge of its axis may lie beyond the grid (λ = 0: the kNN part does
    # not help at all).
    on_edge = [name for name, values, idx in (("k", ks, i), ("temperature", ts, j),
                                              ("lambda", lams, n))
               if len(values) > 1 and idx in (0, len(values) - 1)]
    return Sweep(ks=ks, temperatures=ts, lambdas=lams, valid_grid=grid, chosen=(i, j, n),
                 k=ks[i], temperature=ts[j], lambda_=lams[n], valid_ppl=float(grid[i, j, n]),
                 test_ppl=evaluate(test, ks[i], ts[j], lams[n]),
                 base_valid_ppl=base_perplexity(valid), base_test_ppl=base_perplexity(test),
                 valid_tokens=int(len(valid["lm_logprob"])),
                 test_tokens=int(len(test["lm_logprob"])), seconds=seconds,
                 cache={f: valid_manifest.get(f) for f in CACHE_FIELDS}, on_grid_edge=on_edge)


def write_sweep(result: Sweep, out_dir: str | Path, *, use_wandb: bool = True,
                wandb_project: str = "gnnlm", wandb_name: str | None = None) -> None:
    """sweep.csv, sweep_heatmap.png, sweep.md, the W&B run (``use_wandb``) and sweep.json in
    ``out_dir``; sets ``result.files`` and ``result.wandb_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result.grid_rows()
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["k", "temperature", "lambda", "valid_ppl"])
        writer.writerows(rows)
    heatmap = out_dir / "sweep_heatmap.png"
    i, j, n = result.chosen
    write_heatmap(heatmap, result.valid_grid[i], result.temperatures, result.lambdas, result.k,
                   (j, n), result.base_valid_ppl)
    (out_dir / "sweep.md").write_text(_markdown(result))
    result.files = {name: str(out_dir / name) for name in FILES}
    result.wandb_dir = (_log_wandb(out_dir, rows, result, heatmap, wandb_name, wandb_project,
                                   {"ks": result.ks, "temperatures": result.temperatures,
                                    "lambdas": result.lambdas, **result.cache})
                        if use_wandb else None)
    write_json_atomic(out_dir / "sweep.json", result.to_json())


def run_sweep(valid_cache: Any, test_cache: Any, out_dir: str | Path, ks: Sequence[int],
              temperatures: Optional[Sequence[float]] = None,
              lambdas: Sequence[float] = DEFAULT_LAMBDAS, *, use_wandb: bool = True,
              wandb_project: str = "gnnlm", wandb_name: str | None = None) -> Sweep:
    """``sweep_caches``, then ``write_sweep`` into ``out_dir``."""
    result = sweep_caches(valid_cache, test_cache, ks, temperatures, lambdas)
    write_sweep(result, out_dir, use_wandb=use_wandb, wandb_project=wandb_project,
                wandb_name=wandb_name)
    return result


def _markdown(result: Sweep) -> str:
    cache = result.cache
    edge = result.on_grid_edge
    return (
        f"# kNN-LM sweep\n\n"
        f"Chosen on valid ({result.valid_tokens} tokens) over {result.points} points "
        f"(k ∈ {result.ks}, T ∈ {result.temperatures}, λ ∈ {result.lambdas}); key "
        f"{cache['key']}, {cache['metric']}: {searched(cache)}.\n\n"
        f"| | k | T | λ | valid ppl | test ppl |\n|---|---|---|---|---|---|\n"
        f"| base LM | | | 0 | {result.base_valid_ppl:.3f} | {result.base_test_ppl:.3f} |\n"
        f"| kNN-LM | {result.k} | {result.temperature:g} | {result.lambda_:g} | "
        f"{result.valid_ppl:.3f} | {result.test_ppl:.3f} |\n\n"
        + (f"Note: the best {', '.join(edge)} lies on the edge of the grid; widen it to be sure "
           f"of the optimum.\n\n" if edge else "")
        + _temperature_note(result)
        + f"Sweep speed: {result.points_per_s} points/s. Grid: `sweep.csv`; λ × T at k = "
        f"{result.k}: `sweep_heatmap.png`.\n")


def _temperature_note(result: Sweep) -> str:
    """A note when T changes valid perplexity by almost nothing at the chosen k and λ: the
    neighbours' similarities do not differ, and kNN-LM's gain is not retrieval
    (``gnnlm.retrieval.sanity``)."""
    by_t = result.valid_grid[result.chosen[0], :, result.chosen[2]]
    if len(by_t) < 2 or result.lambda_ == 0:
        return ""
    effect = float((by_t.max() - by_t.min()) / by_t.min())
    if effect >= TEMPERATURE_EFFECT_NOTE:
        return ""
    return (f"Note: T changes valid perplexity by {effect:.2%} at k = {result.k}, λ = "
            f"{result.lambda_:g}: the neighbours' similarities barely differ, so the kNN part "
            f"smooths rather than retrieves (every row of the heatmap alike). Likely cause: an "
            f"under-trained base LM whose keys all point the same way; see the report's "
            f"retrieval warning.\n\n")


def searched(cache: dict) -> str:
    """The caches' neighbours and scores in the words of results.md and the printed table
    (``gnnlm.pipeline.ablations.search_description``); the cache's own ``knn.scores`` setting
    beside them, since "faiss" scores from a re-ranked search are exact."""
    if cache.get("scores_are_exact") is None:  # arrays given directly, or an old cache
        return f"{cache.get('scores')} scores (what was searched is not recorded)"
    return f"{search_description(cache)} (knn.scores: {cache['scores']})"


def write_heatmap(path: Path, grid_at_k: np.ndarray, temperatures: Sequence[float],
                   lambdas: Sequence[float], k: int, best: tuple[int, int],
                   base_ppl: float) -> None:
    # The object API with an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 + 0.45 * len(lambdas), 1.2 + 0.4 * len(temperatures)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shown = np.where(np.isfinite(grid_at_k), grid_at_k, np.nan)        # [T, λ]
    # Points worse than the base LM (large λ, extreme T) would stretch the colour scale over
    # hundreds of perplexity points and flatten the region that matters: clip them at the base.
    top = min(np.nanmax(shown), base_ppl) if np.isfinite(base_ppl) else np.nanmax(shown)
    image = ax.imshow(shown, aspect="auto", origin="lower", cmap="viridis_r",
                      vmin=np.nanmin(shown), vmax=max(top, np.nanmin(shown) + 1e-6))
    ax.set_xticks(range(len(lambdas)), [f"{x:g}" for x in lambdas], rotation=90)
    ax.set_yticks(range(len(temperatures)), [f"{x:g}" for x in temperatures])
    ax.set_xlabel("λ")
    ax.set_ylabel("temperature T")
    ax.plot(best[1], best[0], marker="*", color="red", markersize=12)
    ax.annotate(f"{grid_at_k[best]:.2f}", (best[1], best[0]), color="red",
                xytext=(6, 6), textcoords="offset points")
    ax.set_title(f"kNN-LM valid perplexity at k = {k} (★ chosen; ≥ base LM clipped)")
    fig.colorbar(image, ax=ax, label="valid perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _log_wandb(out_dir: Path, rows: list[list], result: Sweep, heatmap: Path,
               name: str | None, project: str, config: dict) -> str | None:
    import wandb

    # W&B checks the mode itself and names the ones it knows
    mode = cast(Literal["online", "offline", "disabled", "shared"],
                os.environ.get("WANDB_MODE", "offline"))
    with wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, job_type="sweep",
                    config=config, reinit="finish_previous") as run:
        run.log({"sweep/grid": wandb.Table(columns=["k", "temperature", "lambda", "valid_ppl"],
                                           data=rows),
                 "sweep/heatmap": wandb.Image(str(heatmap))})
        run.summary.update({
            "best/k": result.k, "best/temperature": result.temperature,
            "best/lambda": result.lambda_, "val/ppl": result.valid_ppl,
            "test/ppl": result.test_ppl, "val/base_ppl": result.base_valid_ppl,
            "test/base_ppl": result.base_test_ppl})
        return str(Path(run.dir).parent)


def main(args: list[str]) -> Sweep:
    """``gnnlm sweep -c PIPELINE.yaml [--knn.k=... --knn.temperature=... --knn.lambda_=...]``:
    sweeps the kNN caches of the pipeline's primary key (built by ``gnnlm pipeline``) over the
    config's grid and writes reports/<name>/sweep/ (sweep.csv, sweep.md, sweep.json, the λ × T
    heatmap) and an offline W&B run; the single point a W&B agent pins goes to
    reports/<name>/sweep/<point>/, so agents never overwrite each other's files."""
    from gnnlm.pipeline.config import check_built, load_config
    from gnnlm.workdir.layout import Workdir
    from gnnlm.workdir.lock import lock_workdir

    cfg = load_config(args, prog="gnnlm sweep", description=main.__doc__)
    knn = cfg.knn
    ks, temperatures, lambdas = knn.grid()
    workdir = Workdir(cfg.root)
    caches = [workdir.knn_cache(knn.primary, knn.metric, knn.scores, split)
              for split in ("valid", "test")]
    check_built("gnnlm sweep", args, caches)  # before the lock and the report folder exist
    out = workdir.report(cfg.name) / "sweep"
    pinned = [f"{name}={value:g}" for name, value in
              (("k", knn.k), ("T", knn.temperature), ("lambda", knn.lambda_)) if value is not None]
    if pinned:
        out = out / ",".join(pinned)
    valid, test = caches
    with lock_workdir(workdir.root, "sweep", shared=bool(pinned)):  # agents' points: shared
        result = run_sweep(valid, test, out, ks, temperatures, lambdas, wandb_name=f"{cfg.name}"
                           f"-sweep" + (f"-{','.join(pinned)}" if pinned else ""))
    print(f"best on valid: k={result.k} T={result.temperature} λ={result.lambda_}  "
          f"valid ppl {result.valid_ppl:.2f} (base {result.base_valid_ppl:.2f}), "
          f"test ppl {result.test_ppl:.2f} (base {result.base_test_ppl:.2f}); "
          f"{result.points} points at {result.points_per_s or 0:.0f} points/s")
    return result
