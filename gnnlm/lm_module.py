"""LightningModule that trains the built-in GPT base LM (AdamW, warmup + cosine, clipping).

The nn.Module (``gnnlm.models.gpt.GPT``) holds the network; this module holds the training loop
glue only. Evaluation batches carry a score mask (sliding windows or memory segments), and
perplexity is token-weighted over the whole split: ``val/ppl`` and ``test/ppl``.

With ``memory_length > 0`` (Transformer-XL short-term memory) the data module serves contiguous
segments per stream, and the memory of one batch is passed to the next.
"""
from __future__ import annotations

import math
from typing import Optional

import pytorch_lightning as pl
import torch
from torch.nn import functional as F

from gnnlm.metrics import TokenNLL
from gnnlm.models.gpt import GPT, GPTConfig


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModel(pl.LightningModule):
    def __init__(self, vocab_size: int = 0, context_length: int = 256, n_layer: int = 4,
                 n_head: int = 4, d_model: int = 256, d_ff: int = 1024, dropout: float = 0.1,
                 tie_embeddings: bool = True, memory_length: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 warmup_steps: int = 100, min_lr_ratio: float = 0.1):
        """``vocab_size`` is linked from the data module by the CLI."""
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(
            vocab_size=vocab_size, context_length=context_length, n_layer=n_layer, n_head=n_head,
            d_model=d_model, d_ff=d_ff, dropout=dropout, tie_embeddings=tie_embeddings,
            memory_length=memory_length))
        self.memory_length = memory_length
        self.val_nll, self.test_nll = TokenNLL(), TokenNLL()
        self._memory: dict[str, Optional[list[torch.Tensor]]] = {}

    # -- shared step -----------------------------------------------------------------------
    def _nll(self, batch: dict, stage: str) -> torch.Tensor:
        """Per-token NLL ``[B, T]``; carries Transformer-XL memory between batches of a stage."""
        memory = self._memory.get(stage) if self.memory_length else None
        if memory is not None and memory[0].shape[0] != batch["input"].shape[0]:
            memory = None  # a smaller final batch: its streams are not the previous ones
        feats = self.model(batch["input"], memory=memory)
        if self.memory_length:
            self._memory[stage] = feats.memory
        logits = self.model.logits(feats.final)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten(),
                               reduction="none").view_as(batch["target"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        nll = self._nll(batch, "train")
        mask = batch.get("mask")
        loss = nll.mean() if mask is None else (nll * mask).sum() / mask.sum().clamp(min=1)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_epoch_start(self) -> None:
        self._memory["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._memory["val"] = None

    def on_test_epoch_start(self) -> None:
        self._memory["test"] = None

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_nll.update(self._nll(batch, "val"), batch["mask"])

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.test_nll.update(self._nll(batch, "test"), batch["mask"])

    def _log_eval(self, stage: str, metric: TokenNLL) -> None:
        nll = metric.compute()
        self.log(f"{stage}/loss", nll.float(), sync_dist=False)
        self.log(f"{stage}/ppl", nll.exp().float(), prog_bar=True)
        self.log(f"{stage}/bpt", (nll / math.log(2)).float())
        self.log(f"{stage}/tokens", metric.count.float())
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val", self.val_nll)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_nll)

    # -- optimisation ----------------------------------------------------------------------
    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}],
                                      lr=hp.lr, betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
