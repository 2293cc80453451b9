"""Speed of the pipeline's stages on a real work directory, as ratios measured in one run.

    python benchmarks/bench_pipeline.py --workdir runs/wikitext2-cpu      # after `make demo`
    python benchmarks/bench_pipeline.py --workdir runs/wikitext2-cpu --tokens 20000
    python benchmarks/bench_pipeline.py --workdir runs/wikitext2-cpu --rows hf --json out.json

On the first ``--tokens`` positions of the test split it times:

1. datastore writing (``build_features``: windows → final/att/targets/log p, fp16 memmaps)
   against a bare forward pass of the same windows (tokens/s, ratio);
2. base-LM evaluation (the sliding-window forward and softmax that scores every token), kNN-LM
   evaluation from the cache (no LM: ``knn_lm_logprob``), and kNN-LM including the search;
3. (``--rows hf``) datastore writing with a Hugging Face model of GPT-2 small's shape (124M
   parameters, random weights, built locally and loaded as the pipeline loads it: SDPA
   attention, hooks at its module paths) against the model's own forward pass (logits
   included) and its transformer alone (no logits) over the same windows of context 1,024,
   stride 512, on the first ``--hf-tokens``.

GNN-LM's speed against the base LM is ``bench_gnn.py``'s.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gnnlm.models import load_base_lm
from gnnlm.models.encode import sliding_windows, stream_tensor
from gnnlm.retrieval.features import build_features, open_features
from gnnlm.retrieval.knn import knn_lm_logprob
from gnnlm.retrieval.knn_cache import open_knn_cache
from gnnlm.retrieval.search import Searcher
from gnnlm.text.tokens import TokenStore
from gnnlm.workdir.layout import Workdir


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


def builtin_rows(workdir: Workdir, n_tokens: int, key: str, metric: str) -> dict:
    """Rows 1 and 2 with the work directory's own base LM."""
    model = load_base_lm(str(workdir.base_lm_checkpoint))
    store = TokenStore.open(workdir.tokens)
    done = workdir.features_manifest("test")
    C, S = done["config"]["context"], done["config"]["stride"]
    tokens = np.asarray(store.split("test")[:n_tokens])
    n = len(tokens)
    print(f"workdir {workdir.root}: {n} test positions, context {C}, stride {S}, "
          f"{torch.get_num_threads()} threads")

    # 1. datastore writing vs a bare forward pass
    t_fwd, _ = timed(lambda: bare_forward(model, tokens, store.bos_id, C, S, 16))
    with tempfile.TemporaryDirectory() as tmp:
        t_ds, _ = timed(lambda: build_features(model, store, Workdir(Path(tmp) / "f"), "test",
                                               C, S, with_logprob=False, max_tokens=n,
                                               batch_size=16))
        t_eval, _ = timed(lambda: build_features(model, store, Workdir(Path(tmp) / "e"), "test",
                                                 C, S, with_logprob=True, max_tokens=n,
                                                 batch_size=16))
    print(f"\n1. datastore writing: {n / t_ds:,.0f} tok/s vs bare forward {n / t_fwd:,.0f} tok/s "
          f"-> ratio {t_fwd / t_ds:.2f}")

    # 2. kNN-LM evaluation from the cache, and with the search included
    _, cache = open_knn_cache(workdir.knn_cache(key, metric, "faiss", "test"))
    cache = {k: np.asarray(v[:n]) for k, v in cache.items()}
    K = cache["sims"].shape[1]
    t_knn, _ = timed(lambda: knn_lm_logprob(cache, K, 0.1, 0.25), repeat=3)
    searcher = Searcher.for_workdir(workdir, key, metric)
    queries = np.asarray(open_features(workdir.features("test"))[1][key][:n],
                         dtype=np.float32)
    t_search, _ = timed(lambda: searcher.search(queries, K))
    print(f"2. base-LM evaluation {n / t_eval:,.0f} tok/s; kNN-LM from the cache "
          f"{n / t_knn:,.0f} tok/s ({t_eval / t_knn:.0f}x the base LM's speed); kNN-LM with "
          f"search {n / (t_eval + t_search):,.0f} tok/s (search {n / t_search:,.0f} q/s at "
          f"k={K}; ratio to base LM {t_eval / (t_eval + t_search):.2f})")
    return {"tokens": n, "context": C, "stride": S,
            "datastore_tok_s": n / t_ds, "bare_forward_tok_s": n / t_fwd,
            "datastore_vs_forward": t_fwd / t_ds, "base_eval_tok_s": n / t_eval,
            "knn_cache_tok_s": n / t_knn, "knn_search_q_s": n / t_search, "knn_k": K}


