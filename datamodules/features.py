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

from datamodules.base import WorkdirDataModule
from datamodules.sampling import eval_sampler
from gnnlm.retrieval.features import check_key, open_features
from gnnlm.retrieval.neighbors import neighbor_values
from gnnlm.utils.devices import pin_memory
from gnnlm.workdir.artifacts import open_array, read_manifest
from gnnlm.workdir.layout import Workdir


class NeighborValues:
    """The values (next tokens) of the first ``k`` retrieved train positions of a split's
    positions, read from ``workdir.neighbors(key, metric, split)`` (-1 where fewer were found)."""

    def __init__(self, workdir: Workdir, key: str, metric: str, split: str, k: int):
        self.workdir, self.k = workdir, k
        self.dir = workdir.neighbors(key, metric, split)
        manifest = read_manifest(self.dir, kind="neighbors")
        if not 1 <= k <= manifest["K"]:
            raise ValueError(f"retrieved={k} neighbour values asked for, but {self.dir} holds "
                             f"K={manifest['K']} per position: choose 1 <= retrieved <= K.")
        self.n = manifest["n"]  # positions covered (train neighbours may cover only a prefix)
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None  # opened in each worker

    def __call__(self, positions) -> torch.Tensor:
        """``positions``: a slice or an index array of the split → values ``[..., k]`` int64."""
        if self._arrays is None:
            self._arrays = (open_array(self.dir, "ids"),
                            open_features(self.workdir.features("train"))[1]["targets"])
        ids, targets = self._arrays
        return torch.from_numpy(neighbor_values(ids[positions, : self.k], targets)
                                .astype(np.int64))


class FeatureBlocks(Dataset):
    def __init__(self, workdir: Workdir, split: str, key: str, block_size: int,
                 values: Optional[NeighborValues] = None, max_tokens: Optional[int] = None):
        self.workdir, self.split, self.key, self.block_size = workdir, split, key, block_size
        manifest = workdir.features_manifest(split)
        check_key(manifest, key)
        self.values = values
        n = manifest["n"] if values is None else values.n  # train neighbours: maybe a prefix
        self.n = n if max_tokens is None else min(n, max_tokens)
        if self.n == 0:
            raise ValueError(f"Split {split!r} has no positions in {workdir.features(split)}.")
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None  # opened in each worker

    def __len__(self) -> int:
        return -(-self.n // self.block_size)

    def __getitem__(self, i: int) -> dict:
        if self._arrays is None:
            feats = open_features(self.workdir.features(self.split))[1]
            self._arrays = (feats[self.key], feats["targets"])
        h, targets = self._arrays
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
        values = (NeighborValues(self.workdir, self.key, self.metric, split, self.retrieved)
                  if self.retrieved else None)
        data = FeatureBlocks(self.workdir, split, self.key, self.block_size, values,
                             self.train_tokens if split == "train" else self.eval_tokens)
        return DataLoader(data, batch_size=None, shuffle=train, num_workers=self.num_workers,
                          pin_memory=pin_memory(),
                          sampler=None if train else eval_sampler(self, data))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def eval_dataloader(self, split: str) -> DataLoader:
        return self._loader(split, False)
