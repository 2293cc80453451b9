"""LightningModules for heads trained on frozen features (batches from ``FeatureDataModule``).

- ``SpalmLM``: SPALM's gated long-term memory over the top-k retrieved next tokens
  (Yogatama et al. 2021);
- ``SpalmFinetuneLM``: the same gate with the base LM's last block and final norm trained too
  (token windows from ``RetrievalWindowsDataModule``);
- ``LearnedDatastoreLM``: a learned W_ds (V×d, or n·V×d summed per word) on ``att`` features,
  interpolated with the base LM at evaluation time (Xu et al. 2023, §4.1–4.2).

The two SPALM heads give, in predict, each token's gate averaged over its d dimensions
(``gnnlm.lit.gates``), as SPALM trained end to end does.
"""
from __future__ import annotations

from typing import Optional

import torch

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.gates import PerTokenGate
from gnnlm.lit.settings import OptimConfig
from gnnlm.models import load_base_lm
from gnnlm.models.multi_embedding import MultiEmbeddingSoftmax
from gnnlm.spalm.gate import SpalmGate
from gnnlm.utils.metrics import target_nll


class GatedHead(PerTokenGate, TokenLevelModule):
    """SPALM's gate on the base LM (Yogatama et al. 2021): predict gives each token's mean
    gate (``gnnlm.lit.gates``)."""

    gate_bias: Optional[float] = None  # None: the paper's gate

    def deviations(self) -> list[str]:
        """A learned gate bias is not in the paper's gate (the report names it in the label)."""
        return [] if self.gate_bias is None else ["gate bias"]


class SpalmLM(GatedHead):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0,
                 gate_bias: Optional[float] = None,
                 optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=50)):
        """SPALM's gate on frozen features: only the gate w_g is trained; W is the base LM's
        frozen output embedding, so with g = 1 the head is exactly the base LM.

        Args:
            vocab_size: the base LM's vocabulary size (linked from the data module).
            feature_dim: the base LM's hidden size d (linked from the data module).
            gate_bias: None is the paper's gate; a number starts a learned bias there
                (``SpalmGate``).
            optim: AdamW and its warmup + cosine schedule.
        """
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size, self.feature_dim, self.gate_bias = vocab_size, feature_dim, gate_bias
        self.optim = OptimConfig.of(optim)
        self.head = SpalmGate(feature_dim, gate_bias)

    def forward(self, batch: dict, force_gate: float | None = None):
        weight, bias = self.output_embedding()
        return self.head(batch["h"], batch["nbr_values"], weight, bias, force_gate,
                         logit_transform=self.logit_transform)

    def gated_nll(self, batch: dict, stage: str):
        logits, gate = self(batch)
        nll = target_nll(logits, batch["target"])
        return nll, torch.ones_like(nll), batch["positions"], gate


class SpalmFinetuneLM(GatedHead):
    def __init__(self, base_lm: str = "", vocab_size: int = 0, feature_dim: int = 0,
                 base_lm_fingerprint: Optional[str] = None,
                 base_lm_options: Optional[dict] = None,
                 gate_bias: Optional[float] = None,
                 optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=50)):
        """SPALM (``SpalmGate``) on the base LM, training the gate w_g together with the LM's
        last block and final norm.

        Everything below the last block, and the word embedding W shared by input and output,
        stay frozen; so do the keys: the neighbours were retrieved with the frozen LM (SPALM
        §3: keys are not updated, which fixes each token's neighbours). With g = 1 and the
        block untrained the model is exactly the base LM.

        Args:
            base_lm: a ``gnnlm fit`` checkpoint or ``hf:<name>`` (linked from
                ``RetrievalWindowsDataModule``, which reads it from the datastore).
            vocab_size: the data's vocabulary size (linked), checked against the LM's.
            feature_dim: the data's hidden size (linked), checked against the LM's.
            base_lm_fingerprint: the weights the datastore was built with (linked), checked.
            base_lm_options: how a Hugging Face base LM was loaded for the datastore (its
                feature paths and dtype; linked).
            gate_bias: None is the paper's gate; a number starts a learned bias there.
            optim: AdamW and its warmup + cosine schedule.
        """
        super().__init__()
        self.save_hyperparameters()
        self.gate_bias, self.optim = gate_bias, OptimConfig.of(optim)
        if not base_lm:
            raise ValueError("SpalmFinetuneLM needs base_lm: a `gnnlm fit` checkpoint or "
                             "hf:<name> (RetrievalWindowsDataModule supplies the datastore's).")
        self.lm = load_base_lm(base_lm, base_lm_options)
        if base_lm_fingerprint and self.lm.fingerprint() != base_lm_fingerprint:
            raise ValueError(f"The base LM at {base_lm} (weights {self.lm.fingerprint()}) is not "
                             f"the one the datastore was built with ({base_lm_fingerprint}): "
                             f"its neighbours and features belong to another model.")
        for name, size, expected in (("vocab_size", vocab_size, self.lm.vocab_size),
                                     ("feature_dim", feature_dim, self.lm.hidden_size)):
            if size and size != expected:
                raise ValueError(f"The data has {name}={size} but the base LM {base_lm} has "
                                 f"{expected}.")
        for module in self.lm.last_block():
            module.requires_grad_(True)
        self.head = SpalmGate(self.lm.hidden_size, gate_bias)

    def train(self, mode: bool = True):
        """The frozen layers stay in eval mode (no dropout): the last block reads the same
        inputs as when the datastore was built."""
        super().train(mode)
        self.lm.eval()
        for module in self.lm.last_block():
            module.train(mode)
        return self

    def forward(self, batch: dict, force_gate: float | None = None):
        # frozen parameters record no graph: backward runs through the last block only
        final = self.lm(batch["input"]).final.float()                    # [B, T, d]
        weight, bias = self.lm.output_embedding()
        return self.head(final.flatten(0, 1), batch["nbr_values"].flatten(0, 1), weight.float(),
                         None if bias is None else bias.float(), force_gate,
                         logit_transform=self.lm.logit_transform)

    def gated_nll(self, batch: dict, stage: str):
        logits, gate = self(batch)
        nll = target_nll(logits, batch["target"].flatten())
        mask = batch.get("mask", torch.ones_like(batch["target"], dtype=torch.float)).flatten()
        return nll, mask.float(), batch["positions"].flatten(), gate


class LearnedDatastoreLM(TokenLevelModule):
    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, embeddings_per_word: int = 1,
                 optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=50)):
        """A learned W_ds; train with ``FeatureDataModule(key="att")`` (Xu et al. 2023:
        h_ds = att).

        Args:
            vocab_size: the base LM's vocabulary size (linked from the data module).
            feature_dim: the ``att`` features' size (linked from the data module).
            embeddings_per_word: n, embeddings per word whose probabilities are summed
                (Xu et al. §4.2; 1: one V×d matrix).
            optim: AdamW and its warmup + cosine schedule.
        """
        super().__init__()
        self.save_hyperparameters()
        self.optim = OptimConfig.of(optim)
        self.head = MultiEmbeddingSoftmax(vocab_size, feature_dim, embeddings_per_word)

    def token_nll(self, batch: dict, stage: str):
        logp = self.head(batch["h"])                                      # [B, V]
        nll = -logp.gather(1, batch["target"][:, None]).squeeze(1)
        return nll, torch.ones_like(nll), batch["positions"]
