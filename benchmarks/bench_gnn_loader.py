"""GNN-LM's DataLoader job at the GPU table's shape, on one CPU core: train batches whose window
features are decoded where the graphs are built, against batches that name the window nodes by
train position (as ``datamodules.graph`` builds them: the model reads the features on its
device, ``gnnlm.gnn.node_features``).

    python benchmarks/bench_gnn_loader.py --json out.json    # about a minute

The shapes are ``configs/wikitext2/pipeline.yaml`` and ``gnnlm.yaml``: 2,088,628 train
positions, K = 1,024 stored neighbours per token (random here), 8 blocks of 128 targets per
batch, windows l = r = 1, the leakage rule with C = 512, and PQ codes of 64 bytes for 512-d
features (random codes and codebooks, decoded by ``PQFeatures``: the cost does not depend on
their values). A batch is what one worker does: 8 graphs built, then batched. For each k it
prints both rates (tokens/s on one core), their ratio, the bytes each batch copies to the
device, and the workers each needs to feed GNN-LM's 10,700 tokens/s budget.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import Batch

from gnnlm.gnn.graph import build_graph
from gnnlm.gnn.pq import PQFeatures
from gnnlm.gnn.settings import GraphConfig

N_TRAIN, DIM, CODE_BYTES, K_STORED = 2_088_628, 512, 64, 1_024
BLOCK, BLOCKS_PER_BATCH, CONTEXT = 128, 8, 512
BUDGET_TOKENS_PER_S = 10_700   # GNN-LM's rate in the GPU table's budget (README, "On one GPU")


def random_pq(seed: int = 0) -> PQFeatures:
    """``PQFeatures`` over random codes and codebooks held in memory (no work directory)."""
    rng = np.random.default_rng(seed)
    pq = PQFeatures.__new__(PQFeatures)
    pq.codes = rng.integers(0, 256, (N_TRAIN, CODE_BYTES), dtype=np.uint8)
    pq.centroids = rng.standard_normal((CODE_BYTES, 256, DIM // CODE_BYTES)).astype(np.float32)
    pq.rotation = pq.bias = None
    pq.dim = DIM
    pq._subquantizer = np.arange(CODE_BYTES)[None, :]
    return pq


def batch_of_graphs(k: int, first: int, pq: PQFeatures | None, rng: np.random.Generator
                    ) -> Batch:
    """One batch as a worker builds it: its window features decoded when ``pq`` is given."""
    graphs = []
    for i in range(first, first + BLOCKS_PER_BATCH):
        positions = np.arange(i * BLOCK, (i + 1) * BLOCK) + CONTEXT
        ids = rng.integers(0, N_TRAIN, (BLOCK, K_STORED))
        graph = build_graph(positions, ids, N_TRAIN, GraphConfig(k=k), CONTEXT)
        if pq is not None:
            graph["nbr"].x = torch.from_numpy(pq(graph["nbr"].train_pos.numpy()))
        graph["ctx"].x = torch.zeros(BLOCK, DIM)
        graph["ctx"].y = torch.zeros(BLOCK, dtype=torch.long)
        graphs.append(graph)
    return Batch.from_data_list(graphs)


def rate(k: int, pq: PQFeatures | None, batches: int) -> tuple[float, float]:
    """(tokens/s on one core, MB a batch copies to the device), after one warm-up batch."""
    rng = np.random.default_rng(k)
    batch_of_graphs(k, 0, pq, rng)
    seconds = 0.0
    for b in range(batches):
        t0 = time.perf_counter()
        batch = batch_of_graphs(k, (b + 1) * BLOCKS_PER_BATCH, pq, rng)
        seconds += time.perf_counter() - t0
    copied = sum(v.numel() * v.element_size() for store in batch.stores
                 for v in store.values() if isinstance(v, torch.Tensor))
    return batches * BLOCKS_PER_BATCH * BLOCK / seconds, copied / 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batches", type=int, default=8, help="timed batches per record")
    parser.add_argument("--json", type=Path, help="also write the records here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # one worker: one core
    pq = random_pq()
    records = []
    for k in args.ks:
        decoded, decoded_mb = rate(k, pq, args.batches)
        named, named_mb = rate(k, None, args.batches)
        records.append({
            "k": k, "decoded_tokens_per_s": decoded, "decoded_batch_mb": decoded_mb,
            "positions_tokens_per_s": named, "positions_batch_mb": named_mb,
            "speedup": named / decoded,
            "workers_for_budget": {"decoded": math.ceil(BUDGET_TOKENS_PER_S / decoded),
                                   "positions": math.ceil(BUDGET_TOKENS_PER_S / named)}})
        r = records[-1]
        print(f"k = {k}: features decoded {decoded:,.0f} tokens/s ({decoded_mb:,.0f} MB per "
              f"batch), positions only {named:,.0f} tokens/s ({named_mb:,.0f} MB): "
              f"{r['speedup']:.1f}x; workers for {BUDGET_TOKENS_PER_S:,} tokens/s: "
              f"{r['workers_for_budget']['decoded']} vs {r['workers_for_budget']['positions']}")
    result = {"shape": {"train": N_TRAIN, "dim": DIM, "code_bytes": CODE_BYTES,
                        "stored_neighbours": K_STORED, "block": BLOCK,
                        "blocks_per_batch": BLOCKS_PER_BATCH, "leakage_window": CONTEXT},
              "records": records}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
