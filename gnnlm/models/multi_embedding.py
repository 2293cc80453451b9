"""A learned output embedding with several rows per word (Xu et al., 2023): the alternative to
a datastore that asks whether kNN-LM's gain comes from a larger softmax. ``gnnlm.lit.heads``
trains it on frozen base-LM features.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gnnlm.models.base import float32


class MultiEmbeddingSoftmax(nn.Module):
    r"""A learned W_ds (Xu et al. 2023, §4.1–4.2): ``n`` embeddings per word, [n·V, d].

    p_ds(w | h) = Σ_{i<n} softmax(W_ds h)[i·V + w]: a softmax over all n·V rows whose
    probabilities are summed per word (n = 1 is a plain softmax). Rows are initialised at random,
    as in the paper, and trained with the base LM frozen.
    """

    def __init__(self, vocab_size: int, dim: int, n: int = 1):
        super().__init__()
        if n < 1:
            raise ValueError(f"n (embeddings per word) must be at least 1 (got {n}).")
        self.vocab_size, self.n = vocab_size, n
        self.weight = nn.Parameter(torch.randn(n * vocab_size, dim) * 0.02)

    def forward(self, h: Tensor) -> Tensor:
        """``h [B, d]`` → log p_ds ``[B, V]``, in float32 whatever the autocast around it."""
        with float32(h):
            logp = torch.log_softmax(h.float() @ self.weight.float().T, dim=-1)  # [B, n·V]
            return logp.view(-1, self.n, self.vocab_size).logsumexp(dim=1)     # [B, V]
