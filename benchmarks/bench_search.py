"""Search speed as ratios: our Searcher vs raw faiss on the same index, exact torch vs IndexFlatIP.

    python benchmarks/bench_search.py                          # 200k x 128 keys, 20k queries
    python benchmarks/bench_search.py --n 20000 --queries 2000 --factory IVF128,PQ32x8np

Writes a synthetic clustered datastore as a real features artifact into a temporary folder,
builds the index with ``gnnlm.retrieval.index.build_index`` and times:

1. ``Searcher.search`` (float16 -> float32, normalisation, -inf padding) vs ``index.search`` on
   the very same faiss index with the same nprobe: the wrapper's overhead (ratio ~1 is the goal);
2. ``exact_search`` (torch matmul + top-k over the float16 memmap) vs faiss ``IndexFlatIP`` over
   the same keys in float32, with the share of identical ids.
"""
from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.search import Searcher, exact_search
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir


def synthetic_keys(n: int, d: int, centres: int, seed: int, rank: int = 8) -> np.ndarray:
    """Points around fixed random centres, each cluster spread along its own rank-8 subspace
    (LM features vary along few directions per context type); ``seed`` draws the points."""
    fixed = np.random.default_rng(0)
    c = fixed.standard_normal((centres, d)).astype(np.float32)
    basis = 0.3 * fixed.standard_normal((centres, rank, d)).astype(np.float32)
    rng = np.random.default_rng(seed + 1)
    x = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, 65536):  # bounded temporaries
        label = rng.integers(0, centres, min(65536, n - start))
        z = rng.standard_normal((len(label), rank)).astype(np.float32)
        x[start:start + len(label)] = (c[label] + np.einsum("nr,nrd->nd", z, basis[label])
                                       + 0.05 * rng.standard_normal((len(label), d)))
    return x


def write_features(path: Path, x: np.ndarray, split: str = "train") -> None:
    n, d = x.shape
    builder = ArtifactBuilder(path, kind="features", config={"split": split}, inputs={
        "base_lm": "synthetic", "data": hashlib.sha256(x[:1000].tobytes()).hexdigest()[:16]})
    with builder:
        for key in ("final", "att"):
            builder.array(key, np.float16, (n, d))[:] = x
        builder.array("targets", np.int32, (n,))[:] = 0
        builder.finish(extra={"n": n, "dim": d, "keys": ["final", "att"],
                              "base_lm": {"name": "synthetic", "fingerprint": "none"}})


def rate(fn, n_items: int, repeat: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return n_items * repeat / (time.perf_counter() - t0), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="datastore size")
    parser.add_argument("--d", type=int, default=128, help="key dimension")
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--exact-queries", type=int, default=2_000,
                        help="queries for the exact comparison (it costs n·d per query)")
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--factory", default="IVF1024,PQ32x8np")
    parser.add_argument("--nprobe", type=int, default=8)
    parser.add_argument("--metric", default="ip", choices=["cos", "ip", "l2"])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    print(f"inputs: n={args.n} d={args.d} queries={args.queries} exact_queries="
          f"{args.exact_queries} k={args.k} factory={args.factory} nprobe={args.nprobe} "
          f"metric={args.metric} faiss={faiss.__version__} faiss_threads="
          f"{faiss.omp_get_max_threads()} torch_threads={torch.get_num_threads()}")
    keys = synthetic_keys(args.n, args.d, centres=max(1, args.n // 1000), seed=0)
    queries = synthetic_keys(args.queries, args.d, centres=max(1, args.n // 1000), seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        workdir = Workdir(tmp)
        write_features(workdir.features("train"), keys)
        # held-out queries for the index's recall measurement (never the train keys themselves)
        write_features(workdir.features("valid"), queries, split="valid")
        t0 = time.perf_counter()
        manifest = build_index(workdir, "final", args.metric, IndexConfig(
            factory=args.factory, recall_queries=500))
        print(f"index: {manifest['factory']} built in {time.perf_counter() - t0:.1f} s "
              f"(train {manifest['train_seconds']} s, add {manifest['add_seconds']} s), "
              f"recall {manifest['recall']}")

        # the same index and nprobe for both, no re-ranking: the wrapper's own cost
        searcher = Searcher.for_workdir(workdir, "final", args.metric, nprobe=args.nprobe,
                                        rerank=0)
        raw_queries = queries.copy()
        if args.metric == "cos":
            faiss.normalize_L2(raw_queries)  # what Searcher does before calling faiss
        ours, (our_sims, our_ids) = rate(lambda: searcher.search(queries, args.k),
                                         args.queries, args.repeat)
        raw, (raw_d, raw_ids) = rate(lambda: searcher.index.search(raw_queries, args.k),
                                     args.queries, args.repeat)
        print(f"Searcher.search: {ours:,.0f} q/s   faiss index.search: {raw:,.0f} q/s   "
              f"ratio ours/faiss = {ours / raw:.3f}   same ids: "
              f"{np.mean(our_ids == raw_ids):.4f}")

        n_exact = min(args.exact_queries, args.queries)
        exact_q = queries[:n_exact]
        memmap_keys = np.lib.format.open_memmap(tmp / "keys.npy", mode="w+", dtype=np.float16,
                                                shape=keys.shape)
        memmap_keys[:] = keys
        flat = faiss.IndexFlatIP(args.d)
        flat.add(keys.astype(np.float16).astype(np.float32))
        torch_rate, (_, torch_ids) = rate(
            lambda: exact_search(memmap_keys, exact_q, args.k, "ip"), n_exact, 1)
        flat_rate, (_, flat_ids) = rate(lambda: flat.search(exact_q, args.k), n_exact, 1)
        print(f"exact torch (float16 memmap): {torch_rate:,.0f} q/s   faiss IndexFlatIP "
              f"(float32 in RAM): {flat_rate:,.0f} q/s   ratio torch/faiss = "
              f"{torch_rate / flat_rate:.3f}   same ids: {np.mean(torch_ids == flat_ids):.4f}")


if __name__ == "__main__":
    main()
