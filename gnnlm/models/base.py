"""The one interface every base LM offers to the rest of the pipeline.

Per position a base LM yields two feature vectors:

- ``final``: the last layer's output after the final norm, what the softmax sees
  (GNN-LM's key and node feature; ``logits = final @ W.T + b``);
- ``att``: the last block's attention-side vector fed to its FFN
  (kNN-LM's key; Xu et al. §3 show it retrieves better).

and the output embedding ``(W, b)`` that turns ``final`` into logits.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.models.settings import FEATURE_KEYS  # noqa: F401  (importable from here too)


def float32(h: Tensor) -> torch.autocast:
    """A region where mixed-precision autocast is off: softmaxes over the vocabulary are
    computed in float32 (as the base LM's log-probabilities are) even when a bf16 trainer preset
    runs the rest of the model under autocast."""
    return torch.autocast(h.device.type, enabled=False)


def softcap(logits: Tensor, cap: Optional[float]) -> Tensor:
    """``cap · tanh(logits / cap)``: the final-logit soft-capping of Gemma 2/3 (None: as is)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


@dataclass(frozen=True)
class LogitTransform:
    """What a base LM does to ``final @ W.T + b`` before its softmax, in the order its own
    forward does it: a scale (Cohere's ``logit_scale`` multiplies, Granite's ``logits_scaling``
    divides: ``scale`` is then its inverse), then soft-capping (Gemma 2/3). Every place that
    turns features into logits through the base LM's output embedding applies it (the base LM's
    log-probabilities, GNN-LM's readout, SPALM's gate), so a head with nothing to add is
    exactly the base LM. The identity by default."""
    scale: float = 1.0
    softcap: Optional[float] = None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        return softcap(logits, self.softcap)

    def identity(self) -> dict:
        """As a features manifest records it (``logit_scale`` only where the model scales)."""
        scaled = {"logit_scale": self.scale} if self.scale != 1.0 else {}
        return {"logit_softcap": self.softcap, **scaled}

    @classmethod
    def of(cls, identity: dict) -> LogitTransform:
        """The transform a base LM's recorded ``identity()`` names."""
        return cls(float(identity.get("logit_scale") or 1.0), identity.get("logit_softcap"))


class Features(NamedTuple):
    final: Tensor                       # [B, T, d]
    att: Tensor                         # [B, T, d]
    memory: Optional[list[Tensor]] = None  # Transformer-XL memory for the next segment


class BaseLM(nn.Module):
    """A causal LM that exposes ``final``/``att`` features and its output embedding."""
    vocab_size: int
    hidden_size: int
    context_length: Optional[int]      # None: positions without a limit (Bloom's ALiBi)
    memory_length: int = 0
    name: str = "base-lm"
    logit_transform: LogitTransform = LogitTransform()

    def forward(self, input_ids: Tensor, memory: Optional[list[Tensor]] = None) -> Features:
        raise NotImplementedError

    def step(self, input_ids: Tensor, cache: Any = None) -> tuple[Features, Any]:
        """Incremental decoding with a key/value cache: the features of ``input_ids [B, T]``,
        read after the tokens ``cache`` holds (None: none), and the cache extended by them.
        Without a cache it computes what ``forward`` does."""
        raise NotImplementedError

    def output_embedding(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(W [V, d], b [V] or None)`` such that ``logits = final @ W.T + b``."""
        raise NotImplementedError

    def last_block(self) -> list[nn.Module]:
        """The modules after the last block's input: that block and the final norm (the part
        SPALM fine-tuning trains; everything before it stays frozen)."""
        raise NotImplementedError

    def logits(self, final: Tensor) -> Tensor:
        weight, bias = self.output_embedding()
        return self.logit_transform(F.linear(final, weight, bias))

    @torch.no_grad()
    def fingerprint(self) -> str:
        """A hash of the weights: datastores record it and refuse another model's queries."""
        if getattr(self, "_fingerprint", None) is None:
            digest = hashlib.sha256()
            for name, tensor in sorted(self.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def identity(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint(),
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size}
