"""LightningDataModule of token windows over a datastore's splits, each position carrying the
values (next tokens) of its top-k retrieved train positions, for heads that run the base LM
itself (SPALM with its last block fine-tuned) rather than read frozen features.

Everything comes from ``gnnlm pipeline``'s work directory, so the tokens, the neighbours and the
base LM are those of the datastore: the token stream of split s is ``[bos] + targets`` of
``features/<s>``; training uses non-overlapping blocks of the train prefix that the train
neighbours cover (leakage-masked when they were built); valid/test use the features' sliding
windows (context C, stride S), so each position is scored once with the context its feature had.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from typing import Optional

from torch.utils.data import DataLoader, Dataset

from datamodules.base import WorkdirDataModule, loader_options
from datamodules.features import NeighborValues
from datamodules.lm import Blocks, SlidingWindows
from datamodules.sampling import eval_sampler
from gnnlm.models import hf_options, protocols
from gnnlm.models.protocols import Protocol
from gnnlm.workdir.layout import SPLITS
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError


class WithNeighborValues(Dataset):
    """Items of ``data`` (which carry ``positions``) plus ``nbr_values [T, k]``."""

    def __init__(self, data: Blocks | SlidingWindows, values: NeighborValues):
        self.data, self.values = data, values

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.data[i])
        item["nbr_values"] = self.values(item["positions"].numpy())
        return item


class RetrievalWindowsDataModule(WorkdirDataModule):
    reads = frozenset({"neighbors"})  # of the pipeline's retrieval artifacts

    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final", metric: str = "cos",
                 retrieved: int = 4, block_size: int = 128, batch_size: int = 16,
                 eval_batch_size: int = 32, train_tokens: Optional[int] = None,
                 num_workers: int = 0, base_lm_path: Optional[str] = None,
                 predict_split: str = "test"):
        """Token windows of each split with their retrieved next tokens, for heads that run
        the base LM.

        Args:
            workdir: the work directory of ``gnnlm pipeline`` whose artifacts are read.
            key: the features whose neighbours give the retrieved values.
            metric: the similarity those neighbours were searched with.
            retrieved: retrieved next tokens each position carries (SPALM's K).
            block_size: tokens per train block.
            batch_size: train blocks per batch.
            eval_batch_size: valid/test windows per batch.
            train_tokens: keep only this train prefix (at most what the train neighbours
                cover; None: all of it).
            num_workers: DataLoader worker processes.
            base_lm_path: where the base LM is loaded from (a ``gnnlm fit`` checkpoint or
                ``hf:<name>``; None: the one the features record).
            predict_split: the split ``predict`` scores.
        """
        super().__init__(workdir, predict_split)
        self.save_hyperparameters()
        self.key, self.metric, self.retrieved, self.block_size = key, metric, retrieved, block_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.train_tokens, self.num_workers = train_tokens, num_workers
        self.check_train_neighbors(key, metric)
        with self.reading_artifacts("tokens, features, neighbours"):
            self.manifests = {s: self.workdir.features_manifest(s) for s in SPLITS}
            tokens = read_manifest(self.workdir.tokens, kind="tokens")
        train = self.manifests["train"]
        self.use_features(train)
        self.bos_id = tokens["bos_id"]
        # the model loads this LM and checks its weights against the datastore's fingerprint
        self.use_base_lm(train, base_lm_path)
        self.base_lm_options = hf_options(train["base_lm"])
        self.window_bos = self.bos_id if train.get("bos_each_window") else None
        self.context, self.stride = (self.manifests["valid"]["config"][name]
                                     for name in ("context", "stride"))

    def scoring_protocol(self, memory: int = 0) -> Protocol:
        """How valid/test are scored: the datastore's sliding windows."""
        return protocols.sliding_window(self.context, self.stride, self.window_bos is not None)

    def _values(self, split: str) -> NeighborValues:
        return NeighborValues(self.arrays, self.key, self.metric, split, self.retrieved)

    def train_dataloader(self) -> DataLoader:
        values = self._values("train")
        n = values.n if self.train_tokens is None else self.train_tokens
        if n > values.n:
            raise ValueError(f"train_tokens={n} but the train neighbours in {values.dir} cover "
                             f"only the first {values.n} positions: lower train_tokens or build "
                             f"neighbours for more train queries.")
        blocks = Blocks(self.token_stream("train", n, self.bos_id), self.block_size,
                        self.window_bos)
        data = WithNeighborValues(blocks, values)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, **loader_options())

    def eval_dataloader(self, split: str) -> DataLoader:
        values = self._values(split)
        n = self.arrays.n(split)
        if values.n != n:
            raise ArtifactError(f"{values.dir} covers {values.n} positions but the {split} "
                                f"features hold {n}: rebuild the neighbours.")
        windows = SlidingWindows(self.token_stream(split, n, self.bos_id), self.context,
                                 self.stride, self.window_bos)
        data = WithNeighborValues(windows, values)
        return DataLoader(data, batch_size=self.eval_batch_size, shuffle=False,
                          num_workers=self.workers(split), **loader_options(),
                          sampler=eval_sampler(self, data))
