"""The kNN-LM sweep report: λ × T × k chosen on valid from cached scores, reported on test.

``run_sweep`` reads a valid and a test kNN cache (``gnnlm.retrieval.knn.build_knn_cache``),
evaluates the whole grid on valid in one vectorised sweep, picks the point with the lowest valid
perplexity, scores test at that point only (test never chooses anything), and writes into
``out_dir``:

- ``sweep.csv``: one row per grid point (k, temperature, lambda, valid_ppl);
- ``sweep.md``: the chosen point, base LM and kNN-LM perplexity on valid and test;
- ``sweep_heatmap.png``: valid perplexity over λ × T at the chosen k;
- ``sweep.json``: the returned dict (machine-readable);

and logs the grid as a W&B table plus the best values to a run under ``out_dir/wandb`` (mode from
``WANDB_MODE``, offline by default: no account or network needed).
"""
from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.retrieval.knn import (
    DEFAULT_LAMBDAS,
    base_perplexity,
    default_temperatures,
    evaluate,
    sweep,
)
from gnnlm.retrieval.knn_cache import open_knn_cache
from gnnlm.workdir.artifacts import write_json_atomic


def _as_cache(cache: Any) -> tuple[dict, Any]:
    """A cache folder, or a mapping of arrays (nothing recorded about it)."""
    if isinstance(cache, (str, os.PathLike)):
        return open_knn_cache(cache)
    return {}, cache


def _check_same_setup(valid_manifest: dict, test_manifest: dict) -> None:
    if not valid_manifest or not test_manifest:
        return  # arrays given directly: nothing recorded to compare
    for field in ("key", "metric", "scores", "K", "base_lm"):
        if valid_manifest.get(field) != test_manifest.get(field):
            raise ValueError(
                f"The valid and test caches differ in {field} (valid "
                f"{valid_manifest.get(field)!r}, test {test_manifest.get(field)!r}): hyper-"
                f"parameters chosen on one do not transfer to the other. Build both the same way.")


def _write_heatmap(path: Path, grid_at_k: np.ndarray, temperatures: Sequence[float],
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


def _log_wandb(out_dir: Path, rows: list[list], result: dict, heatmap: Path, name: str | None,
               project: str, config: dict) -> str | None:
    import wandb

    mode = os.environ.get("WANDB_MODE", "offline")
    with wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, job_type="sweep",
                    config=config, reinit="finish_previous") as run:
        run.log({"sweep/grid": wandb.Table(columns=["k", "temperature", "lambda", "valid_ppl"],
                                           data=rows),
                 "sweep/heatmap": wandb.Image(str(heatmap))})
        run.summary.update({
            "best/k": result["k"], "best/temperature": result["temperature"],
            "best/lambda": result["lambda"], "val/ppl": result["valid_ppl"],
            "test/ppl": result["test_ppl"], "val/base_ppl": result["base_valid_ppl"],
            "test/base_ppl": result["base_test_ppl"]})
        return str(Path(run.dir).parent)


