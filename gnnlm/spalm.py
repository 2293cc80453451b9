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

Without long-term memory (``long_term=False``) the model is exactly the GPT: no gate, no
parameter that would go unused. The maths is ``gnnlm.heads.SpalmGate``; this module adds the
Transformer-XL body and how the two are combined.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor, nn

from gnnlm.heads import SpalmGate
from gnnlm.models.gpt import GPT


class SpalmOutput(NamedTuple):
    logits: Tensor                       # [B, T, V]
    gate: Optional[Tensor]               # [B, T, d] g_t; None without long-term memory
    final: Tensor                        # [B, T, d] h_t
    memory: Optional[list[Tensor]]       # Transformer-XL memory for the next segment


class Spalm(nn.Module):
    """A ``GPT`` (with ``memory_length`` > 0: Transformer-XL) plus SPALM's gated long-term memory.

    ``lm`` must tie its input and output embeddings (SPALM's W is one matrix).
    ``long_term``: build the gate (False: the plain GPT / Transformer-XL). ``gate_bias``: the
    gate's initial bias (``SpalmGate``), so a warm-started model starts close to its LM.
    """

    def __init__(self, lm: GPT, long_term: bool = True, gate_bias: float = 2.0):
        super().__init__()
        if lm.lm_head.weight is not lm.wte.weight:
            raise ValueError("SPALM shares one word embedding W between input and output: the "
                             "GPT must be built with tie_embeddings=True.")
        self.lm = lm
        self.gate = SpalmGate(lm.hidden_size, gate_bias) if long_term else None

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
            return h @ weight.T, None
        if nbr_values is None:
            raise ValueError("This SPALM model has long-term memory: pass nbr_values [..., k] "
                             "(the values of each position's retrieved neighbours, -1 = none).")
        if nbr_values.shape[:-1] != h.shape[:-1]:
            raise ValueError(f"nbr_values {tuple(nbr_values.shape)} must match the positions of "
                             f"h {tuple(h.shape)} (one row of k values per position).")
        lead = h.shape[:-1]
        logits, gate = self.gate(h.reshape(-1, h.shape[-1]),
                                 nbr_values.reshape(-1, nbr_values.shape[-1]), weight, None,
                                 force_gate)
        return logits.view(*lead, -1), gate.view(*lead, -1)

    def forward(self, input_ids: Tensor, nbr_values: Optional[Tensor] = None,
                memory: Optional[list[Tensor]] = None, force_gate: Optional[float] = None
                ) -> SpalmOutput:
        """``input_ids [B, T]``, ``nbr_values [B, T, k]``, ``memory`` from the previous segment
        of the same streams (None: none, or the model has no memory)."""
        feats = self.lm(input_ids, memory=memory if self.memory_length else None)
        logits, gate = self.head(feats.final, nbr_values, force_gate)
        return SpalmOutput(logits, gate, feats.final, feats.memory)
