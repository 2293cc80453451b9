"""A LightningModule base for every next-token model here (base LM and the heads).

Subclasses implement ``token_nll(batch, stage) -> (nll, mask, positions)``; this class turns it
into the training loss, token-weighted ``val/ppl``/``test/ppl`` (exp(Σ NLL / Σ tokens), reduced
across DDP ranks), per-token log-probabilities from ``predict``, and the AdamW + warmup/cosine
optimiser of its ``OptimConfig`` over the trainable parameters (``lr_groups`` names those
trained at their own rate).

Nothing here reads the data module: what a model needs from the data comes in as init
arguments (linked by ``gnnlm.lit.cli``), for arrays through ``attach_output_embedding``
(``gnnlm.lit.datastore``), and per batch in the batch itself.

Every init argument is saved (``save_hyperparameters``, so a checkpoint rebuilds the model), and
the ones the module reads are kept as typed attributes too: the code reads those.
"""
from __future__ import annotations

import math
from typing import Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.utilities import GradClipAlgorithmType
from torch_geometric.data.data import BaseData

from gnnlm.lit.optim import adamw_warmup_cosine
from gnnlm.lit.settings import OptimConfig
from gnnlm.models.base import LogitTransform
from gnnlm.utils.metrics import TokenNLL


def predicted_tokens(nll: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> dict:
    """``predict``'s output for a batch: the scored tokens' split positions and log p(target)."""
    keep = mask.bool()
    return {"positions": positions[keep].cpu(), "logprob": (-nll[keep]).float().cpu()}


class TokenLevelModule(pl.LightningModule):
    """Subclasses take ``optim: OptimConfig`` and set ``self.optim`` (``OptimConfig.of``).

    Heads on frozen features set ``uses_output_embedding = True`` and ``vocab_size`` /
    ``feature_dim``: the base LM's output embedding is then set with
    ``attach_output_embedding`` (by ``gnnlm.lit.datastore.AttachDatastore`` in a ``gnnlm``
    command) into non-persistent buffers ``out_weight`` / ``out_bias``, kept out of checkpoints.
    """
    uses_output_embedding = False
    optim: OptimConfig
    vocab_size: int = 0
    feature_dim: int = 0

    def __init__(self):
        super().__init__()
        self.val_nll, self.test_nll = TokenNLL(), TokenNLL()
        self.logit_transform = LogitTransform()  # the base LM's scale and soft-cap, with W
        if self.uses_output_embedding:
            self.register_buffer("out_weight", torch.empty(0), persistent=False)
            self.register_buffer("out_bias", torch.empty(0), persistent=False)

    def attach_output_embedding(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                logit_transform: Optional[LogitTransform] = None) -> None:
        V, d = weight.shape
        if d != self.feature_dim or (self.vocab_size and V != self.vocab_size):
            raise ValueError(f"The output embedding is {V}×{d} but the model was built for "
                             f"vocab_size={self.vocab_size}, feature_dim={self.feature_dim}.")
        self.logit_transform = logit_transform or LogitTransform()
        self.out_weight = weight.to(self.device, torch.float32)
        self.out_bias = (bias if bias is not None else torch.zeros(V)).to(self.device,
                                                                        torch.float32)

    @property
    def has_output_embedding(self) -> bool:
        return self.uses_output_embedding and self.out_weight.numel() > 0

    def output_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_output_embedding:
            raise RuntimeError("No output embedding: call attach_output_embedding(W, b) first.")
        return self.out_weight, self.out_bias

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """Lightning copies tensors to a GPU without waiting (``non_blocking``, from the
        loader's pinned memory), in dicts and lists too, but moves an object with a ``.to`` of
        its own by calling it with the device alone: a PyG batch (GNN-LM's) would then be
        copied by blocking copies, each waiting for every kernel queued before it, the previous
        step's included. It is moved as Lightning moves tensors."""
        if isinstance(batch, BaseData) and device.type == "cuda":
            return batch.to(device, non_blocking=True)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def token_nll(self, batch, stage: str) -> tuple[torch.Tensor, torch.Tensor,
                                                   Optional[torch.Tensor]]:
        """``(nll [n], mask [n] float, split positions [n] or None)`` for the batch's tokens."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        nll, mask, _ = self.token_nll(batch, "train")
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        # Nothing here reads a value back from the device: on a GPU each read waits for every
        # queued kernel, so the host could not queue the next step while this one runs (a
        # batch size only weights epoch means, and the bar reads the loss once a second)
        self.log("train/loss", loss)
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
        if positions is None:
            raise ValueError(f"{type(self).__name__}'s predict batches carry no split positions: "
                             f"predict needs them to put every score in its place.")
        return predicted_tokens(nll, mask, positions)

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

    def lr_groups(self) -> list[tuple[list[torch.nn.Parameter], float]]:
        """``(parameters, lr)`` trained at another learning rate than ``lr`` (none here)."""
        return []

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.named_parameters(), self.optim, self.lr_groups())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, which its mixed-precision plugin refuses for a fused optimiser
        under ``bf16-mixed`` too (pytorch-lightning issue 21435): the refusal guards a loss
        scaler's gradients, which a fused step unscales only inside its kernel, but bf16
        autocast has no scaler, so its gradients are the true ones. They are clipped here as
        every other precision plugin clips them."""
        plugin = self.trainer.precision_plugin
        if (gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None
                and getattr(optimizer, "_step_supports_amp_scaling", False)):
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val,
                                     GradClipAlgorithmType(gradient_clip_algorithm or "norm"))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val,
                                            gradient_clip_algorithm)
