"""SPALM's gate over retrieved long-term memory (Yogatama et al., 2021), as a plain ``nn.Module``.

``gnnlm.lit.heads`` trains it on frozen base-LM features; ``gnnlm.spalm.model`` inside the
Transformer-XL trained end to end.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.models.base import LogitTransform, float32


class SpalmGate(nn.Module):
    r"""SPALM long-term memory (Yogatama et al. 2021, §2).

    .. math::
        m_t = \sum_{k=1}^K \frac{\exp y_k^\top h_t}{\sum_j \exp y_j^\top h_t}\, y_k, \quad
        g_t = \sigma(W_g h_t), \quad
        z_t = (1 - g_t) \odot m_t + g_t \odot h_t, \quad
        p(x_{t+1} \mid x_{\le t}) = \mathrm{softmax}(W z_t)

    where y_k are the word embeddings of the K retrieved next tokens and W is the word embedding
    shared by input and output (here: the frozen base LM's output embedding). The gate is a
    vector g_t ∈ (0, 1)^d, one value per dimension (SPALM §5.3: "the g vector has 512
    dimensions"), so some dimensions can carry memory while others keep the local context.
    W_g starts at zero, so g starts at 1/2.

    ``gate_bias``: None is the paper's gate, σ(W_g h_t) with no bias. A number adds a learned
    bias b started there, σ(W_g h_t + b) — a deviation from the paper that lets a model built
    on a trained LM start close to it (b = 2: g ≈ 0.88) rather than halfway to an untrained
    memory; the report names it in the row's label.
    """

    def __init__(self, dim: int, gate_bias: Optional[float] = None):
        super().__init__()
        self.gate = nn.Linear(dim, dim, bias=gate_bias is not None)
        nn.init.zeros_(self.gate.weight)
        if gate_bias is not None:
            nn.init.constant_(self.gate.bias, gate_bias)

    def forward(self, h: Tensor, nbr_values: Tensor, weight: Tensor, bias: Optional[Tensor],
                force_gate: Optional[float] = None, value_weight: Optional[Tensor] = None,
                memory_scale: Optional[Tensor] = None,
                logit_transform: Optional[LogitTransform] = None) -> tuple[Tensor, Tensor]:
        """``h [B, d]``, ``nbr_values [B, K]`` (-1 = none) → ``(logits [B, V], g [B, d])``.

        The y_k are rows of ``value_weight`` (default: ``weight``, SPALM's one W; a separate
        tensor lets a caller follow or cut the gradient of each path on its own).
        ``memory_scale`` (a scalar or [d]) multiplies m_t before the gate (None: the paper's
        m_t; ``gnnlm.spalm.model`` says why a warm-started model needs it). ``logit_transform``:
        the base LM's logit scale and soft-cap (Cohere, Granite, Gemma 2), so that g = 1 is the
        base LM.
        Computed in float32 whatever the autocast around it."""
        with float32(h):
            h, weight = h.float(), weight.float()
            valid = nbr_values >= 0                                       # [B, K]
            table = weight if value_weight is None else value_weight.float()
            ids = nbr_values.clamp(min=0)
            # on CPU an embedding, not table[ids]: there the backward of advanced indexing
            # (index_put_ with accumulate) adds into W's rows from several threads in a
            # varying order, while the embedding's adds each row's gradients in the order
            # its ids come, whatever the threads (the sums one thread gave, on every run).
            # CUDA's index_put_ already sums in that order; its embedding would group the
            # sums differently, so a GPU keeps the indexing.
            y = F.embedding(ids, table) if table.device.type == "cpu" else table[ids]
            scores = torch.einsum("bkd,bd->bk", y, h).masked_fill(~valid, float("-inf"))
            attn = torch.softmax(scores, dim=-1).nan_to_num(0.0)          # no neighbour → m = 0
            m = torch.einsum("bk,bkd->bd", attn, y)                       # [B, d]
            if memory_scale is not None:
                m = memory_scale * m
            g = torch.sigmoid(self.gate(h)) if force_gate is None \
                else torch.full_like(h, float(force_gate))                # [B, d]
            z = (1 - g) * m + g * h
            logits = F.linear(z, weight, None if bias is None else bias.float())
            return (logits if logit_transform is None else logit_transform(logits)), g
