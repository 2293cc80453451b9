"""The sharded builds' shared settings: a tiny seeded GPT, a WikiText-2 slice, and the features
and neighbours built from them, on any number of processes (tests/workdir/test_shards.py builds
with one process in pytest, tests/sharded_build.py with several in its own process)."""
from __future__ import annotations

from pathlib import Path

import torch

from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.retrieval.features import build_features
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
from gnnlm.text.tokens import TokenizerConfig, TokenStore, build_tokens
from gnnlm.workdir.layout import Workdir

CONTEXT, STRIDE = 64, 32
TRAIN_TOKENS = 4000          # the slice: 124 windows, 16 chunks of 8 windows
CHUNK_WINDOWS, BATCH = 8, 6  # batches that do not divide chunks: the last batch is short
K, CHUNK, QUERY_BATCH = 8, 256, 100
KEY, METRIC = "final", "cos"


def tokens(root: Path, data_dir: str) -> TokenStore:
    """WikiText-2 at word level with a 2000-word vocabulary."""
    return build_tokens(root, "wikitext-2", data_dir=data_dir,
                        tokenizer=TokenizerConfig(max_vocab=2000))


def model(vocab_size: int) -> GPT:
    """The same weights in every process (a fixed seed; builds record their fingerprint)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, context_length=CONTEXT, n_layer=2, n_head=4,
                         d_model=64, d_ff=256, dropout=0.0)).eval()


def features(workdir: Path, tokens_dir: Path, devices: int = 1,
             stop_after: int | None = None, split: str = "train",
             max_tokens: int = TRAIN_TOKENS) -> dict:
    store = TokenStore.open(tokens_dir)
    return build_features(model(store.vocab_size), store, Workdir(workdir), split, CONTEXT,
                          STRIDE, with_logprob=True, batch_size=BATCH,
                          chunk_windows=CHUNK_WINDOWS, max_tokens=max_tokens, device="cpu",
                          stop_after_chunks=stop_after, devices=devices)


def neighbors(workdir: Path, devices: int = 1, stop_after: int | None = None,
              split: str = "train") -> dict:
    """Train queries (masked for leakage, W = the context) among the train keys."""
    config = NeighborsConfig(K=K, chunk=CHUNK, batch_size=QUERY_BATCH, devices=devices)
    return build_neighbors(Workdir(workdir), split, KEY, METRIC, config, leakage_window=CONTEXT,
                           stop_after_chunks=stop_after, device="cpu")
