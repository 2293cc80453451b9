"""How index building and search grow with the datastore: synthetic clustered keys at 1M, 4M and
16M (d = 128 and 256), through the library's own index stage (``factory: auto``), on this
machine. The fits extrapolate to WikiText-103 (103M train tokens).

    python benchmarks/bench_scale.py                       # 1M, 4M, 16M x d 128, 256
    python benchmarks/bench_scale.py --sizes 1e6 4e6 --dims 128 --root /tmp/scale
    python benchmarks/bench_scale.py --code-budget-gb 0       # IVF-PQ, as for WikiText-103

Per (N, d) it prints: the factory and search settings the ``auto`` rule chose, index train and
add time, search queries/s at k = 128 with the chosen settings and the recall@10 they reach
against exact search, peak RAM of the build (the process's peak RSS) and disk (fp16 keys and
the index file). Then, per quantity, the power law t = a·N^b fitted over the sizes, and its
value at N = 103M.

Keys are sums of a cluster centre, a low-rank within-cluster spread and noise, written in
chunks to a float16 memmap (a datastore as the features stage writes it), so a size that does
not fit in RAM as float32 still builds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np

from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.search import Searcher, exact_search, recall_at
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir

WIKITEXT103 = 103_227_021


def peak_rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def write_split(workdir: Workdir, split: str, keys: np.ndarray) -> None:
    builder = ArtifactBuilder(workdir.features(split), kind="features",
                              config={"split": split, "n": len(keys)},
                              inputs={"base_lm_fingerprint": "synthetic"})
    with builder:
        builder.array("final", np.float16, keys.shape)[:] = keys
        builder.array("targets", np.int32, (len(keys),))
        builder.finish(extra={"n": len(keys), "dim": keys.shape[1], "keys": ["final"],
                              "base_lm": {"name": "synthetic", "fingerprint": "synthetic"}})


def write_keys(workdir: Workdir, n: int, d: int, seed: int, chunk: int = 1 << 20) -> np.ndarray:
    """A train features artifact of n clustered float16 keys, and 2,000 held-out queries from
    the same distribution as the valid split (the index stage tunes its search on them)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // 2000), d)).astype(np.float32)
    basis = 0.35 * rng.standard_normal((len(centres), 8, d)).astype(np.float32)

    def sample(m: int, gen) -> np.ndarray:
        label = gen.integers(0, len(centres), m)
        z = gen.standard_normal((m, 8)).astype(np.float32)
        x = centres[label] + np.einsum("nr,nrd->nd", z, basis[label])
        return (x + 0.1 * gen.standard_normal((m, d)).astype(np.float32)).astype(np.float16)

    builder = ArtifactBuilder(workdir.features("train"), kind="features",
                              config={"split": "train", "n": n, "d": d, "seed": seed},
                              inputs={"base_lm_fingerprint": "synthetic"})
    with builder:
        final = builder.array("final", np.float16, (n, d))
        for start in range(0, n, chunk):
            final[start:start + chunk] = sample(min(chunk, n - start), rng)
        builder.array("targets", np.int32, (n,))
        builder.finish(extra={"n": n, "dim": d, "keys": ["final"],
                              "base_lm": {"name": "synthetic", "fingerprint": "synthetic"}})
    queries = sample(2000, np.random.default_rng(seed + 1))
    write_split(workdir, "valid", queries)
    return queries.astype(np.float32)


def measure(root: Path, n: int, d: int, config: IndexConfig) -> dict:
    workdir = Workdir(root / f"n{n}-d{d}")
    if workdir.root.exists():
        shutil.rmtree(workdir.root)
    queries = write_keys(workdir, n, d, seed=n + d)
    reset_peak_rss()
    t0 = time.perf_counter()
    manifest = build_index(workdir, "final", "cos", config)
    build_seconds = time.perf_counter() - t0
    peak = peak_rss_mib()
    searcher = Searcher.for_workdir(workdir, "final", "cos", device="cpu")
    searcher.search(queries[:16], 128)                                 # loads the re-rank keys
    t0 = time.perf_counter()
    _, ids = searcher.search(queries, 128)
    qps = len(queries) / (time.perf_counter() - t0)
    keys = np.memmap(workdir.features("train") / "final.bin", np.float16, "r", shape=(n, d))
    _, exact = exact_search(keys, queries[:500], 10, "cos")
    recall = recall_at(ids[:500], exact, 10)
    disk = {"keys_gb": (workdir.features("train") / "final.bin").stat().st_size / 1e9,
            "index_gb": sum(f.stat().st_size for f in workdir.index("final", "cos").iterdir())
            / 1e9}
    row = {"n": n, "d": d, "factory": manifest["factory"], "nprobe": manifest["nprobe"],
           "rerank": manifest.get("rerank"), "train_s": manifest["train_seconds"],
           "add_s": manifest["add_seconds"], "build_s": build_seconds, "search_qps": qps,
           "recall10": recall, "peak_rss_gb": peak / 1024, **disk}
    shutil.rmtree(workdir.root)
    return row


def power_law(ns: list[int], values: list[float]) -> tuple[float, float]:
    """(a, b) of values ≈ a·N^b, least squares in log-log."""
    b, log_a = np.polyfit(np.log(ns), np.log(values), 1)
    return float(np.exp(log_a)), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 4e6, 16e6])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--root", default="runs/bench_scale")
    parser.add_argument("--code-budget-gb", type=float, default=IndexConfig.code_budget_gb,
                        help="index.code_budget_gb: 0 makes the auto rule choose IVF-PQ at every "
                             "size, as it does for WikiText-103's 103M x 512 keys")
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores; keys in {root}; the auto rule's index, k = 128 searches")
    header = (f"{'N':>10} {'d':>4} {'factory':<34} {'nprobe':>6} {'rerank':>6} {'train s':>8} "
              f"{'add s':>7} {'q/s':>7} {'R@10':>5} {'RAM GB':>7} {'keys GB':>8} {'index GB':>8}")
    for d in args.dims:
        rows = []
        print(header)
        for n in (int(s) for s in args.sizes):
            row = measure(root, n, d, IndexConfig(code_budget_gb=args.code_budget_gb))
            rows.append(row)
            print(f"{n:>10,} {d:>4} {row['factory']:<34} {row['nprobe']:>6} "
                  f"{str(row['rerank']):>6} {row['train_s']:>8.1f} {row['add_s']:>7.1f} "
                  f"{row['search_qps']:>7,.0f} {row['recall10']:>5.2f} "
                  f"{row['peak_rss_gb']:>7.2f} {row['keys_gb']:>8.2f} {row['index_gb']:>8.2f}",
                  flush=True)
        if len(rows) >= 2:
            ns = [r["n"] for r in rows]
            print(f"fits over N (d = {d}), t = a·N^b, and the value at N = 103M:")
            for name, key, per in (("add s", "add_s", 1), ("search s per 1M queries",
                                                            "search_qps", -1),
                                   ("peak RAM GB", "peak_rss_gb", 1),
                                   ("index GB", "index_gb", 1)):
                values = [r[key] if per == 1 else 1e6 / r[key] for r in rows]
                a, b = power_law(ns, values)
                print(f"  {name:<24} b = {b:.2f}   at 103M: {a * WIKITEXT103 ** b:,.1f}")


if __name__ == "__main__":
    main()
