"""LightningDataModule over frozen features, for heads that read one position at a time
(SPALM's gate, learned W_ds): each item is a block of consecutive positions of a split with
their feature ``h`` (of ``key``), target, and — when ``neighbors`` is set — the values (next
tokens) of their top-k retrieved train positions (-1 = none; train queries were masked for
leakage when the neighbours were built). Blocks partition each split, so evaluation scores every
token once, the same tokens as every other row of a report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from gnnlm.artifacts import ArtifactError, open_array, read_manifest
from gnnlm.datastore import (
    check_key,
    features_dir,
    load_output_embedding,
    open_features,
)


class NeighborValues:
    """The values (next tokens) of the top-k retrieved train positions of a split's positions,
    read from ``<workdir>/neighbors/<neighbors>/<split>`` (-1 where fewer than k were found)."""

    def __init__(self, workdir: Path, neighbors: str, split: str, k: int):
        self.workdir, self.k = Path(workdir), k
        self.dir = self.workdir / "neighbors" / neighbors / split
        manifest = read_manifest(self.dir, kind="neighbors")
        if manifest["K"] < k:
            raise ValueError(f"k={k} neighbours asked for but {self.dir} holds only "
                             f"K={manifest['K']}.")
        self.n = manifest["n"]  # positions covered (train neighbours may cover only a prefix)
        self._arrays = None  # memmaps open lazily in each worker

    def __call__(self, positions) -> torch.Tensor:
        """``positions``: a slice or an index array of the split → values ``[..., k]`` int64."""
        if self._arrays is None:
            self._arrays = (open_array(self.dir, "ids"),
                            open_features(features_dir(self.workdir, "train"))[1]["targets"])
        ids, values = self._arrays
        nbr = np.asarray(ids[positions, : self.k], dtype=np.int64)
        return torch.from_numpy(np.where(nbr >= 0, values[np.maximum(nbr, 0)], -1)
                                .astype(np.int64))


class FeatureBlocks(Dataset):
    def __init__(self, workdir: Path, split: str, key: str, neighbors: Optional[str], k: int,
                 block_size: int, max_tokens: Optional[int] = None):
        self.workdir, self.split, self.key = workdir, split, key
        self.neighbors, self.k, self.block_size = neighbors, k, block_size
        manifest = read_manifest(features_dir(workdir, split), kind="features")
        check_key(manifest, key)
        n = manifest["n"]
        self.nbr_values = NeighborValues(workdir, neighbors, split, k) if neighbors else None
        if self.nbr_values is not None:
            n = self.nbr_values.n  # train neighbours may cover only a prefix
        self.n = n if max_tokens is None else min(n, max_tokens)
        self._arrays = None  # memmaps open lazily in each worker

    def _open(self):
        _, feats = open_features(features_dir(self.workdir, self.split))
        self._arrays = (feats[self.key], feats["targets"])

    def __len__(self) -> int:
        return -(-self.n // self.block_size)

    def __getitem__(self, i: int) -> dict:
        if self._arrays is None:
            self._open()
        h, targets = self._arrays
        rows = slice(i * self.block_size, min((i + 1) * self.block_size, self.n))
        item = {"h": torch.from_numpy(np.asarray(h[rows], dtype=np.float32)),
                "target": torch.from_numpy(np.asarray(targets[rows], dtype=np.int64)),
                "positions": torch.arange(rows.start, rows.stop)}
        if self.nbr_values is not None:
            item["nbr_values"] = self.nbr_values(rows)
        return item


class FeatureDataModule(pl.LightningDataModule):
    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final",
                 neighbors: Optional[str] = None, k: int = 4, block_size: int = 512,
                 num_workers: int = 0, train_tokens: Optional[int] = None,
                 eval_tokens: Optional[int] = None, predict_split: str = "test"):
        """``neighbors`` names ``<workdir>/neighbors/<neighbors>/<split>`` (SPALM); ``block_size``
        positions form one batch; ``train_tokens``/``eval_tokens`` keep split prefixes."""
        super().__init__()
        self.save_hyperparameters()
        self.workdir = Path(workdir)
        try:
            manifest = read_manifest(features_dir(workdir, "train"), kind="features")
        except ArtifactError as err:
            raise ArtifactError(f"{err} Heads on frozen features read the artifacts of "
                                f"`gnnlm pipeline`; run its retrieval stages first.") from err
        self.feature_dim, self.vocab_size = manifest["dim"], manifest["vocab_size"]

    def output_embedding(self):
        return load_output_embedding(self.workdir)

    def _loader(self, split: str, train: bool) -> DataLoader:
        hp = self.hparams
        data = FeatureBlocks(self.workdir, split, hp.key, hp.neighbors, hp.k, hp.block_size,
                             hp.train_tokens if split == "train" else hp.eval_tokens)
        return DataLoader(data, batch_size=None, shuffle=train, num_workers=hp.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.predict_split, False)
