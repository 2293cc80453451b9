"""LightningDataModule of contiguous Transformer-XL segments over a datastore's splits, each
position carrying its split position and the values (next tokens) of its first ``retrieved``
neighbours, for SPALM trained end to end (``gnnlm.lit.spalm.SpalmXL``) and its baselines.

Everything comes from ``gnnlm pipeline``'s work directory, so the tokens, the neighbours and the
base LM are those of the datastore: the token stream of split s is ``[bos] + targets`` of
``features/<s>``, and the neighbours are ``neighbors/<key>-<metric>/<s>`` (train queries masked
for leakage when they were built). Train uses the prefix of train positions that have
neighbours (or ``train_tokens`` of it); valid/test use every position.

Each split is cut into S contiguous streams served segment by segment
(``gnnlm.models.segments.StreamSegments``): batch j holds segment j of the same streams as batch
j - 1, so a model's memory flows from one batch to the next, and every position of a split is
scored exactly once (padding is masked). This is how Transformer-XL is evaluated; a model
without memory reads each segment alone. Every stream starts cold, so the scores depend on S:
valid/test use ``eval_streams`` streams in all, shared among the processes, so that the
protocol (``scoring_protocol``, recorded with every row) is the same on one device or eight.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from datamodules.base import WorkdirDataModule, loader_options
from datamodules.features import NeighborValues
from datamodules.sampling import eval_sampler
from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.models.segments import StreamSegments
from gnnlm.workdir.layout import SPLITS
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError


class SegmentsWithValues(StreamSegments):
    """``StreamSegments`` items plus, with ``values``, ``nbr_values [T, k]`` (-1 = none or
    padding), and ``split``, the split's name: SPALM's predict records its k curve on valid
    only (``gnnlm.lit.spalm``)."""

    def __init__(self, stream: torch.Tensor, n_streams: int, segment: int,
                 values: Optional[NeighborValues] = None, split: Optional[str] = None):
        super().__init__(stream, n_streams, segment)
        self.values, self.split = values, split

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        if self.split is not None:
            item["split"] = self.split
        positions = item["positions"]
        scored = positions >= 0
        if self.values is not None:
            values = torch.full((self.segment, self.values.k), -1, dtype=torch.int64)
            if scored.any():
                values[scored] = self.values(positions[scored].numpy())
            item["nbr_values"] = values
        return item


class SpalmDataModule(WorkdirDataModule):
    reads = frozenset({"neighbors"})  # of the pipeline's retrieval artifacts

    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final", metric: str = "cos",
                 retrieved: int = 16, block_size: int = 512, batch_size: int = 16,
                 eval_streams: int = 16, train_tokens: Optional[int] = None,
                 num_workers: int = 0, base_lm_path: Optional[str] = None,
                 predict_split: str = "test"):
        """Contiguous Transformer-XL segments of each split with their retrieved next tokens.

        Args:
            workdir: the work directory of ``gnnlm pipeline`` whose artifacts are read.
            key: the features whose neighbours give the retrieved values.
            metric: the similarity those neighbours were searched with.
            retrieved: retrieved next tokens each position carries (0: none; at most the
                stored K; at least the model's k and the largest k of its k curve).
            block_size: the segment length T.
            batch_size: parallel train streams per device.
            eval_streams: parallel valid/test streams in all (each of W processes reads
                eval_streams / W of them, so W must divide it).
            train_tokens: keep only this train prefix (at most what the train neighbours
                cover; None: all of it).
            num_workers: DataLoader worker processes.
            base_lm_path: where the base LM is loaded from (None: the one the features
                record).
            predict_split: the split ``predict`` scores.
        """
        self.check_arguments(retrieved=retrieved, eval_streams=eval_streams)
        super().__init__(workdir, predict_split)
        self.save_hyperparameters()
        self.key, self.metric, self.block_size = key, metric, block_size
        self.batch_size, self.eval_streams = batch_size, eval_streams
        self.train_tokens, self.num_workers = train_tokens, num_workers
        self.check_train_neighbors(key, metric)
        with self.reading_artifacts("tokens, features, train neighbours"):
            self.manifests = {s: self.workdir.features_manifest(s) for s in SPLITS}
            tokens = read_manifest(self.workdir.tokens, kind="tokens")
            neighbors = read_manifest(self.workdir.neighbors(key, metric, "train"),
                                      kind="neighbors")
        # what the model is linked with, so that it refuses a k the data cannot serve
        self.retrieved, self.stored_k = retrieved, int(neighbors["K"])
        self.train_covered = int(neighbors["n"])
        train = self.manifests["train"]
        self.use_features(train)
        self.bos_id = tokens["bos_id"]
        # linked into the model, which checks the weights against the datastore's fingerprint
        self.use_base_lm(train, base_lm_path)

    @classmethod
    def check_arguments(cls, **args: Any) -> None:
        """``WorkdirDataModule.check_arguments``, ``retrieved`` >= 0 and ``eval_streams``
        >= 1."""
        super().check_arguments(**args)
        retrieved, streams = args.get("retrieved"), args.get("eval_streams")
        if retrieved is not None and retrieved < 0:
            raise ValueError(f"retrieved must be >= 0 (got {retrieved}).")
        if streams is not None and streams < 1:
            raise ValueError(f"eval_streams must be >= 1 (got {streams}).")

    def n_positions(self, split: str) -> int:
        """Positions served for ``split``: the covered train prefix, or every valid/test (or
        text) one."""
        if split == "train":
            asked = self.train_tokens
            if asked is not None and not 0 < asked <= self.train_covered:
                raise ValueError(f"train_tokens={asked} but the train neighbours cover only the "
                                 f"first {self.train_covered} positions: lower train_tokens or "
                                 f"build neighbours for more train queries.")
            return asked or self.train_covered
        return self.arrays.n(split)

    def scoring_protocol(self, memory: int) -> Protocol:
        """How valid/test are scored by a model with ``memory`` cached states per layer."""
        return protocols.segments(self.block_size, self.eval_streams, memory)

    def _values(self, split: str) -> Optional[NeighborValues]:
        if not self.retrieved:
            return None
        values = NeighborValues(self.arrays, self.key, self.metric, split, self.retrieved)
        if split != "train" and values.n != self.n_positions(split):
            raise ArtifactError(f"{values.dir} covers {values.n} positions but the {split} "
                                f"features hold {self.n_positions(split)}: rebuild the "
                                f"neighbours.")
        return values

    def segments(self, split: str, n_streams: int) -> SegmentsWithValues:
        stream = self.token_stream(split, self.n_positions(split), self.bos_id)
        return SegmentsWithValues(stream, n_streams, self.block_size, self._values(split), split)

    def _loader(self, split: str) -> DataLoader:
        """Rank r of W reads items r, r + W, … (streams r, r + W, … of every segment), in
        order: the S streams divide evenly among the ranks, so no rank reads an item twice.
        Train reads batch_size x W streams; valid/test read eval_streams whatever W is."""
        world = self.trainer.world_size if self.trainer is not None else 1
        if split == "train":
            batch_size = self.batch_size
            n_streams = batch_size * world
        else:
            n_streams = self.eval_streams
            if n_streams % world:
                raise ValueError(f"data.eval_streams = {n_streams} must be a multiple of the "
                                 f"{world} processes (each reads as many streams): set it to "
                                 f"{world * -(-n_streams // world)}.")
            batch_size = n_streams // world
        data = self.segments(split, n_streams)
        return DataLoader(data, batch_size=batch_size, shuffle=False,
                          num_workers=self.workers(split), **loader_options(),
                          sampler=None if split == "train" else eval_sampler(self, data))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def eval_dataloader(self, split: str) -> DataLoader:
        return self._loader(split)
