"""LightningModules for heads trained on frozen features (batches from ``FeatureDataModule``).

- ``SpalmLM``: SPALM's gated long-term memory over the top-k retrieved next tokens;
- ``SpalmFinetuneLM``: the same gate with the base LM's last block and final norm trained too
  (token windows from ``RetrievalWindowsDataModule``);
- ``LearnedDatastoreLM``: a learned W_ds (V×d, or n·V×d summed per word) on ``att`` features,
  interpolated with the base LM at evaluation time (Xu et al. §4.1–4.2).
"""
from __future__ import annotations

from typing import Optional

import torch

from gnnlm.lit.base import TokenLevelModule
from gnnlm.models import load_base_lm
from gnnlm.models.multi_embedding import MultiEmbeddingSoftmax
from gnnlm.spalm.gate import SpalmGate
from gnnlm.utils.metrics import target_nll


class GateHistogram:
    """SPALM Figure 5: the distribution of gate values over the scored tokens of a predict run."""

    def record_gate(self, gate: torch.Tensor, mask: torch.Tensor, stage: str) -> None:
        if stage == "predict":
            scored = gate[mask.bool()].detach().float().cpu()
            self.gate_histogram += torch.histc(scored, bins=20, min=0, max=1).long()

    def on_predict_epoch_start(self) -> None:
        self.gate_histogram = torch.zeros(20, dtype=torch.long)  # of the last predict run

    def deviations(self) -> list[str]:
        """A learned gate bias is not in the paper's gate (the report names it in the label)."""
        return [] if self.hparams.gate_bias is None else ["gate bias"]


class SpalmLM(GateHistogram, TokenLevelModule):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0,
                 gate_bias: Optional[float] = None,
                 lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1):
        """Only the gate w_g is trained; W is the base LM's frozen output embedding, so with
        g = 1 the head is exactly the base LM. ``vocab_size``/``feature_dim`` come from the data.
        ``gate_bias``: None is the paper's gate; a number starts a learned bias there
        (``SpalmGate``)."""
        super().__init__()
        self.save_hyperparameters()
        self.head = SpalmGate(feature_dim, gate_bias)

    def forward(self, batch: dict, force_gate: float | None = None):
        weight, bias = self.output_embedding()
        return self.head(batch["h"], batch["nbr_values"], weight, bias, force_gate,
                         logit_softcap=self.logit_softcap)

    def token_nll(self, batch: dict, stage: str):
        logits, gate = self(batch)
        nll = target_nll(logits, batch["target"])
        mask = torch.ones_like(nll)
        self.record_gate(gate, mask, stage)
        return nll, mask, batch["positions"]


class SpalmFinetuneLM(GateHistogram, TokenLevelModule):
    def __init__(self, base_lm: str = "", vocab_size: int = 0, feature_dim: int = 0,
                 base_lm_fingerprint: Optional[str] = None,
                 base_lm_options: Optional[dict] = None,
                 gate_bias: Optional[float] = None,
                 lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1):
        """SPALM (``SpalmGate``) on the base LM ``base_lm`` (a ``gnnlm fit`` checkpoint or
        ``hf:<name>``; linked from ``RetrievalWindowsDataModule``, which reads it from the
        datastore), training the gate w_g together with the LM's last block and final norm.
        ``base_lm_options``: how a Hugging Face base LM was loaded for the datastore (its
        feature paths and dtype; linked from the data module too).

        Everything below the last block, and the word embedding W shared by input and output,
        stay frozen; so do the keys: the neighbours were retrieved with the frozen LM (SPALM
        §3: keys are not updated, which fixes each token's neighbours). With g = 1 and the
        block untrained the model is exactly the base LM.
        """
        super().__init__()
        self.save_hyperparameters()
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
                         logit_softcap=self.lm.logit_softcap)

    def token_nll(self, batch: dict, stage: str):
        logits, gate = self(batch)
        nll = target_nll(logits, batch["target"].flatten())
        mask = batch.get("mask", torch.ones_like(batch["target"], dtype=torch.float)).flatten()
        self.record_gate(gate, mask, stage)
        return nll, mask.float(), batch["positions"].flatten()


class LearnedDatastoreLM(TokenLevelModule):
    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, embeddings_per_word: int = 1,
                 lr: float = 3e-3, weight_decay: float = 0.0, warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1):
        """Train with ``FeatureDataModule(key="att")`` (Xu et al.: h_ds = att)."""
        super().__init__()
        self.save_hyperparameters()
        self.head = MultiEmbeddingSoftmax(vocab_size, feature_dim, embeddings_per_word)

    def token_nll(self, batch: dict, stage: str):
        logp = self.head(batch["h"])                                      # [B, V]
        nll = -logp.gather(1, batch["target"][:, None]).squeeze(1)
        return nll, torch.ones_like(nll), batch["positions"]