def hf_gpt2_small_row(workdir: Workdir, n_tokens: int, batch_size: int) -> dict:
    """Row 3: the adapter on GPT-2 small's shape against the model's own forward pass."""
    from transformers import GPT2Config, GPT2LMHeadModel

    store = TokenStore.open(workdir.tokens)
    tokens = np.asarray(store.split("test")[:n_tokens])
    n, C, S = len(tokens), 1024, 512
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(Path(tmp) / "gpt2-small")
        model = load_base_lm(f"hf:{Path(tmp) / 'gpt2-small'}")
        params = sum(p.numel() for p in model.parameters())
        print(f"\n3. Hugging Face GPT-2 small shape ({params / 1e6:.0f}M parameters, "
              f"{model.model.config._attn_implementation} attention), {n} test positions, "
              f"context {C}, stride {S}, batch {batch_size}")
        timed(lambda: bare_forward(model.model, tokens[:C], store.bos_id, C, S, 1))  # warm-up
        t_fwd, _ = timed(lambda: bare_forward(model.model, tokens, store.bos_id, C, S,
                                              batch_size))
        t_body, _ = timed(lambda: bare_forward(model.model.base_model, tokens, store.bos_id, C,
                                               S, batch_size))
        t_ds, _ = timed(lambda: build_features(model, store, Workdir(Path(tmp) / "f"), "test",
                                               C, S, with_logprob=False, max_tokens=n,
                                               batch_size=batch_size))
    print(f"   datastore writing: {n / t_ds:,.0f} tok/s vs the model's forward "
          f"{n / t_fwd:,.0f} tok/s -> datastore time {t_ds / t_fwd:.2f}x the forward's "
          f"({t_ds / t_body:.2f}x the transformer's alone, {n / t_body:,.0f} tok/s: no logits)")
    return {"model": "GPT-2 small shape (random weights)", "parameters": params,
            "tokens": n, "context": C, "stride": S, "batch_size": batch_size,
            "datastore_tok_s": n / t_ds, "forward_tok_s": n / t_fwd,
            "transformer_tok_s": n / t_body, "datastore_time_vs_forward": t_ds / t_fwd,
            "datastore_time_vs_transformer": t_ds / t_body}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/wikitext2-cpu")
    parser.add_argument("--tokens", type=int, default=50000, help="test positions timed")
    parser.add_argument("--key", default="final", help="retrieval key type to time")
    parser.add_argument("--metric", default="cos")
    parser.add_argument("--rows", nargs="+", default=["builtin", "hf"],
                        choices=["builtin", "hf"], help="which rows to time")
    parser.add_argument("--hf-tokens", type=int, default=16384,
                        help="test positions for the GPT-2-small-shape row")
    parser.add_argument("--hf-batch-size", type=int, default=4)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    workdir = Workdir(args.workdir)
    torch.manual_seed(0)
    out = {"threads": torch.get_num_threads()}
    if "builtin" in args.rows:
        out["builtin"] = builtin_rows(workdir, args.tokens, args.key, args.metric)
    if "hf" in args.rows:
        out["hf_gpt2_small"] = hf_gpt2_small_row(workdir, args.hf_tokens, args.hf_batch_size)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