def run_sweep(valid_cache: Any, test_cache: Any, out_dir: str | Path, ks: Sequence[int],
              temperatures: Optional[Sequence[float]] = None,
              lambdas: Sequence[float] = DEFAULT_LAMBDAS, *, use_wandb: bool = True,
              wandb_project: str = "gnnlm", wandb_name: str | None = None) -> dict:
    """Sweep on valid, report test at the valid-chosen point; returns the summary dict.

    ``valid_cache``/``test_cache`` are cache folders or mappings of arrays. Every k must be at
    most the caches' K (an error otherwise: a larger k cannot be served). ``temperatures``
    defaults to the grid for the caches' similarity (``gnnlm.retrieval.knn.default_temperatures``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    valid_manifest, valid = _as_cache(valid_cache)
    test_manifest, test = _as_cache(test_cache)
    _check_same_setup(valid_manifest, test_manifest)
    ks = sorted({int(k) for k in ks})
    if temperatures is None:
        temperatures = default_temperatures(valid_manifest.get("metric", "cos"))
    temperatures, lambdas = [float(t) for t in temperatures], [float(x) for x in lambdas]

    t0 = time.perf_counter()
    grid = sweep(valid, ks, temperatures, lambdas)                     # [nk, nT, nλ]
    seconds = time.perf_counter() - t0
    i, j, n = np.unravel_index(int(np.argmin(grid)), grid.shape)
    best = {"k": ks[i], "temperature": temperatures[j], "lambda": lambdas[n]}
    result = {
        **best, "valid_ppl": float(grid[i, j, n]),
        "test_ppl": evaluate(test, best["k"], best["temperature"], best["lambda"]),
        "base_valid_ppl": base_perplexity(valid), "base_test_ppl": base_perplexity(test),
        "points": int(grid.size), "valid_tokens": int(len(valid["lm_logprob"])),
        "test_tokens": int(len(test["lm_logprob"])), "seconds": round(seconds, 4),
        "points_per_s": round(grid.size / seconds, 2) if seconds > 0 else None,
        "grid": {"k": ks, "temperature": temperatures, "lambda": lambdas},
        # what was searched (an index re-ranked exactly gives exact scores whatever ``scores``
        # says); caches from before these were recorded leave them None
        "cache": {f: valid_manifest.get(f) for f in ("key", "metric", "scores", "K", "factory",
                                                     "backend", "nprobe", "rerank",
                                                     "scores_are_exact")},
    }

    # A best value on the edge of its axis may lie beyond the grid (λ = 0: the kNN part does
    # not help at all).
    result["on_grid_edge"] = [name for name, values, idx in
                              (("k", ks, i), ("temperature", temperatures, j),
                               ("lambda", lambdas, n))
                              if len(values) > 1 and idx in (0, len(values) - 1)]

    rows = [[ks[a], temperatures[b], lambdas[c], float(grid[a, b, c])]
            for a in range(len(ks)) for b in range(len(temperatures)) for c in range(len(lambdas))]
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["k", "temperature", "lambda", "valid_ppl"])
        writer.writerows(rows)
    heatmap = out_dir / "sweep_heatmap.png"
    _write_heatmap(heatmap, grid[i], temperatures, lambdas, ks[i], (j, n),
                   result["base_valid_ppl"])
    cache = result["cache"]
    (out_dir / "sweep.md").write_text(
        f"# kNN-LM sweep\n\n"
        f"Chosen on valid ({result['valid_tokens']} tokens) over {result['points']} points "
        f"(k ∈ {ks}, T ∈ {temperatures}, λ ∈ {lambdas}); key {cache['key']}, metric "
        f"{cache['metric']}, {cache['scores']} scores, {cache['backend']} neighbours "
        f"({cache['factory']}).\n\n"
        f"| | k | T | λ | valid ppl | test ppl |\n|---|---|---|---|---|---|\n"
        f"| base LM | | | 0 | {result['base_valid_ppl']:.3f} | {result['base_test_ppl']:.3f} |\n"
        f"| kNN-LM | {best['k']} | {best['temperature']:g} | {best['lambda']:g} | "
        f"{result['valid_ppl']:.3f} | {result['test_ppl']:.3f} |\n\n"
        + (f"Note: the best {', '.join(result['on_grid_edge'])} lies on the edge of the grid; "
           f"widen it to be sure of the optimum.\n\n" if result["on_grid_edge"] else "")
        + f"Sweep speed: {result['points_per_s']} points/s. Grid: `sweep.csv`; λ × T at k = "
        f"{best['k']}: `sweep_heatmap.png`.\n")
    result["files"] = {name: str(out_dir / name) for name in
                       ("sweep.csv", "sweep.md", "sweep_heatmap.png", "sweep.json")}
    result["wandb_dir"] = (_log_wandb(out_dir, rows, result, heatmap, wandb_name, wandb_project,
                                      {"ks": ks, "temperatures": temperatures,
                                       "lambdas": lambdas, **cache})
                           if use_wandb else None)
    write_json_atomic(out_dir / "sweep.json", result)
    return result


def main(args: list[str]) -> dict:
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
    workdir = Workdir(cfg.workdir)
    caches = [workdir.knn_cache(knn.primary, knn.metric, knn.scores, split)
              for split in ("valid", "test")]
    check_built("gnnlm sweep", args, caches)  # before the lock and the report folder exist
    out = workdir.report(cfg.name) / "sweep"
    pinned = [f"{name}={value:g}" for name, value in
              (("k", knn.k), ("T", knn.temperature), ("lambda", knn.lambda_)) if value is not None]
    if pinned:
        out = out / ",".join(pinned)
    _lock = lock_workdir(workdir.root, "sweep", shared=bool(pinned))  # agents' points: shared
    result = run_sweep(*caches, out, ks, temperatures, lambdas,
                       wandb_name=f"{cfg.name}-sweep" + (f"-{','.join(pinned)}" if pinned else ""))
    print(f"best on valid: k={result['k']} T={result['temperature']} λ={result['lambda']}  "
          f"valid ppl {result['valid_ppl']:.2f} (base {result['base_valid_ppl']:.2f}), "
          f"test ppl {result['test_ppl']:.2f} (base {result['base_test_ppl']:.2f}); "
          f"{result['points']} points at {result['points_per_s']:.0f} points/s")
    return result
