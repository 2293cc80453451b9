"""What the window states' staleness check costs: the digest of a GNN stack's weights, taken at
every evaluation batch, against that batch's evaluation through the window states.

    python benchmarks/bench_weights_digest.py --json out.json
    python benchmarks/bench_weights_digest.py --device cuda --d-model 512 128

For each width d: a 3-layer GNN-LM stack of 4 heads (the demo's at d = 128, the GPU config's at
512), random train node features, and batches of ``--blocks`` blocks of ``--block-size`` tokens
retrieving ``--k`` windows each among ``--train`` positions. After one batch fills the table,
the median of ``--repeats`` times of (a) ``tensor_digest`` over the stack's parameters and
buffers (what ``WindowStates.prepare`` compares) and (b) a whole ``WindowStates`` forward of the
same batch (digest included, every window read from the table); the ratio a / b is the share of
an evaluation batch the check takes.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from gnnlm.gnn.dense import DenseGraph
from gnnlm.gnn.graph import METADATA, GraphConfig
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.window_states import WindowStates
from gnnlm.utils.tensor_digest import tensor_digest


def median_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def measure(d: int, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    stack = GNNStack(d, METADATA, num_layers=3, heads=4, zero_init_output=False,
                     readout=("ctx",)).to(device).eval()
    train = np.random.default_rng(0).standard_normal((args.train, d)).astype(np.float32)
    config = GraphConfig(k=args.k)
    states = WindowStates(stack, lambda positions: train[positions], args.train, config)
    B, T = args.blocks, args.block_size
    ctx = torch.randn(B, T, d, device=device)
    retrieved = torch.randint(0, args.train, (B, T, args.k), device=device)
    graph = DenseGraph(torch.ones(B, T, dtype=torch.bool, device=device),
                       torch.ones(B, T, args.k, 1, dtype=torch.bool, device=device),
                       config.left, config.inter, config.ctx_window, retrieved)
    weights = [*stack.parameters(), *stack.buffers()]
    with torch.no_grad():
        states(ctx, graph)                                   # fills the table
        digest = median_ms(lambda: tensor_digest(weights), args.repeats, device)
        batch = median_ms(lambda: states(ctx, graph), args.repeats, device)
    return {"d_model": d, "parameters": sum(p.numel() for p in stack.parameters()),
            "tokens_per_batch": B * T, "k": args.k, "digest_ms": round(digest, 3),
            "batch_ms": round(batch, 2), "ratio": round(digest / batch, 4),
            "device": str(device), "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--train", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the records to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    records = [measure(d, args, device) for d in args.d_model]
    for r in records:
        print(f"d = {r['d_model']} ({r['parameters']:,} parameters), {r['tokens_per_batch']} "
              f"tokens x k = {r['k']} on {r['device']} ({r['threads']} threads): digest "
              f"{r['digest_ms']:.2f} ms, batch {r['batch_ms']:.1f} ms, ratio {r['ratio']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
