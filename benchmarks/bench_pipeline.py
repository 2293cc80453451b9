"""Speed of the pipeline's stages on a real work directory, as ratios measured in one run.

    python benchmarks/bench_pipeline.py --workdir runs/wikitext2-cpu      # after `make demo`
    python benchmarks/bench_pipeline.py --workdir runs/wikitext2-cpu --tokens 20000

On the first ``--tokens`` positions of the test split it times:

1. datastore writing (``build_features``: windows → final/att/targets/log p, fp16 memmaps)
   against a bare forward pass of the same windows (tokens/s, ratio);
2. base-LM evaluation (the sliding-window forward and softmax that scores every token), kNN-LM
   evaluation from the cache (no LM: ``knn_lm_logprob``), and kNN-LM including the search;
3. GNN-LM evaluation (graph building + 3 GNN layers + softmax over the vocabulary) against the
   base-LM evaluation (GNN-LM §4.1 reports 8-20x slower than the base LM);
4. graph building (one DataLoader batch of HeteroData) against one GNN training step on it.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gnnlm.artifacts import read_manifest
from gnnlm.datastore import build_features, features_dir
from gnnlm.encode import sliding_windows, stream_tensor
from gnnlm.index import Searcher, index_dir
from gnnlm.knn import knn_lm_logprob
from gnnlm.models import load_base_lm
from gnnlm.pipeline import cache_dir, load_cache
from gnnlm.tokens import TokenStore


def timed(fn, repeat: int = 1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


@torch.no_grad()
def bare_forward(model, tokens, bos_id, context, stride, batch_size) -> None:
    starts, _ = sliding_windows(len(tokens), context, stride)
    stream = stream_tensor(tokens, bos_id)
    for b in range(0, len(starts), batch_size):
        idx = torch.from_numpy(starts[b: b + batch_size])[:, None] + torch.arange(context)
        model(stream[idx])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/wikitext2-cpu")
    parser.add_argument("--tokens", type=int, default=50000, help="test positions timed")
    parser.add_argument("--tag", default="final-cos", help="retrieval key-metric to time")
    parser.add_argument("--gnn-batches", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    torch.manual_seed(0)

    model = load_base_lm(str(workdir / "heads" / "base_lm" / "model.ckpt"))
    store = TokenStore.open(workdir / "tokens")
    done = read_manifest(features_dir(workdir, "test"))
    C, S = done["config"]["context"], done["config"]["stride"]
    tokens = np.asarray(store.split("test")[: args.tokens])
    n = len(tokens)
    print(f"workdir {workdir}: {n} test positions, context {C}, stride {S}, "
          f"{torch.get_num_threads()} threads")

    # 1. datastore writing vs a bare forward pass
    t_fwd, _ = timed(lambda: bare_forward(model, tokens, store.bos_id, C, S, 16))
    with tempfile.TemporaryDirectory() as tmp:
        t_ds, _ = timed(lambda: build_features(model, store, "test", Path(tmp) / "f", C, S,
                                               with_logprob=False, max_tokens=n, batch_size=16))
        t_eval, _ = timed(lambda: build_features(model, store, "test", Path(tmp) / "e", C, S,
                                                 with_logprob=True, max_tokens=n,
                                                 batch_size=16))
    print(f"\n1. datastore writing: {n / t_ds:,.0f} tok/s vs bare forward {n / t_fwd:,.0f} tok/s "
          f"-> ratio {t_fwd / t_ds:.2f}")

    # 2. kNN-LM evaluation from the cache, and with the search included
    cache = load_cache(cache_dir(workdir, args.tag, "faiss", "test"))
    cache = {k: np.asarray(v[:n]) for k, v in cache.items()}
    K = cache["sims"].shape[1]
    t_knn, _ = timed(lambda: knn_lm_logprob(cache, K, 0.1, 0.25), repeat=3)
    searcher = Searcher.open(index_dir(workdir, args.tag))
    queries = np.asarray(
        np.memmap(features_dir(workdir, "test") / f"{searcher.key}.bin", dtype=np.float16,
                  mode="r", shape=(done["n"], done["dim"]))[:n], dtype=np.float32)
    t_search, _ = timed(lambda: searcher.search(queries, K))
    print(f"2. base-LM evaluation {n / t_eval:,.0f} tok/s; kNN-LM from the cache "
          f"{n / t_knn:,.0f} tok/s ({t_eval / t_knn:.0f}x the base LM's speed); kNN-LM with "
          f"search {n / (t_eval + t_search):,.0f} tok/s (search {n / t_search:,.0f} q/s at "
          f"k={K}; ratio to base LM {t_eval / (t_eval + t_search):.2f})")

    # 3./4. GNN-LM: evaluation speed, and graph building vs a training step
    gnn_dir = workdir / "heads" / "gnn"
    if not (gnn_dir / "manifest.json").is_file():
        print("3./4. no trained GNN head in the work directory: skipped")
        return
    from datamodules.graph import GraphDataModule
    from gnnlm.gnn_module import GNNLM
    from gnnlm.training import datamodule_args

    gnn = GNNLM.load_from_checkpoint(gnn_dir / "model.ckpt", map_location="cpu")
    dm = GraphDataModule(**{**datamodule_args(str(gnn_dir / "model.ckpt")),
                            "workdir": str(workdir), "eval_tokens": n, "num_workers": 0})
    gnn.attach_output_embedding(*dm.output_embedding())
    gnn.eval()
    loader = dm.test_dataloader()

    def evaluate_gnn():
        with torch.no_grad():
            for batch in loader:
                torch.log_softmax(gnn(batch), -1)
    t_gnn, _ = timed(evaluate_gnn)
    print(f"3. GNN-LM evaluation {n / t_gnn:,.0f} tok/s vs base-LM evaluation "
          f"{n / t_eval:,.0f} tok/s -> GNN-LM is {t_gnn / t_eval:.1f}x slower "
          f"(k={dm.current_k(None)}, block {dm.hparams.block_size})")

    gnn.train()
    optimizer = torch.optim.AdamW(gnn.parameters(), lr=1e-4)
    train_loader = iter(dm._loader("train", train=True))
    t_build = t_step = 0.0
    for _ in range(args.gnn_batches):
        t0 = time.perf_counter()
        batch = next(train_loader)
        t1 = time.perf_counter()
        nll, mask, _ = gnn.token_nll(batch, "train")
        optimizer.zero_grad()
        nll.mean().backward()
        optimizer.step()
        t_build, t_step = t_build + t1 - t0, t_step + time.perf_counter() - t1
    print(f"4. graph building {1000 * t_build / args.gnn_batches:.0f} ms/batch vs GNN training "
          f"step {1000 * t_step / args.gnn_batches:.0f} ms/batch -> ratio "
          f"{t_build / t_step:.2f} (batch of {dm.hparams.batch_size} graphs)")


if __name__ == "__main__":
    main()
