"""GNN-LM speed against the base LM and kNN-LM, per k, on a pipeline's work directory.

    python benchmarks/bench_gnn.py --workdir runs/wikitext2-cpu --ks 8 32 128 --json out.json
    python benchmarks/bench_gnn.py --workdir runs/wikitext2 --ks 32 128 --block-size 128

For each k it builds the real data module's graphs and times, on the first test tokens:

- ``train``: train graphs (leakage rule) + forward, loss through the frozen softmax, backward
  and an AdamW step; also how many of a batch's windows repeat a (position, node set) already
  in the batch, the most that computing each repeated window once could save;
- ``eval``, path ``per_retrieval``: one window per retrieval (every retrieved window
  recomputed for every token that retrieves it), graph building + forward + log-softmax;
- ``eval``, path ``once``: the blocks without window nodes, each distinct retrieved window
  computed once (``gnnlm.gnn.window_states``), as the pipeline evaluates, over ``--eval-tokens``
  tokens (the share of windows computed per token falls as more tokens retrieve the same
  positions: the pipeline scores whole splits);
- ``eval``, path ``knn_lm``: kNN-LM's own work on the same tokens: the search of k neighbours
  with the index's recorded settings and p_kNN of the target;
- the base LM's evaluation of the same tokens (sliding windows, forward + softmax).

Each record has tokens/s, the base LM's tokens/s, their ratio (time / base time), and the
peak memory (GPU: the allocator's peak; CPU: the process's peak RSS, reset before each record).
GNN-LM reads neighbours the search already found, as kNN-LM does: a user's end to end cost per
token is base LM + search + either, which ``end_to_end_ratio`` gives.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from datamodules.graph import GraphDataModule
from gnnlm.gnn.graph import GraphConfig
from gnnlm.lit.gnn import GNNLM
from gnnlm.models import load_base_lm
from gnnlm.models.encode import encode_windows
from gnnlm.retrieval.features import open_features
from gnnlm.retrieval.knn import knn_logprob
from gnnlm.retrieval.search import Searcher
from gnnlm.text.tokens import TokenStore
from gnnlm.utils.devices import torch_device
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array


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


def repeated_windows(batch) -> float:
    """The share of a train batch's windows that repeat a window already in the batch: the
    same retrieved position with the same surviving nodes (the leakage rule drops nodes per
    owner, so only those are exactly shareable)."""
    nbr = batch["nbr"]
    owners = torch.stack([nbr.batch, nbr.owner_local, nbr.rank], 1).numpy()
    _, window = np.unique(owners, axis=0, return_inverse=True)            # [n_nbr]
    window = window.reshape(-1)
    n = int(window.max()) + 1 if len(window) else 0
    centre = np.zeros(n, dtype=np.int64)
    centre[window] = (nbr.train_pos - nbr.offset).numpy()
    kept = np.zeros(n, dtype=np.int64)                                     # offsets as bits
    np.bitwise_or.at(kept, window, np.left_shift(1, nbr.offset.numpy() + 16))
    distinct = len(np.unique(np.stack([centre, kept], 1), axis=0))
    return 1.0 - distinct / max(n, 1)


def time_training(model: GNNLM, loader, device, max_tokens: int, warmup: int = 2
                  ) -> tuple[float, float]:
    """(seconds per token of training, graph building included, after ``warmup`` batches;
    the mean share of repeated windows per batch)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    tokens, seconds, repeats = 0, 0.0, []
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
            repeats.append(repeated_windows(batch.cpu()))
        if tokens >= max_tokens:
            break
    return seconds / max(tokens, 1), float(np.mean(repeats)) if repeats else float("nan")


