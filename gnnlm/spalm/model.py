r"""SPALM as trained end to end (Yogatama et al. 2021, §2): a Transformer-XL language model whose
last-layer output is gated with a long-term memory of retrieved next tokens.

Per position t, with h_t the last layer's output after the final norm (the short-term memory of
the previous segment is already in it, through attention) and y_1 … y_k the word embeddings of
the k retrieved next tokens:

.. math::
    m_t = \sum_{i=1}^k \mathrm{softmax}_i(y_i^\top h_t)\, y_i, \quad
    g_t = \sigma(w_g^\top h_t), \quad
    z_t = (1 - g_t) \odot m_t + g_t \odot h_t, \quad
    p(x_{t+1} \mid x_{\le t}) = \mathrm{softmax}(W z_t)

W is the word embedding shared by input and output, so it is trained through three paths: the
input tokens, the retrieved values y_i (the "value encoder" is the embedding), and the output
softmax. The keys are not part of the model: each token's neighbours were retrieved once with
the frozen pretrained LM, and arrive as an int tensor of values (-1 = none).

Defaults are the paper's equations: no bias in the gate and m_t as it is. Two deviations are
options, named in the report's row label when they are on:

- ``gate_bias`` (a number): σ(w_g^T h_t + b) with a learned bias started at b
  (``gnnlm.spalm.gate.SpalmGate``), so a warm-started model starts near its LM (g ≈ σ(b)).
- ``memory_scale="learned"``: m_t enters as s·m_t, with one learned scalar s > 0 (trained as
  log s),

  .. math::
      z_t = (1 - g_t) \odot s\, m_t + g_t \odot h_t,

  initialised to E‖h_t‖ / E‖y‖ (``initial_memory_scale``). Why one might want it: the paper
  trains from scratch, so W and h_t co-adapt and m_t (a convex combination of rows of W) lives
  at the scale of h_t. A warm-started LM does not have that: h_t leaves the final LayerNorm with
  its learned gain (‖h_t‖ ≈ 9 on the WikiText-2 CPU LM) while its tied embeddings have
  ‖y‖ ≈ 1, so W m_t moves the logits by about one tenth of what W h_t does, and any g_t < 1
  mostly shrinks h_t (a flatter softmax) instead of adding the retrieved tokens: the paper's
  gate then closes (mean 0.914 in the README's warm CPU comparison). The scale puts m_t at
  h_t's norm from the first step. It changes neither the attention over the values
  (softmax_i(y_i^T h_t) are still the LM's own logits of the retrieved tokens; scaling them too,
  y → s·y, sharpens that softmax to nearly an argmax and was worse) nor the gate.

Without long-term memory (``long_term=False``) the model is exactly the GPT: no gate, no
parameter that would go unused. The maths is ``gnnlm.spalm.gate.SpalmGate``; this module adds the
Transformer-XL body and how the two are combined.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from gnnlm.models.base import float32
from gnnlm.models.gpt import GPT
from gnnlm.spalm.gate import SpalmGate

MEMORY_SCALES = ("none", "learned")


@torch.no_grad()
def initial_memory_scale(lm: GPT) -> float:
    """The memory scale's start, E‖h_t‖ / E‖y‖, read from the weights (no data): the final
    LayerNorm's output has norm about sqrt(Σγ² + Σβ²) (unit-variance coordinates times its gain,
    plus its bias); the word embeddings, the root mean square of W's rows."""
    ln = lm.ln_f
    h_norm = (ln.weight.float().pow(2).sum() + ln.bias.float().pow(2).sum()).sqrt()
    y_norm = lm.wte.weight.float().pow(2).sum(-1).mean().sqrt()
    return float(h_norm / y_norm)


class SpalmOutput(NamedTuple):
    logits: Tensor                       # [B, T, V]
    gate: Optional[Tensor]               # [B, T, d] g_t; None without long-term memory
    final: Tensor                        # [B, T, d] h_t
    memory: Optional[list[Tensor]]       # Transformer-XL memory for the next segment


