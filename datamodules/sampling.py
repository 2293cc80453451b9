"""Evaluation under DDP without duplicates.

Lightning's default ``DistributedSampler`` pads the last round with repeated items so that every
rank gets as many; a token-weighted perplexity would then count some tokens twice. Evaluation
loaders use ``UnpaddedShards`` instead: rank r reads items r, r + W, r + 2W, ... and nothing
twice (Lightning keeps a sampler that is already a ``DistributedSampler``).

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from typing import Optional

from torch.utils.data import Dataset, DistributedSampler


class UnpaddedShards(DistributedSampler):
    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]


def eval_sampler(datamodule, dataset: Dataset) -> Optional[UnpaddedShards]:
    """The evaluation sampler of ``dataset`` for the datamodule's trainer (None: one process)."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None or trainer.world_size <= 1:
        return None
    return UnpaddedShards(dataset, trainer.world_size, trainer.global_rank)
