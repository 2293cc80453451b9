"""LightningModules for heads trained on frozen features (batches from ``FeatureDataModule``).

- ``SpalmLM``: SPALM's gated long-term memory over the top-k retrieved next tokens;
- ``LearnedDatastoreLM``: a learned W_ds (V×d, or n·V×d summed per word) on ``att`` features,
  interpolated with the base LM at evaluation time (Xu et al. §4.1–4.2).
"""
from __future__ import annotations

import torch

from gnnlm.heads import MultiEmbeddingSoftmax, SpalmGate
from gnnlm.metrics import target_nll
from gnnlm.training import TokenLevelModule


class SpalmLM(TokenLevelModule):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, gate_bias: float = 2.0,
                 lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1):
        """Only the gate w_g is trained; W is the base LM's frozen output embedding, so with
        g = 1 the head is exactly the base LM. ``vocab_size``/``feature_dim`` come from the data."""
        super().__init__()
        self.save_hyperparameters()
        self.head = SpalmGate(feature_dim, gate_bias)
        self.gate_histogram = torch.zeros(20, dtype=torch.long)  # of the last predict run

    def forward(self, batch: dict, force_gate: float | None = None):
        weight, bias = self.output_embedding()
        return self.head(batch["h"], batch["nbr_values"], weight, bias, force_gate)

    def token_nll(self, batch: dict, stage: str):
        logits, gate = self(batch)
        if stage == "predict":  # SPALM Figure 5: the distribution of gate values
            self.gate_histogram += torch.histc(gate.detach().float().cpu(), bins=20, min=0,
                                               max=1).long()
        nll = target_nll(logits, batch["target"])
        return nll, torch.ones_like(nll), batch["positions"]

    def on_predict_epoch_start(self) -> None:
        self.gate_histogram.zero_()


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
