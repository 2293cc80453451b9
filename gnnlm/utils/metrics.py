"""Perplexity and bits per character, always token-weighted over all scored tokens."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn import functional as F
from torchmetrics import Metric


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(Σ NLL / Σ tokens): never a mean of per-batch perplexities (inf when a token had
    probability 0, or the model is astronomically bad)."""
    if n_tokens <= 0:
        raise ValueError(f"perplexity needs at least one scored token (got {n_tokens}).")
    try:
        return math.exp(nll_sum / n_tokens)
    except OverflowError:
        return math.inf


def check_finite(values, what: str, fix: str, start: int = 0, block: int = 1 << 22) -> None:
    """Stop at the first value of ``values`` that is inf or NaN: a perplexity over it would be
    reported as inf or nan, a number that looks like a result. ``what`` names the file or the
    scores, ``fix`` says what to do; ``start`` is the position of ``values[0]`` in the split.
    A memmap is read in blocks (no copy of a large array)."""
    flat = np.asarray(values).reshape(-1)
    for lo in range(0, len(flat), block):
        part = np.asarray(flat[lo:lo + block])
        bad = np.flatnonzero(~np.isfinite(part))
        if len(bad):
            i = lo + int(bad[0])
            raise ValueError(f"{what} is not finite at position {start + i} ({flat[i]}): {fix}")


def bits_per_token(nll_sum: float, n_tokens: int) -> float:
    return nll_sum / n_tokens / math.log(2)


def ppl_from_logprobs(logprobs) -> float:
    """Perplexity of per-token natural-log probabilities of the targets (array or tensor)."""
    values = np.asarray(logprobs)
    return perplexity(-float(np.sum(values, dtype=np.float64)), len(values))


# The most logits per cross-entropy call. A larger [N, V] batch is scored in chunks of rows,
# each row as alone (the same bits), so that its float32 copy and log-softmax are never held
# whole and no call passes 2^31 elements: the GPU base LM's validation batch (128 × 512 tokens
# × 33k words: 2.2e9 logits, 8.7 GB in float32, twice over) is three calls. Training batches
# (32 × 512 tokens) stay one call.
NLL_CHUNK_LOGITS = 1 << 30


def target_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """−log softmax(logits)[target] per row of ``logits`` [N, V], in float32 (every model's
    token NLL goes through here, so that all rows of a report are scored the same way)."""
    rows = max(1, NLL_CHUNK_LOGITS // max(1, logits.shape[-1]))
    if len(logits) <= rows:
        return F.cross_entropy(logits.float(), target, reduction="none")
    return torch.cat([F.cross_entropy(part.float(), part_target, reduction="none")
                      for part, part_target in zip(logits.split(rows), target.split(rows))])


def unigram_logprobs(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-one smoothed unigram log-probabilities of ``targets`` (a floor every LM must beat)."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size) + 1.0
    return np.log(counts / counts.sum())[np.asarray(targets, dtype=np.int64)]


class TokenNLL(Metric):
    """Summed NLL and token count, reduced across DDP ranks; ``compute`` gives the mean NLL."""
    full_state_update = False
    nll: torch.Tensor
    count: torch.Tensor

    def __init__(self):
        super().__init__()
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, nll: torch.Tensor, mask: torch.Tensor) -> None:
        self.nll += (nll.double() * mask).sum()
        self.count += mask.sum().long()

    def compute(self) -> torch.Tensor:
        return self.nll / self.count.clamp(min=1)