@torch.no_grad()
def time_evaluation(model: GNNLM, loader, device) -> tuple[float, int, int]:
    """(seconds per token, tokens, window nodes in the batches) of graph building + forward +
    log-softmax over the vocabulary."""
    model.eval()
    tokens, windows, t0 = 0, 0, time.perf_counter()
    for batch in loader:
        batch = to_device(batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            torch.log_softmax(model(batch), dim=-1)
        tokens += int(batch["ctx"].num_nodes)
        windows += int((batch["nbr"].offset == 0).sum()) if batch["nbr"].num_nodes else 0
    sync(device)
    return (time.perf_counter() - t0) / tokens, tokens, windows


def time_knn_lm(workdir: Workdir, n: int, k: int) -> float:
    """Seconds per token of kNN-LM's own work: searching k neighbours of each test query with
    the index's recorded settings, and log p_kNN of its target."""
    searcher = Searcher.for_workdir(workdir, "final", "cos", device="auto")
    _, test = open_features(workdir.features("test"))
    queries = np.asarray(test["final"][:n], dtype=np.float32)
    train_targets = np.asarray(open_array(workdir.features("train"), "targets"))
    targets = np.asarray(test["targets"][:n])
    searcher.search(queries[:256], k)  # warm-up (re-ranking keys prepared once)
    t0 = time.perf_counter()
    for start in range(0, n, 4096):
        sims, ids = searcher.search(queries[start:start + 4096], k)
        hits = (train_targets[np.maximum(ids, 0)] == targets[start:start + 4096, None]) & (
            ids >= 0)
        knn_logprob(sims, hits, k, 0.01)
    return (time.perf_counter() - t0) / n


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
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens timed for training and per-retrieval evaluation")
    parser.add_argument("--eval-tokens", type=int, default=None,
                        help="tokens timed for evaluation with each window once, kNN-LM and the "
                             "base LM (default: the whole test split)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="graphs per training batch")
    parser.add_argument("--eval-batch-size", type=int, default=16,
                        help="blocks per evaluation batch")
    parser.add_argument("--heads", type=int, default=4, help="the GNN's heads (GPU config: 8)")
    parser.add_argument("--impl", default="dense", choices=["dense", "pyg"],
                        help="the layer implementation (pyg: per-retrieval evaluation only)")
    parser.add_argument("--node-features", default="raw", choices=["pq", "raw"])
    parser.add_argument("--skip-per-retrieval-above", type=int, default=10**9,
                        help="time per-retrieval evaluation only for k up to this")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="also write the records here")
    args = parser.parse_args()
    device = torch_device(args.device)
    workdir = Workdir(args.workdir)
    torch.manual_seed(0)
    n_eval = max(args.tokens, args.eval_tokens or workdir.n_positions("test"))

    reset_peak(device)
    base = time_base_lm(workdir, n_eval, device)
    base_peak = peak_mib(device)
    setting = {"device": str(device), "threads": torch.get_num_threads(),
               "block_size": args.block_size, "eval_batch_size": args.eval_batch_size,
               "node_features": args.node_features, "impl": args.impl, "heads": args.heads,
               "workdir": str(workdir.root)}
    records = [{"k": None, "path": "base_lm", "phase": "eval", "tokens": n_eval,
                "tokens_per_s": 1 / base, "base_tokens_per_s": 1 / base, "ratio": 1.0,
                "peak_mib": base_peak}]
    print(f"{workdir.root}: {device}, {torch.get_num_threads()} threads; base-LM evaluation "
          f"{1 / base:,.0f} tok/s on {n_eval:,} test tokens (peak {base_peak:,.0f} MiB)")
    print(f"{'k':>4} {'phase':<6} {'path':<14} {'tokens':>7} {'tok/s':>9} {'vs base':>8} "
          f"{'e2e vs base':>11} {'peak MiB':>9}  notes")

    def record(k, phase, path, tokens, seconds, search=None, **extra):
        entry = {"k": k, "phase": phase, "path": path, "tokens": tokens,
                 "tokens_per_s": 1 / seconds, "base_tokens_per_s": 1 / base,
                 "ratio": seconds / base, "peak_mib": peak_mib(device), **extra}
        if search is not None:  # base LM + search + this, against the base LM alone
            entry["end_to_end_ratio"] = (base + search + seconds) / base
        records.append(entry)
        notes = ", ".join(f"{name} {value:,.3g}" for name, value in extra.items())
        e2e = f"{entry['end_to_end_ratio']:.2f}x" if search is not None else ""
        print(f"{k:>4} {phase:<6} {path:<14} {tokens:>7,} {1 / seconds:>9,.0f} "
              f"{seconds / base:>7.2f}x {e2e:>11} {entry['peak_mib']:>9,.0f}  {notes}",
              flush=True)

    for k in args.ks:
        reset_peak(device)
        knn = time_knn_lm(workdir, n_eval, k)
        # kNN-LM's own work is the search and p_kNN: its end to end is base LM + that
        record(k, "eval", "knn_lm", n_eval, knn, search=0.0)

        def data(eval_windows: str, tokens: int, k: int = k) -> GraphDataModule:
            return GraphDataModule(workdir=str(workdir.root), block_size=args.block_size,
                                   node_features=args.node_features,
                                   graph=GraphConfig(k=k), batch_size=args.batch_size,
                                   eval_batch_size=args.eval_batch_size, num_workers=0,
                                   train_tokens=None, eval_tokens=tokens,
                                   eval_windows=eval_windows)

        dm = data("per_retrieval", args.tokens)
        model = GNNLM(vocab_size=dm.vocab_size, feature_dim=dm.feature_dim, dropout=0.0,
                      heads=args.heads, impl=args.impl, zero_init_output=False).to(device)
        model.graph = dataclasses.replace(dm.graph, k=k)
        model.attach_output_embedding(*dm.output_embedding())
        model.attach_node_features(dm.node_features(), dm.n_train)
        reset_peak(device)
        train, repeats = time_training(model, dm.train_dataloader(), device, args.tokens)
        record(k, "train", "per_retrieval", args.tokens, train, repeated_windows=repeats)
        if k <= args.skip_per_retrieval_above:
            reset_peak(device)
            seconds, n, windows = time_evaluation(model, dm.test_dataloader(), device)
            record(k, "eval", "per_retrieval", n, seconds, search=knn,
                   windows_per_token=windows / n)
        if args.impl == "pyg":  # message passing needs window nodes: no evaluation by position
            continue
        reset_peak(device)
        seconds, n, _ = time_evaluation(model, data("once", n_eval).test_dataloader(), device)
        record(k, "eval", "once", n, seconds, search=knn,
               windows_per_token=model.window_states().computed / n)
    if args.json:
        args.json.write_text(json.dumps({"setting": setting, "records": records}, indent=1))
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()
