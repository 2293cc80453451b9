"""LightningDataModule over frozen features, for heads that read one position at a time
(SPALM's gate, learned W_ds): each item is a block of consecutive positions of a split with
their feature ``h`` (of ``key``), target, and — when ``retrieved > 0`` — the values (next tokens)
of their first ``retrieved`` neighbours among the train ``key`` keys under ``metric`` (-1 = none;
train queries were masked for leakage when the neighbours were built). Blocks partition each
split, so evaluation scores every token once, the same tokens as every other row of a report.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.base import WorkdirDataModule, loader_options
from datamodules.sampling import eval_sampler
from datamodules.splits import SplitArrays
from gnnlm.retrieval.neighbors import neighbor_values


class NeighborValues:
    """The values (next tokens) of the first ``k`` retrieved train positions of a split's
    positions, from the split's stored neighbours (-1 where fewer were found)."""

    def __init__(self, arrays: SplitArrays, key: str, metric: str, split: str, k: int):
        self.arrays, self.key, self.metric, self.split, self.k = arrays, key, metric, split, k
        self.dir = arrays.neighbors_location(key, metric, split)
        # positions covered (train neighbours may cover only a prefix) and neighbours stored
        self.n, stored = arrays.neighbor_shape(key, metric, split)
        if not 1 <= k <= stored:
            raise ValueError(f"retrieved={k} neighbour values asked for, but {self.dir} holds "
                             f"K={stored} per position: choose 1 <= retrieved <= K.")

    def __call__(self, positions) -> torch.Tensor:
        """``positions``: a slice or an index array of the split → values ``[..., k]`` int64."""
        ids = self.arrays.neighbor_ids(self.key, self.metric, self.split)
        return torch.from_numpy(neighbor_values(ids[positions, : self.k],
                                                self.arrays.targets("train")).astype(np.int64))


class FeatureBlocks(Dataset):
    def __init__(self, arrays: SplitArrays, split: str, key: str, block_size: int,
                 values: Optional[NeighborValues] = None, max_tokens: Optional[int] = None):
        self.arrays, self.split, self.key, self.block_size = arrays, split, key, block_size
        arrays.check_key(split, key)
        self.values = values
        n = arrays.n(split) if values is None else values.n  # train neighbours: maybe a prefix
        self.n = n if max_tokens is None else min(n, max_tokens)
        if self.n == 0:
            raise ValueError(f"Split {split!r} has no positions to read.")

    def __len__(self) -> int:
        return -(-self.n // self.block_size)

    def __getitem__(self, i: int) -> dict:
        feats = self.arrays.features(self.split)
        h, targets = feats[self.key], feats["targets"]
        rows = slice(i * self.block_size, min((i + 1) * self.block_size, self.n))
        item = {"h": torch.from_numpy(np.asarray(h[rows], dtype=np.float32)),
                "target": torch.from_numpy(np.asarray(targets[rows], dtype=np.int64)),
                "positions": torch.arange(rows.start, rows.stop)}
        if self.values is not None:
            item["nbr_values"] = self.values(rows)
        return item


class FeatureDataModule(WorkdirDataModule):
    reads: frozenset[str] = frozenset()  # of the retrieval artifacts (neighbours: retrieved > 0)
    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final", metric: str = "cos",
                 retrieved: int = 0, block_size: int = 512, num_workers: int = 0,
                 train_tokens: Optional[int] = None, eval_tokens: Optional[int] = None,
                 predict_split: str = "test"):
        """Positions of each split with their frozen features, for heads on frozen features.

        Args:
            workdir: the work directory of ``gnnlm pipeline`` whose artifacts are read.
            key: the feature each position carries (``final`` or ``att``).
            metric: the similarity the neighbours of ``key`` were searched with.
            retrieved: retrieved next tokens each position carries (SPALM's K; 0 = none).
            block_size: consecutive positions per batch.
            num_workers: DataLoader worker processes.
            train_tokens: keep only this prefix of train (None: every position).
            eval_tokens: keep only this prefix of valid/test (None: every position).
            predict_split: the split ``predict`` scores.
        """
        self.check_arguments(retrieved=retrieved)
        super().__init__(workdir, predict_split)
        self.save_hyperparameters()
        self.key, self.metric, self.retrieved, self.block_size = key, metric, retrieved, block_size
        self.train_tokens, self.eval_tokens = train_tokens, eval_tokens
        self.num_workers = num_workers
        if retrieved:
            self.check_train_neighbors(key, metric)
        with self.reading_artifacts("features"):
            self.use_features(self.workdir.features_manifest("train"))

    @classmethod
    def check_arguments(cls, **args: Any) -> None:
        """``WorkdirDataModule.check_arguments``, and ``retrieved`` >= 0."""
        super().check_arguments(**args)
        retrieved = args.get("retrieved")
        if retrieved is not None and retrieved < 0:
            raise ValueError(f"retrieved must be >= 0 (got {retrieved}).")

    def _loader(self, split: str, train: bool) -> DataLoader:
        values = (NeighborValues(self.arrays, self.key, self.metric, split, self.retrieved)
                  if self.retrieved else None)
        data = FeatureBlocks(self.arrays, split, self.key, self.block_size, values,
                             self.train_tokens if split == "train" else self.eval_tokens)
        return DataLoader(data, batch_size=None, shuffle=train, num_workers=self.workers(split),
                          **loader_options(),
                          sampler=None if train else eval_sampler(self, data))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def eval_dataloader(self, split: str) -> DataLoader:
        return self._loader(split, False)
