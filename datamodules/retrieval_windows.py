"""LightningDataModule of token windows over a datastore's splits, each position carrying the
values (next tokens) of its top-k retrieved train positions, for heads that run the base LM
itself (SPALM with its last block fine-tuned) rather than read frozen features.

Everything comes from ``gnnlm pipeline``'s work directory, so the tokens, the neighbours and the
base LM are those of the datastore: the token stream of split s is ``[bos] + targets`` of
``features/<s>``; training uses non-overlapping blocks of the train prefix that the train
neighbours cover (leakage-masked when they were built); valid/test use the features' sliding
windows (context C, stride S), so each position is scored once with the context its feature had.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset

from datamodules.features import NeighborValues
from datamodules.lm import Blocks, SlidingWindows
from datamodules.sampling import eval_sampler
from gnnlm.models import hf_options, protocols
from gnnlm.models.encode import stream_tensor
from gnnlm.models.protocols import Protocol
from gnnlm.retrieval.features import open_features
from gnnlm.workdir.artifacts import ArtifactError, read_manifest
from gnnlm.workdir.layout import SPLITS, Workdir


class WithNeighborValues(Dataset):
    """Items of ``data`` (which carry ``positions``) plus ``nbr_values [T, k]``."""

    def __init__(self, data: Dataset, values: NeighborValues):
        self.data, self.values = data, values

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.data[i])
        item["nbr_values"] = self.values(item["positions"].numpy())
        return item


class RetrievalWindowsDataModule(pl.LightningDataModule):
    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final", metric: str = "cos",
                 retrieved: int = 4, block_size: int = 128, batch_size: int = 16,
                 eval_batch_size: int = 32, train_tokens: Optional[int] = None,
                 num_workers: int = 0, base_lm_path: Optional[str] = None,
                 predict_split: str = "test"):
        """``retrieved``: how many retrieved next tokens each position carries (SPALM's K), from
        the neighbours of the ``key`` features under ``metric``; ``train_tokens`` keeps a train
        prefix (at most what the train neighbours cover); ``base_lm_path`` overrides where the
        base LM the features record is loaded from (a ``gnnlm fit`` checkpoint or
        ``hf:<name>``)."""
        super().__init__()
        self.save_hyperparameters()
        self.workdir = Workdir(workdir)
        try:
            self.manifests = {s: self.workdir.features_manifest(s) for s in SPLITS}
            tokens = read_manifest(self.workdir.tokens, kind="tokens")
        except ArtifactError as err:
            raise ArtifactError(f"{err} This data module reads the artifacts of `gnnlm pipeline` "
                                f"(tokens, features, neighbours); run its retrieval stages "
                                f"first.") from err
        train = self.manifests["train"]
        self.vocab_size, self.feature_dim = train["vocab_size"], train["dim"]
        self.bos_id = tokens["bos_id"]
        # the model loads this LM and checks its weights against the datastore's fingerprint
        self.base_lm = base_lm_path or self._recorded_base_lm(train["base_lm"])
        self.base_lm_fingerprint = train["base_lm"]["fingerprint"]
        self.base_lm_options = hf_options(train["base_lm"])
        self.window_bos = self.bos_id if train.get("bos_each_window") else None
        self.context, self.stride = (self.manifests["valid"]["config"][name]
                                     for name in ("context", "stride"))

    def _recorded_base_lm(self, identity: dict) -> str:
        """Where the features say their base LM is: ``hf:<name>``, or a checkpoint path relative
        to the work directory (so the directory can move)."""
        location = identity.get("location")
        if not location:
            raise ArtifactError(f"The features in {self.workdir.features('train')} do not record "
                                f"where their base LM is: pass base_lm_path.")
        return location if location.startswith("hf:") else str(self.workdir.resolve(location))

    def scoring_protocol(self, memory: int = 0) -> Protocol:
        """How valid/test are scored: the datastore's sliding windows."""
        return protocols.sliding_window(self.context, self.stride, self.window_bos is not None)

    def _values(self, split: str) -> NeighborValues:
        hp = self.hparams
        return NeighborValues(self.workdir, hp.key, hp.metric, split, hp.retrieved)

    def _stream(self, split: str, n: int):
        targets = open_features(self.workdir.features(split))[1]["targets"]
        return stream_tensor(np.asarray(targets[:n]), self.bos_id)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        values = self._values("train")
        n = values.n if hp.train_tokens is None else hp.train_tokens
        if n > values.n:
            raise ValueError(f"train_tokens={n} but the train neighbours in {values.dir} cover "
                             f"only the first {values.n} positions: lower train_tokens or build "
                             f"neighbours for more train queries.")
        blocks = Blocks(self._stream("train", n), hp.block_size, self.window_bos)
        data = WithNeighborValues(blocks, values)
        return DataLoader(data, batch_size=hp.batch_size, shuffle=True, drop_last=True,
                          num_workers=hp.num_workers)

    def _eval_loader(self, split: str) -> DataLoader:
        values = self._values(split)
        n = self.manifests[split]["n"]
        if values.n != n:
            raise ArtifactError(f"{values.dir} covers {values.n} positions but the {split} "
                                f"features hold {n}: rebuild the neighbours.")
        data = WithNeighborValues(SlidingWindows(self._stream(split, n), self.context,
                                                 self.stride, self.window_bos), values)
        return DataLoader(data, batch_size=self.hparams.eval_batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, sampler=eval_sampler(self, data))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.hparams.predict_split)
