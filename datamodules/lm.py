"""LightningDataModule for base-LM training and evaluation on a tokenized corpus.

- train: shuffled non-overlapping blocks of ``block_size`` tokens;
- valid/test: the sliding-window protocol of ``gnnlm.models.encode`` (context C, stride S), each
  position scored once, so ``val/ppl`` is the split's perplexity under a stated protocol;
- with a Transformer-XL model (``memory_length > 0``) every split is served as contiguous
  segments of parallel streams, in order, so memory flows from one batch to the next. The
  model's ``memory_length`` is linked into this module when the config is parsed
  (``gnnlm.lit.cli``): the module never reads the model.

The corpus is tokenized once into ``<workdir>/tokens`` when the module is created, which is
how ``vocab_size`` is known in time to be linked into the model. ``vocab_fingerprint`` (the
ordered token list's hash) is what the ids mean: the LM records it in its checkpoint
(``gnnlm.lit.lm.LanguageModel``).

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.base import loader_options
from datamodules.sampling import eval_sampler
from gnnlm.models import protocols
from gnnlm.models.encode import open_with_bos, sliding_windows, stream_tensor
from gnnlm.models.protocols import Protocol
from gnnlm.models.segments import StreamSegments
from gnnlm.text.tokens import TokenizerConfig, TokenStore, build_tokens
from gnnlm.workdir.layout import Workdir


class Blocks(Dataset):
    """Non-overlapping blocks: ``input = stream[i*T : (i+1)*T]``, target shifted by one.

    ``positions`` are the split positions (``gnnlm.models.encode``) that the inputs are read at.
    ``bos_id`` (models that read BOS first in every window) replaces each block's first input
    and masks its prediction, which would read BOS alone."""

    def __init__(self, stream: torch.Tensor, block_size: int, bos_id: Optional[int] = None):
        self.stream, self.T, self.bos_id = stream, block_size, bos_id
        self.n = (len(stream) - 1) // block_size
        if self.n == 0:
            raise ValueError(f"The train split ({len(stream) - 1} tokens) is shorter than one "
                             f"block of {block_size}.")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        chunk = self.stream[i * self.T: (i + 1) * self.T + 1]
        item = {"input": chunk[:-1], "target": chunk[1:],
                "positions": torch.arange(i * self.T, (i + 1) * self.T)}
        if self.bos_id is not None:
            item["input"] = open_with_bos(item["input"], self.bos_id)
            item["mask"] = torch.ones(self.T)
            item["mask"][0] = float(i == 0)
        return item


class SlidingWindows(Dataset):
    """Evaluation windows with a mask selecting each window's scored positions."""

    def __init__(self, stream: torch.Tensor, context: int, stride: int,
                 bos_id: Optional[int] = None):
        """``bos_id``: put it first in every window (as ``gnnlm.models.encode`` does)."""
        n = len(stream) - 1
        self.context = min(context, n)
        self.stream, self.bos_id = stream, bos_id
        self.starts, self.score_from = sliding_windows(n, self.context, min(stride, self.context))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, w: int) -> dict:
        s = int(self.starts[w])
        chunk = self.stream[s: s + self.context + 1]
        mask = torch.zeros(self.context)
        mask[int(self.score_from[w]) - s:] = 1.0
        inputs = chunk[:-1] if self.bos_id is None else open_with_bos(chunk[:-1], self.bos_id)
        return {"input": inputs, "target": chunk[1:], "mask": mask,
                "positions": torch.arange(s, s + self.context)}


