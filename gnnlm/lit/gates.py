"""SPALM's gate in predict outputs (Yogatama et al. 2021): for every scored token, the gate g_t
averaged over its d dimensions, which ``gnnlm.pipeline.scoring`` stores beside the scores as
``<split>_gate`` and ``gnnlm.spalm.analysis`` counts per token (Fig. 4-5). The same for the
three SPALM modules: on frozen features (``heads.SpalmLM``), with the last block fine-tuned
(``heads.SpalmFinetuneLM``), and end to end (``spalm.SpalmXL``).
"""
from __future__ import annotations

from typing import Optional

import torch

from gnnlm.lit.base import predicted_tokens


class PerTokenGate:
    """Mix in before ``TokenLevelModule``; the module implements ``gated_nll``."""

    def gated_nll(self, batch, stage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                    Optional[torch.Tensor]]:
        """``token_nll``'s ``(nll [n], mask [n], positions [n])`` and the gate ``[n, d]``
        (None: a model without long-term memory)."""
        raise NotImplementedError

    def token_nll(self, batch, stage: str):
        nll, mask, positions, _ = self.gated_nll(batch, stage)
        return nll, mask, positions

    def predict_step(self, batch, batch_idx: int) -> dict:
        """Per-token log p(target) with split positions and, with a gate, ``gate``: its mean over
        the d dimensions (float32)."""
        nll, mask, positions, gate = self.gated_nll(batch, "predict")
        out = predicted_tokens(nll, mask, positions)
        if gate is not None:
            out["gate"] = gate[mask.bool()].float().mean(-1).cpu()
        return out
