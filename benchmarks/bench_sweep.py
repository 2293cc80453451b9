"""kNN-LM sweep and evaluation speed from a cache, as ratios.

    python benchmarks/bench_sweep.py                     # N = 200k tokens, K = 256 neighbours
    python benchmarks/bench_sweep.py --n 20000 --K 128

On a synthetic in-RAM cache (sorted similarities, ~15% hits) it times:

1. ``gnnlm.retrieval.knn.sweep`` over the whole k × T × λ grid (points/s), against evaluating the
   same grid point by point with ``knn_logprob`` + ``interpolate`` (on a sample of points; ratio);
2. a kNN-LM evaluation at one point, ``knn_lm_logprob`` (tokens/s), against copying the
   cache's sims and hits it reads (the memory-bound floor).
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch

from gnnlm.retrieval.knn import evaluate, knn_lm_logprob, sweep


def synthetic_cache(n: int, K: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sims = -np.sort(rng.exponential(1.0, (n, K)).astype(np.float32), axis=1)
    hits = rng.random((n, K), dtype=np.float32) < np.linspace(0.3, 0.05, K, dtype=np.float32)
    lm = np.log(rng.uniform(0.001, 0.5, n)).astype(np.float32)
    return {"sims": sims, "hits": hits, "lm_logprob": lm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="tokens in the cache")
    parser.add_argument("--K", type=int, default=256, help="neighbours per token")
    parser.add_argument("--pointwise", type=int, default=12,
                        help="grid points timed one by one for the ratio")
    args = parser.parse_args()
    ks = [k for k in (8, 16, 32, 64, 128, 256, 512, 1024) if k <= args.K]
    temps = [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
    lams = [round(x, 2) for x in np.arange(0.0, 0.75, 0.05)]
    points = len(ks) * len(temps) * len(lams)
    print(f"inputs: N={args.n} K={args.K} grid={len(ks)}k x {len(temps)}T x {len(lams)}λ = "
          f"{points} points, torch_threads={torch.get_num_threads()}")
    cache = synthetic_cache(args.n, args.K)

    t0 = time.perf_counter()
    grid = sweep(cache, ks, temps, lams)
    sweep_s = time.perf_counter() - t0
    sample = list(itertools.product(ks, temps, lams))[:: max(1, points // args.pointwise)]
    t0 = time.perf_counter()
    for k, t, lam in sample:
        evaluate(cache, k, t, lam)
    point_s = (time.perf_counter() - t0) / len(sample)
    print(f"sweep: {points / sweep_s:,.1f} points/s ({sweep_s:.2f} s for the grid)   pointwise: "
          f"{1 / point_s:,.2f} points/s   ratio sweep/pointwise = {point_s * points / sweep_s:.1f}"
          f"   best valid ppl {grid.min():.3f}")

    k, t, lam = ks[-1], 1.0, 0.25
    t0 = time.perf_counter()
    knn_lm_logprob(cache, k, t, lam)
    eval_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.array(cache["sims"][:, :k]), np.array(cache["hits"][:, :k])
    copy_s = time.perf_counter() - t0
    print(f"kNN-LM evaluation at k={k}, T={t}, λ={lam}: {args.n / eval_s:,.0f} tokens/s   "
          f"copying its inputs alone: {args.n / copy_s:,.0f} tokens/s   ratio eval/copy = "
          f"{copy_s / eval_s:.3f}")

if __name__ == "__main__":
    main()
