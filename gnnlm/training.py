"""A LightningModule base for every next-token model here (base LM and the heads).

Subclasses implement ``token_nll(batch, stage) -> (nll, mask, positions)``; this class turns it
into the training loss, token-weighted ``val/ppl``/``test/ppl`` (exp(Σ NLL / Σ tokens), reduced
across DDP ranks), per-token log-probabilities from ``predict``, and the AdamW + warmup/cosine
optimiser over the trainable parameters.
"""
from __future__ import annotations

import math
from typing import Optional

import pytorch_lightning as pl
import torch

from gnnlm.metrics import TokenNLL
from gnnlm.optim import adamw_warmup_cosine


class TokenLevelModule(pl.LightningModule):
    """Needs hparams ``lr``, ``weight_decay``, ``warmup_steps``, ``min_lr_ratio``."""

    def __init__(self):
        super().__init__()
        self.val_nll, self.test_nll = TokenNLL(), TokenNLL()

    def token_nll(self, batch, stage: str) -> tuple[torch.Tensor, torch.Tensor,
                                                   Optional[torch.Tensor]]:
        """``(nll [n], mask [n] float, split positions [n] or None)`` for the batch's tokens."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        nll, mask, _ = self.token_nll(batch, "train")
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(mask.sum()))
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        nll, mask, _ = self.token_nll(batch, "val")
        self.val_nll.update(nll, mask)

    def test_step(self, batch, batch_idx: int) -> None:
        nll, mask, _ = self.token_nll(batch, "test")
        self.test_nll.update(nll, mask)

    def predict_step(self, batch, batch_idx: int) -> dict:
        """Per-token log p(target) with split positions, for reports on exactly the same tokens."""
        nll, mask, positions = self.token_nll(batch, "predict")
        keep = mask.bool()
        return {"positions": positions[keep].cpu(), "logprob": (-nll[keep]).float().cpu()}

    def _log_eval(self, stage: str, metric: TokenNLL) -> None:
        nll = metric.compute()  # already summed over ranks
        self.log(f"{stage}/loss", nll.float())
        self.log(f"{stage}/ppl", nll.exp().float(), prog_bar=True)
        self.log(f"{stage}/bpt", (nll / math.log(2)).float())
        self.log(f"{stage}/tokens", metric.count.float())
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val", self.val_nll)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_nll)

    def configure_optimizers(self):
        hp = self.hparams
        return adamw_warmup_cosine(self, self.named_parameters(), hp.lr, hp.weight_decay,
                                   hp.warmup_steps, hp.min_lr_ratio, hp.get("betas", (0.9, 0.95)))
