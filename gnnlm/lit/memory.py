"""Transformer-XL memory across batches (Dai et al. 2019), for the LightningModules whose network
caches the hidden states of the previous segment: the base LM with memory
(``gnnlm.lit.lm.LanguageModel``) and SPALM end to end (``gnnlm.lit.spalm.SpalmXL``).

The data serves each split as contiguous segments of parallel streams, in order, so batch j
holds segment j of the same streams as batch j - 1: the memory a batch leaves is the one the
next batch of the same stage reads. Each stage (train, val, test, predict) keeps its own, a
pass over a split starts without any, and a stage that ends lets its memory go: the next stage
would hold it beside its own (the table's Transformer-XL in training leaves 6 layers × 32
streams × 512 states × 512 float32, 201 MB).
"""
from __future__ import annotations

from typing import Optional

import torch


class SegmentMemory:
    """Mix in before ``TokenLevelModule``; the module sets ``memory_length`` (M cached states per
    layer; 0: no memory) and reads ``memory_for`` / writes ``keep_memory`` around its network."""

    memory_length: int

    def __init__(self):
        super().__init__()
        self._memory: dict[str, Optional[list[torch.Tensor]]] = {}

    def memory_for(self, stage: str, batch_size: int) -> Optional[list[torch.Tensor]]:
        """The memory the previous batch of ``stage`` left (None: none, or no memory)."""
        memory = self._memory.get(stage) if self.memory_length else None
        if memory is not None and memory[0].shape[0] != batch_size:
            return None  # a smaller final batch: its streams are not the previous ones
        return memory

    def keep_memory(self, stage: str, memory: Optional[list[torch.Tensor]]) -> None:
        """What this batch leaves for the next batch of ``stage``."""
        if self.memory_length:
            self._memory[stage] = memory

    def on_train_epoch_start(self) -> None:
        self._memory["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._memory["val"] = None

    def on_test_epoch_start(self) -> None:
        self._memory["test"] = None

    def on_predict_epoch_start(self) -> None:
        self._memory["predict"] = None

    def on_train_end(self) -> None:
        self._memory["train"] = None

    def on_validation_end(self) -> None:
        self._memory["val"] = None

    def on_test_end(self) -> None:
        self._memory["test"] = None

    def on_predict_end(self) -> None:
        self._memory["predict"] = None
