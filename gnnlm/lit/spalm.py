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

Predict gives, per scored token, the gate averaged over its d dimensions (SPALM Fig. 4-5 count
tokens; ``gnnlm.lit.gates``), and on the valid split (each batch of ``SpalmDataModule`` names
its split) records the perplexity of the trained model when it reads each k of ``k_curve``
neighbours (SPALM Table 5); ``gnnlm.pipeline.scoring`` stores both with the scores.
Transformer-XL memory (Dai et al. 2019) is carried from one segment of a stream to the next as
in the base LM (``gnnlm.lit.memory``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.gates import PerTokenGate
from gnnlm.lit.memory import SegmentMemory
from gnnlm.lit.settings import OptimConfig
from gnnlm.models import is_hf, load_gpt_checkpoint
from gnnlm.models.gpt import GPT
from gnnlm.spalm.model import Spalm, SpalmOutput
from gnnlm.utils.metrics import target_nll

INITS = ("warm", "scratch")


def batch_split(batch: dict) -> Optional[str]:
    """The split a batch was read from: its items' ``split`` (collated into one name per
    item), or None where the batch does not say."""
    split = batch.get("split")
    return split[0] if isinstance(split, (list, tuple)) else split


def check_k_curve(ks: list[int], stored: int) -> None:
    """Refuse a k the stored neighbours cannot serve (k > K, or k < 1)."""
    bad = [k for k in ks if not 1 <= int(k) <= stored]
    if bad:
        raise ValueError(f"k = {bad} neighbours asked for, but {stored} are stored per token: "
                         f"the k curve can only read 1 <= k <= K.")


class SpalmXL(SegmentMemory, PerTokenGate, TokenLevelModule):
    def __init__(self, base_lm: str = "", base_lm_fingerprint: Optional[str] = None,
                 vocab_size: int = 0, k: int = 4, memory_length: int = 128,
                 init: str = "warm", dropout: Optional[float] = None,
                 gate_bias: Optional[float] = None, memory_scale: str = "none",
                 k_curve: Optional[list[int]] = None, k_curve_tokens: Optional[int] = None,
                 optim: OptimConfig = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=50),
                 gate_lr: Optional[float] = None, retrieved: Optional[int] = None,
                 stored_k: Optional[int] = None):
        """SPALM trained end to end on the built-in LM, or its Transformer-XL / transformer
        baselines.

        ``gate_bias`` and ``memory_scale``: None and ``"none"`` are the paper's equations; a
        number starts a learned gate bias, ``"learned"`` scales m_t by a learned s started at
        ‖h‖/‖y‖ (``gnnlm.spalm.model`` says what each changes; the report names those on).

        Args:
            base_lm: the built-in LM (a ``gnnlm fit`` checkpoint) that the datastore's keys
                come from (linked from ``SpalmDataModule``, which reads it from the features);
                its architecture is the model's.
            base_lm_fingerprint: the weights the datastore was built with (linked), checked.
            vocab_size: the data's vocabulary size (linked), checked against the LM's.
            k: retrieved next tokens each position reads (0: no long-term memory, no gate).
            memory_length: Transformer-XL memory M, cached states per layer (0: none).
            init: start from the base LM's weights (``warm``) or at random (``scratch``).
            dropout: the LM's dropout probability (None: the base LM's).
            gate_bias: None is the paper's gate; a number starts a learned bias there.
            memory_scale: ``none`` (the paper's m_t) or ``learned`` (s·m_t).
            k_curve: the k's at which predict on valid also scores the model (Table 5; at
                most the values the data carries, and those at most the stored K).
            k_curve_tokens: score the k curve on only the first that many valid positions.
            optim: AdamW and its warmup + cosine schedule.
            gate_lr: the learning rate of what SPALM adds (w_g and log s; None: ``optim.lr``);
                a warm-started LM wants a small step, while w_g starts from zero.
            retrieved: retrieved values per position the data carries (linked from the data
                module; None: unchecked): the model refuses a k or k curve beyond it.
            stored_k: neighbours stored per token, K (linked from the data module; None:
                unchecked): the k curve must stay within it.
        """
        super().__init__()
        self.save_hyperparameters()
        self.k, self.k_curve, self.k_curve_tokens = k, k_curve, k_curve_tokens
        self.init, self.gate_bias, self.memory_scale = init, gate_bias, memory_scale
        self.optim, self.gate_lr = OptimConfig.of(optim), gate_lr
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS} (got {init!r}).")
        if k < 0 or memory_length < 0:
            raise ValueError(f"k and memory_length must be >= 0 (got {k}, "
                             f"{memory_length}).")
        if k_curve and (not k or min(k_curve) < 1):
            raise ValueError(f"k_curve {k_curve} needs a model with long-term memory "
                             f"(k > 0) and values k >= 1.")
        if k and k_curve and stored_k is not None:
            check_k_curve(k_curve, stored_k)
        needed = max([k, *(k_curve or [])])
        if k and retrieved is not None and retrieved < needed:
            raise ValueError(f"The model reads up to k = {needed} retrieved values per position "
                             f"(k {k}, k_curve {k_curve}) but the data "
                             f"carries data.retrieved = {retrieved}: raise it.")
        if not base_lm or is_hf(base_lm):
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
        self.k_curve_result: Optional[dict] = None
        self._curve: dict[int, list[float]] = {}
        self._predicting_valid = False  # the split of the predict pass: valid

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
        memory = self.memory_for(stage, batch["input"].shape[0])
        out = self.model(batch["input"], self._values(batch, self.k), memory,
                         force_gate)
        self.keep_memory(stage, out.memory)
        return out

    def gated_nll(self, batch: dict, stage: str):
        out = self(batch, stage)
        nll = target_nll(out.logits.flatten(0, 1), batch["target"].flatten())
        mask = batch["mask"].flatten().float()
        positions = batch["positions"].flatten()
        gate = None if out.gate is None else out.gate.flatten(0, 1)
        if stage == "predict":
            self._predicting_valid = batch_split(batch) == "valid"
            self._record_k_curve(batch, out, nll, mask, positions)
        elif gate is not None:
            mean = (gate.mean(-1) * mask).sum() / mask.sum().clamp(min=1)
            # token-weighted over an evaluation epoch; a train step's value is its own (and
            # reading the count back there would wait for the GPU every step)
            self.log(f"{stage}/gate", mean.float(),
                     batch_size=None if stage == "train" else int(mask.sum()))
            if self.model.memory_scale is not None and stage == "train":
                self.log("train/memory_scale", self.model.memory_scale.detach().float().mean())
        return nll, mask, positions, gate

    def lr_groups(self) -> list[tuple[list[torch.nn.Parameter], float]]:
        """The gate and memory scale at ``gate_lr``."""
        return [(self.model.memory_parameters(), self.gate_lr or self.optim.lr)]

    # -- predict: the k curve on valid ----------------------------------------------------------
    def on_predict_epoch_start(self) -> None:
        super().on_predict_epoch_start()
        self._curve = {k: [0.0, 0] for k in (self.k_curve or [])}
        self._predicting_valid = False

    @torch.no_grad()
    def _record_k_curve(self, batch: dict, out: SpalmOutput, nll, mask, positions) -> None:
        if out.gate is None or not self._curve or not self._predicting_valid:
            return
        keep = mask.bool()
        limit = self.k_curve_tokens
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
            if k == self.k:
                nll_k = nll[keep]
            else:
                nll_k = target_nll(self.model.head(h, values[:, :k])[0], target)
            acc[0] += float(nll_k.double().sum())
            acc[1] += int(keep.sum())

    def on_predict_epoch_end(self) -> None:
        if self._curve and self._predicting_valid:
            ks = sorted(self._curve)
            self.k_curve_result = {
                "split": "valid", "trained_k": self.k, "k": ks,
                "tokens": self._curve[ks[0]][1],
                "ppl": [float(np.exp(s / max(c, 1))) for s, c in (self._curve[k] for k in ks)]}

    def deviations(self) -> list[str]:
        """The options on that the paper's SPALM does not have (none for the baselines, which
        have no gate); the report names them in the row's label."""
        if self.model.gate is None:
            return []
        return ([] if self.gate_bias is None else ["gate bias"]) + (
            ["memory scale"] if self.memory_scale != "none" else [])

    def report_extras(self) -> dict:
        """What the report reads besides the scores (JSON)."""
        extras: dict = {"spalm": {"k": self.k, "memory_length": self.memory_length,
                                  "init": self.init, "gate_bias": self.gate_bias,
                                  "memory_scale": self.memory_scale}}
        if self.k_curve_result is not None:
            extras["k_curve"] = self.k_curve_result
        return extras
