"""GNN-LM speed against the base LM, per k, on a pipeline's work directory (after `make demo`).

    python benchmarks/bench_gnn.py --workdir runs/wikitext2-cpu
    python benchmarks/bench_gnn.py --workdir runs/wikitext2 --ks 8 32 128 --block-size 128

For each k it builds the real data module's graphs (train graphs with the leakage rule, PQ node
features) and times, on the same number of tokens:

- training: graph building + GNN-LM forward, loss through the frozen softmax, backward and an
  AdamW step, as tokens/s and k x tokens/s (the cost grows with the k windows per token);
- evaluation: graph building + forward + log-softmax over the vocabulary on test blocks;
- the base LM's evaluation of the same test tokens (sliding windows, forward + softmax), and
  the ratio of the two evaluation times (GNN-LM §4.1 reports 8-20x slower on a GPU);
- with ``--impl pyg`` too, the message-passing implementation of the same layers;

and the peak memory of each (GPU: the allocator's peak; CPU: the process's peak RSS).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
from torch.nn import functional as F

from datamodules.graph import GraphDataModule
from gnnlm.devices import torch_device
from gnnlm.encode import encode_windows
from gnnlm.graph import GraphConfig
from gnnlm.lit.gnn import GNNLM
from gnnlm.models import load_base_lm
from gnnlm.tokens import TokenStore
from gnnlm.workdir import Workdir


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (Linux)
            f.write("5")


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(batch, device):
    return batch.to(device) if device.type != "cpu" else batch


def time_training(model: GNNLM, loader, device, max_tokens: int, warmup: int = 2) -> float:
    """Seconds per token of training (graph building included), after ``warmup`` batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    tokens, seconds = 0, 0.0
    it = iter(loader)
    for i in range(10**9):
        t0 = time.perf_counter()
        try:
            batch = to_device(next(it), device)
        except StopIteration:
            break
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(batch), batch["ctx"].y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync(device)
        if i >= warmup:
            seconds += time.perf_counter() - t0
            tokens += int(batch["ctx"].num_nodes)
        if tokens >= max_tokens:
            break
    return seconds / max(tokens, 1)


@torch.no_grad()
def time_evaluation(model: GNNLM, loader, device) -> tuple[float, int]:
    model.eval()
    tokens, t0 = 0, time.perf_counter()
    for batch in loader:
        batch = to_device(batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            torch.log_softmax(model(batch), dim=-1)
        tokens += int(batch["ctx"].num_nodes)
    sync(device)
    return (time.perf_counter() - t0) / tokens, tokens


@torch.no_grad()
def time_base_lm(workdir: Workdir, n: int, device, batch_size: int = 32) -> float:
    """Seconds per token of the base LM's evaluation of the first n test tokens: the sliding
    windows of the report's protocol, and log p(target) of each scored position (as the
    features stage computes them)."""
    model = load_base_lm(str(workdir.base_lm_checkpoint)).to(device)
    store = TokenStore.open(workdir.tokens)
    done = workdir.features_manifest("test")["config"]
    tokens = np.asarray(store.split("test")[:n])

    def evaluate(part: np.ndarray) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            for _ in encode_windows(model, part, store.bos_id, done["context"], done["stride"],
                                    batch_size=batch_size, with_logprob=True, device=device):
                pass
        sync(device)

    evaluate(tokens[:1024])  # warm-up, as GNN-LM's evaluation runs after its training steps
    t0 = time.perf_counter()
    evaluate(tokens)
    return (time.perf_counter() - t0) / len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/wikitext2-cpu")
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens timed per phase")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="graphs per batch")
    parser.add_argument("--impl", nargs="+", default=["dense"], choices=["dense", "pyg"])
    parser.add_argument("--node-features", default="pq", choices=["pq", "raw"])
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = torch_device(args.device)
    workdir = Workdir(args.workdir)
    torch.manual_seed(0)

    reset_peak(device)
    base = time_base_lm(workdir, args.tokens, device)
    base_peak = peak_mib(device)
    print(f"{workdir.root}: {device}, {torch.get_num_threads()} threads; base-LM evaluation "
          f"{1 / base:,.0f} tok/s (peak {base_peak:,.0f} MiB)")
    print(f"{'impl':<6} {'k':>4} {'train tok/s':>12} {'k x tok/s':>10} {'eval tok/s':>11} "
          f"{'eval vs base':>13} {'peak MiB':>9}")
    for k in args.ks:
        for impl in args.impl:
            dm = GraphDataModule(workdir=str(workdir.root), block_size=args.block_size,
                                 node_features=args.node_features,
                                 graph=GraphConfig(k=k), batch_size=args.batch_size,
                                 eval_batch_size=args.batch_size, num_workers=0,
                                 train_tokens=None, eval_tokens=args.tokens)
            model = GNNLM(vocab_size=dm.vocab_size, feature_dim=dm.feature_dim, dropout=0.0,
                          impl=impl, zero_init_output=False).to(device)
            model.graph = dataclasses.replace(dm.graph, k=k)
            model.attach_output_embedding(*dm.output_embedding())
            reset_peak(device)
            train = time_training(model, dm.train_dataloader(), device, args.tokens)
            evaluation, n = time_evaluation(model, dm.test_dataloader(), device)
            print(f"{impl:<6} {k:>4} {1 / train:>12,.0f} {k / train:>10,.0f} "
                  f"{1 / evaluation:>11,.0f} {evaluation / base:>12.2f}x "
                  f"{peak_mib(device):>9,.0f}", flush=True)


if __name__ == "__main__":
    main()