class LMDataModule(pl.LightningDataModule):
    reads: frozenset[str] = frozenset()  # of the pipeline's retrieval artifacts
    def __init__(self, corpus: str = "wikitext-2", corpus_path: Optional[str] = None,
                 data_dir: Optional[str] = None, tokenizer: TokenizerConfig = TokenizerConfig(),
                 workdir: str = "runs/wikitext2", block_size: int = 256,
                 eval_context: int = 256, eval_stride: int = 128, batch_size: int = 32,
                 eval_batch_size: int = 32, train_tokens: Optional[int] = None,
                 eval_tokens: Optional[int] = None, num_workers: int = 0,
                 segments: Optional[bool] = None, memory_length: int = 0):
        """A tokenized corpus for base-LM training and evaluation.

        Args:
            corpus: the corpus's name (a folder of ``data_dir``, or one that can be
                downloaded, e.g. ``wikitext-2``).
            corpus_path: a folder with train/valid/test text files (None: look the name up).
            data_dir: the folder of named corpora (None: ``$GNNLM_DATA``).
            tokenizer: how the corpus is tokenized.
            workdir: the work directory whose ``tokens/`` holds the token streams.
            block_size: tokens per train block (and per segment for a memory model).
            eval_context: valid/test sliding-window context C.
            eval_stride: valid/test sliding-window stride S.
            batch_size: train blocks (or streams) per batch.
            eval_batch_size: valid/test windows (or streams) per batch.
            train_tokens: keep only this prefix of train (None: all of it).
            eval_tokens: keep only this prefix of valid/test (None: all of it).
            num_workers: DataLoader worker processes.
            segments: serve contiguous stream segments (None: when the model has memory;
                True also for a memory model evaluated with its memory switched off).
            memory_length: the model's Transformer-XL memory M (linked from the model's
                ``memory_length``; 0: none).
        """
        super().__init__()
        self.save_hyperparameters()
        self.block_size, self.eval_context, self.eval_stride = block_size, eval_context, eval_stride
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.train_tokens, self.eval_tokens = train_tokens, eval_tokens
        self.num_workers, self.segments, self.memory_length = num_workers, segments, memory_length
        self.store: TokenStore = build_tokens(Workdir(workdir).tokens, corpus, corpus_path,
                                              data_dir, tokenizer)
        self.vocab_size = self.store.vocab_size
        # what the ids mean: the LM records it in its checkpoint
        self.vocab_fingerprint = self.store.vocab_fingerprint

    def scoring_protocol(self, memory: int = 0) -> Protocol:
        """How valid/test are scored by a model with ``memory`` cached states: sliding windows,
        or segments of eval_batch_size x processes streams (a memory model)."""
        if self._memory_model():
            return protocols.segments(self.block_size, self.eval_batch_size * self._world(),
                                      memory)
        return protocols.sliding_window(self.eval_context, self.eval_stride)

    def stream(self, split: str) -> torch.Tensor:
        tokens = self.store.split(split)
        limit = self.train_tokens if split == "train" else self.eval_tokens
        return stream_tensor(np.asarray(tokens[:limit]), self.store.bos_id)

    def _memory_model(self) -> bool:
        return self.segments if self.segments is not None else self.memory_length > 0

    def _world(self) -> int:
        return self.trainer.world_size if self.trainer else 1

    def _segments(self, split: str, batch_size: int) -> StreamSegments:
        return StreamSegments(self.stream(split), batch_size * self._world(), self.block_size)

    def train_dataloader(self) -> DataLoader:
        if self._memory_model():
            return DataLoader(self._segments("train", self.batch_size),
                              batch_size=self.batch_size, shuffle=False,
                              num_workers=self.num_workers, **loader_options())
        # workers kept between epochs: the blocks never change, and a GPU epoch is seconds
        return DataLoader(Blocks(self.stream("train"), self.block_size),
                          batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, **loader_options(), drop_last=True,
                          persistent_workers=self.num_workers > 0)

    def _eval_loader(self, split: str) -> DataLoader:
        data: StreamSegments | SlidingWindows
        if self._memory_model():
            data = self._segments(split, self.eval_batch_size)
        else:
            data = SlidingWindows(self.stream(split), self.eval_context, self.eval_stride)
        return DataLoader(data, batch_size=self.eval_batch_size, shuffle=False,
                          num_workers=self.num_workers, **loader_options(),
                          sampler=eval_sampler(self, data))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
