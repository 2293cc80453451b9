"""LightningModule that trains SPALM end to end (``gnnlm.spalm.model.Spalm``; batches from
``datamodules.spalm.SpalmDataModule``), and the two baselines it is compared with.

Every parameter is trained jointly: the Transformer-XL layers, the gate w_g and the word
embedding W (input, retrieved values and output at once). The keys are fixed: each token's
neighbours were retrieved with the frozen pretrained base LM, so only their values enter here.
The LM starts from the base LM's weights (``init: warm``) or at random with the same
architecture (``init: scratch``); ``memory_length`` M is its Transformer-XL memory.

The three rows of the comparison are this module with different settings, trained the same way
on the same contiguous segments and evaluated on the same segments (every position of a split
scored once, memory carried from one segment of a stream to the next):

- SPALM: ``k`` > 0, ``memory_length`` > 0 (short-term + long-term memory, gate);
- Transformer-XL: ``k`` = 0 (no gate: exactly the GPT), ``memory_length`` > 0;
- transformer: ``k`` = 0, ``memory_length`` = 0 (each segment read without memory).

Predict runs record, per scored token, the gate averaged over its d dimensions (SPALM Fig. 4-5
count tokens), and on the valid split the perplexity of the trained model when it reads each
k of ``k_curve`` neighbours (SPALM Table 5); ``gnnlm.pipeline.runner`` stores both with the scores.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.optim import warmup_cosine
from gnnlm.models import load_gpt_checkpoint
from gnnlm.models.gpt import GPT
from gnnlm.spalm.analysis import check_k_curve
from gnnlm.spalm.model import Spalm, SpalmOutput
from gnnlm.utils.metrics import target_nll

INITS = ("warm", "scratch")


class SpalmXL(TokenLevelModule):
    def __init__(self, base_lm: str = "", base_lm_fingerprint: Optional[str] = None,
                 vocab_size: int = 0, k: int = 4, memory_length: int = 128,
                 init: str = "warm", dropout: Optional[float] = None,
                 gate_bias: Optional[float] = None, memory_scale: str = "none",
                 k_curve: Optional[list[int]] = None, k_curve_tokens: Optional[int] = None,
                 lr: float = 1e-3, gate_lr: Optional[float] = None, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1):
        """``base_lm``: the built-in LM (a ``gnnlm fit`` checkpoint) that the datastore's keys
        come from; linked from ``SpalmDataModule``, which reads it from the features. Its
        architecture is the model's; ``init`` says whether its weights are the start.

        ``k``: the retrieved next tokens each position reads (0: no long-term memory, no
        gate). ``memory_length``: M cached states per layer (0: none).
        ``dropout``: None keeps the base LM's. ``k_curve``: the k's at which predict on valid
        also scores the model (Table 5; at most the values the data carries, and those at
        most the stored K); ``k_curve_tokens``: only the first that many valid positions.
        ``gate_bias`` and ``memory_scale``: None and ``"none"`` are the paper's equations; a
        number starts a learned gate bias, ``"learned"`` scales m_t by a learned s started at
        ‖h‖/‖y‖ (``gnnlm.spalm.model`` says what each changes; the report names those on).
        ``gate_lr``: the learning rate of what SPALM adds (w_g and log s; None: ``lr``); a
        warm-started LM wants a small step, while w_g starts from zero.
        """
        super().__init__()
        self.save_hyperparameters()
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS} (got {init!r}).")
        if k < 0 or memory_length < 0:
            raise ValueError(f"k and memory_length must be >= 0 (got {k}, "
                             f"{memory_length}).")
        if k_curve and (not k or min(k_curve) < 1):
            raise ValueError(f"k_curve {k_curve} needs a model with long-term memory "
                             f"(k > 0) and values k >= 1.")
        if not base_lm or base_lm.startswith("hf:"):
            raise ValueError("SpalmXL needs base_lm: a checkpoint of the built-in LM (the one "
                             "the datastore was built with; SpalmDataModule supplies it). "
                             "Transformer-XL memory needs the built-in GPT.")
        base = load_gpt_checkpoint(base_lm)
        if base_lm_fingerprint and base.fingerprint() != base_lm_fingerprint:
            raise ValueError(f"The base LM at {base_lm} (weights {base.fingerprint()}) is not "
                             f"the one the datastore was built with ({base_lm_fingerprint}): "
                             f"the neighbours belong to another model.")
        if vocab_size and vocab_size != base.vocab_size:
            raise ValueError(f"The data has vocab_size={vocab_size} but the base LM {base_lm} "
                             f"has {base.vocab_size}.")
        assert isinstance(base, GPT)
        config = dataclasses.replace(base.cfg, memory_length=memory_length,
                                     dropout=base.cfg.dropout if dropout is None else dropout)
        lm = GPT(config)
        if init == "warm":
            lm.load_state_dict(base.state_dict())
        self.model = Spalm(lm, long_term=k > 0, gate_bias=gate_bias, memory_scale=memory_scale)
        self.memory_length = memory_length
        self._memory: dict[str, Optional[list[torch.Tensor]]] = {}
        self.gate_means: dict[str, np.ndarray] = {}   # per split, of the last predict run
        self.k_curve_result: Optional[dict] = None

    # -- the loss -------------------------------------------------------------------------------
    def _values(self, batch: dict, k: int) -> Optional[torch.Tensor]:
        if self.model.gate is None:
            return None
        values = batch.get("nbr_values")
        carried = 0 if values is None else values.shape[-1]
        if values is None or carried < k:
            raise ValueError(f"The batch carries {carried} retrieved values per position but "
                             f"k = {k} are asked for: raise data.retrieved (at most the stored "
                             f"K neighbours).")
        return values[..., :k]

    def forward(self, batch: dict, stage: str = "predict",
                force_gate: Optional[float] = None) -> SpalmOutput:
        """The batch's segment, reading (and then replacing) the memory of ``stage``."""
        memory = self._memory.get(stage) if self.memory_length else None
        if memory is not None and memory[0].shape[0] != batch["input"].shape[0]:
            memory = None  # a smaller final batch: its streams are not the previous ones
        out = self.model(batch["input"], self._values(batch, self.hparams.k), memory,
                         force_gate)
        if self.memory_length:
            self._memory[stage] = out.memory
        return out

    def token_nll(self, batch: dict, stage: str):
        out = self(batch, stage)
        nll = target_nll(out.logits.flatten(0, 1), batch["target"].flatten())
        mask = batch["mask"].flatten().float()
        positions = batch["positions"].flatten()
        if stage == "predict":
            self._record(batch, out, nll, mask, positions)
        elif out.gate is not None:
            gate = (out.gate.mean(-1).flatten() * mask).sum() / mask.sum().clamp(min=1)
            self.log(f"{stage}/gate", gate.float(), batch_size=int(mask.sum()))
            if self.model.memory_scale is not None and stage == "train":
                self.log("train/memory_scale", self.model.memory_scale.detach().float().mean())
        return nll, mask, positions

    def setup(self, stage: str) -> None:
        """Refuse, before any work, a k the data cannot serve."""
        super().setup(stage)
        data = self.trainer.datamodule if self.trainer is not None else None
        hp = self.hparams
        needed = max([hp.k, *(hp.k_curve or [])])
        carried = getattr(getattr(data, "hparams", None), "retrieved", None)
        if self.model.gate is None or carried is None:
            return
        if hp.k_curve and hasattr(data, "stored_k"):
            check_k_curve(hp.k_curve, data.stored_k)
        if carried < needed:
            raise ValueError(f"The model reads up to k = {needed} retrieved values per position "
                             f"(k {hp.k}, k_curve {hp.k_curve}) but the data "
                             f"carries data.retrieved = {carried}: raise it.")

    def configure_optimizers(self):
        """AdamW + warmup/cosine (``gnnlm.lit.optim``), the gate and memory scale at
        ``gate_lr``."""
        hp = self.hparams
        gate = set(self.model.memory_parameters())
        groups = []
        for lr, params in ((hp.lr, [p for p in self.parameters() if p not in gate]),
                           (hp.gate_lr or hp.lr, [p for p in self.parameters() if p in gate])):
            groups += [{"params": [p for p in params if p.dim() >= 2], "lr": lr,
                        "weight_decay": hp.weight_decay},
                       {"params": [p for p in params if p.dim() < 2], "lr": lr,
                        "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr,
                                      betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule,
                                                         "interval": "step"}}

    # -- memory: carried within a stage, reset when a pass over a split starts -------------------
    def on_train_epoch_start(self) -> None:
        self._memory["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._memory["val"] = None

    def on_test_epoch_start(self) -> None:
        self._memory["test"] = None

    # -- predict: gate values and the k curve ----------------------------------------------------
    def _predict_split(self) -> str:
        data = self.trainer.datamodule if self.trainer is not None else None
        return getattr(getattr(data, "hparams", None), "predict_split", "test")

    def on_predict_epoch_start(self) -> None:
        self._memory["predict"] = None
        self._gate_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._curve = {k: [0.0, 0] for k in (self.hparams.k_curve or [])}

    @torch.no_grad()
    def _record(self, batch: dict, out: SpalmOutput, nll, mask, positions) -> None:
        if out.gate is None:
            return
        keep = mask.bool()
        gate = out.gate.flatten(0, 1)
        self._gate_parts.append((positions[keep].cpu(), gate[keep].float().mean(-1).cpu()))
        if not self._curve or self._predict_split() != "valid":
            return
        limit = self.hparams.k_curve_tokens
        if limit is not None:
            keep = keep & (positions < limit)
        if not keep.any():
            return
        h = out.final.flatten(0, 1)[keep]
        values = self._values(batch, max(self._curve))
        assert values is not None  # the model has a gate
        values = values.flatten(0, 1)[keep]
        target = batch["target"].flatten()[keep]
        for k, acc in self._curve.items():
            if k == self.hparams.k:
                nll_k = nll[keep]
            else:
                nll_k = target_nll(self.model.head(h, values[:, :k])[0], target)
            acc[0] += float(nll_k.double().sum())
            acc[1] += int(keep.sum())

    def on_predict_epoch_end(self) -> None:
        split = self._predict_split()
        if self._gate_parts:
            positions = torch.cat([p for p, _ in self._gate_parts]).numpy()
            values = torch.cat([g for _, g in self._gate_parts]).numpy()
            data = self.trainer.datamodule
            n = data.n_positions(split) if hasattr(data, "n_positions") else positions.max() + 1
            means = np.full(int(n), np.nan, dtype=np.float32)
            means[positions] = values
            self.gate_means[split] = means
        if self._curve and split == "valid":
            ks = sorted(self._curve)
            self.k_curve_result = {
                "split": "valid", "trained_k": self.hparams.k, "k": ks,
                "tokens": self._curve[ks[0]][1],
                "ppl": [float(np.exp(s / max(c, 1))) for s, c in (self._curve[k] for k in ks)]}
        self._gate_parts = []

    def predict_arrays(self) -> dict[str, np.ndarray]:
        """Per-token arrays saved beside the scores: ``<split>_gate``, the gate's mean over its
        d dimensions for every position of the split."""
        return {f"{split}_gate": means for split, means in self.gate_means.items()}

    def deviations(self) -> list[str]:
        """The options on that the paper's SPALM does not have (none for the baselines, which
        have no gate); the report names them in the row's label."""
        if self.model.gate is None:
            return []
        hp = self.hparams
        return ([] if hp.gate_bias is None else ["gate bias"]) + (
            ["memory scale"] if hp.memory_scale != "none" else [])

    def report_extras(self) -> dict:
        """What the report reads besides the scores (JSON)."""
        hp = self.hparams
        extras: dict = {"spalm": {"k": hp.k, "memory_length": hp.memory_length,
                                  "init": hp.init, "gate_bias": hp.gate_bias,
                                  "memory_scale": hp.memory_scale}}
        if self.gate_means:
            extras["spalm"]["gate_mean"] = {split: float(np.nanmean(means))
                                            for split, means in self.gate_means.items()}
        if self.k_curve_result is not None:
            extras["k_curve"] = self.k_curve_result
        return extras