class Spalm(nn.Module):
    """A ``GPT`` (with ``memory_length`` > 0: Transformer-XL) plus SPALM's gated long-term memory.

    ``lm`` must tie its input and output embeddings (SPALM's W is one matrix).
    ``long_term``: build the gate (False: the plain GPT / Transformer-XL). ``gate_bias``: None
    (the paper) or the start of a learned gate bias (``SpalmGate``). ``memory_scale``:
    ``"none"`` (the paper's m_t) or ``"learned"`` (s·m_t, see the module's docstring).
    """

    def __init__(self, lm: GPT, long_term: bool = True, gate_bias: Optional[float] = None,
                 memory_scale: str = "none"):
        super().__init__()
        if lm.lm_head.weight is not lm.wte.weight:
            raise ValueError("SPALM shares one word embedding W between input and output: the "
                             "GPT must be built with tie_embeddings=True.")
        self.lm = lm
        self.gate = SpalmGate(lm.hidden_size, gate_bias) if long_term else None
        if memory_scale not in MEMORY_SCALES:
            raise ValueError(f"memory_scale must be one of {MEMORY_SCALES} (got {memory_scale!r}).")
        self.log_memory_scale = (
            nn.Parameter(torch.tensor(math.log(initial_memory_scale(lm))))
            if long_term and memory_scale == "learned" else None)

    def memory_parameters(self) -> list[nn.Parameter]:
        """The parameters SPALM adds to the LM (the gate's, log s), for their own learning rate;
        none without long-term memory."""
        if self.gate is None:
            return []
        scale = [] if self.log_memory_scale is None else [self.log_memory_scale]
        return [*self.gate.parameters(), *scale]

    @property
    def memory_scale(self) -> Optional[Tensor]:
        """The memory scale s (a scalar tensor); None: the paper's m_t."""
        return None if self.log_memory_scale is None else self.log_memory_scale.exp()

    @property
    def memory_length(self) -> int:
        return self.lm.memory_length

    @property
    def word_embedding(self) -> Tensor:
        """W [V, d]: input embedding, retrieved-value embedding and output softmax at once."""
        return self.lm.wte.weight

    def head(self, h: Tensor, nbr_values: Optional[Tensor] = None,
             force_gate: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
        """``h [..., d]`` and ``nbr_values [..., k]`` (-1 = none) → ``(logits [..., V],
        g [..., d] or None)``. Every value column given is used (k is the caller's choice)."""
        weight = self.word_embedding
        if self.gate is None:
            with float32(h):  # the softmax over the vocabulary stays in float32
                return h.float() @ weight.float().T, None
        if nbr_values is None:
            raise ValueError("This SPALM model has long-term memory: pass nbr_values [..., k] "
                             "(the values of each position's retrieved neighbours, -1 = none).")
        if nbr_values.shape[:-1] != h.shape[:-1]:
            raise ValueError(f"nbr_values {tuple(nbr_values.shape)} must match the positions of "
                             f"h {tuple(h.shape)} (one row of k values per position).")
        lead = h.shape[:-1]
        logits, gate = self.gate(h.reshape(-1, h.shape[-1]),
                                 nbr_values.reshape(-1, nbr_values.shape[-1]), weight, None,
                                 force_gate, memory_scale=self.memory_scale)
        return logits.view(*lead, -1), gate.view(*lead, -1)

    def forward(self, input_ids: Tensor, nbr_values: Optional[Tensor] = None,
                memory: Optional[list[Tensor]] = None, force_gate: Optional[float] = None
                ) -> SpalmOutput:
        """``input_ids [B, T]``, ``nbr_values [B, T, k]``, ``memory`` from the previous segment
        of the same streams (None: none, or the model has no memory)."""
        feats = self.lm(input_ids, memory=memory if self.memory_length else None)
        logits, gate = self.head(feats.final, nbr_values, force_gate)
        return SpalmOutput(logits, gate, feats.final, feats.memory)
