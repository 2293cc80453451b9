"""The built-in GPT-style base LM: pre-LN Transformer blocks with rotary positions.

Rotary position embeddings make attention depend on relative offsets only, so the optional
Transformer-XL short-term memory (Dai et al. 2019; SPALM §2 "short-term memory") keeps correct
positions: the cached states of the previous segment sit at offsets -M … -1 of the current one.
Memory at layer l is that layer's *input* for the previous segment, detached (no gradient), as in
Transformer-XL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.models.base import BaseLM, Features


@dataclass
class GPTConfig:
    vocab_size: int
    context_length: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 1024
    dropout: float = 0.1
    tie_embeddings: bool = True
    memory_length: int = 0
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"d_model must split into n_head heads of even size "
                             f"(got d_model={self.d_model}, n_head={self.n_head}).")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive (got {self.vocab_size}).")


def rotate(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotary embedding of ``x [B, H, T, Dh]`` at integer ``positions [T]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]          # [T, Dh/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.rope_base = cfg.n_head, cfg.rope_base
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, h: Tensor, h_mem: Optional[Tensor]) -> Tensor:
        B, T, d = h.shape
        M = 0 if h_mem is None else h_mem.shape[1]
        full = h if h_mem is None else torch.cat([h_mem, h], dim=1)        # [B, M+T, d]
        q, k, v = self.qkv(full).split(d, dim=-1)
        q = q[:, M:]                                                        # queries: current only
        def heads(t: Tensor) -> Tensor:
            return t.view(B, t.shape[1], self.n_head, d // self.n_head).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)                             # [B, H, *, Dh]
        positions = torch.arange(M + T, device=h.device)
        q = rotate(q, positions[M:], self.rope_base)
        k = rotate(k, positions, self.rope_base)
        drop = self.dropout if self.training else 0.0
        if M == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:  # query i (absolute M+i) sees all memory and current keys up to itself
            mask = torch.ones(T, M + T, dtype=torch.bool, device=h.device).tril(diagonal=M)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def step(self, h: Tensor, past: Optional[tuple[Tensor, Tensor]]
             ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attention of ``h [B, T, d]``, the tokens after the P cached ones, over the cache and
        causally over themselves: ``(output [B, T, d], (keys, values) [B, H, P + T, Dh])``. With
        no cache this is ``forward`` without memory; with a cache made from memory
        (``GPT.memory_cache``), ``forward`` with that memory."""
        B, T, d = h.shape
        P = 0 if past is None else past[0].shape[2]
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2)
                   for t in self.qkv(h).split(d, dim=-1))                  # [B, H, T, Dh]
        positions = torch.arange(P, P + T, device=h.device)
        q, k = rotate(q, positions, self.rope_base), rotate(k, positions, self.rope_base)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if P == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:  # one new token sees every cached token and itself: no mask to apply
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # new token i (absolute P+i) sees every cached token and the new ones up to itself
            mask = torch.ones(T, P + T, dtype=torch.bool, device=h.device).tril(diagonal=P)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d)), (k, v)

    def cached(self, h_mem: Tensor) -> tuple[Tensor, Tensor]:
        """The rotated keys and values of Transformer-XL memory ``h_mem [B, M, d]`` (already
        normed), at positions 0 … M−1 as ``forward`` places them."""
        B, M, d = h_mem.shape
        _, k, v = (t.view(B, M, self.n_head, d // self.n_head).transpose(1, 2)
                   for t in self.qkv(h_mem).split(d, dim=-1))
        return rotate(k, torch.arange(M, device=h_mem.device), self.rope_base), v


@dataclass
class KVCache:
    """What incremental decoding keeps of the tokens read so far: every layer's rotated keys and
    values ``[B, H, P, Dh]`` and, for a model with Transformer-XL memory, every layer's inputs
    ``[B, P, d]`` (memory included), whose last M are the next segment's memory."""
    keys: list[Tensor]
    values: list[Tensor]
    inputs: Optional[list[Tensor]] = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class Block(nn.Module):
    """Pre-LN block; returns the new residual stream and the FFN's input (the ``att`` feature)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(),
                                 nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mem: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        x = x + self.drop(self.attn(self.ln1(x), None if mem is None else self.ln1(mem)))
        ffn_input = self.ln2(x)
        x = x + self.drop(self.mlp(ffn_input))
        return x, ffn_input

    def step(self, x: Tensor, past: Optional[tuple[Tensor, Tensor]]
             ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """``forward`` for tokens after the cached ones: also their keys and values."""
        attended, present = self.attn.step(self.ln1(x), past)
        x = x + self.drop(attended)
        ffn_input = self.ln2(x)
        return x + self.drop(self.mlp(ffn_input)), ffn_input, present


class GPT(BaseLM):
    # the vocabulary a checkpoint was trained on, set by ``gnnlm.models.load_gpt_checkpoint``
    vocab_fingerprint: Optional[str]

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.d_model
        self.context_length, self.memory_length = cfg.context_length, cfg.memory_length
        self.name = "gpt"
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor, memory: Optional[list[Tensor]] = None) -> Features:
        """``input_ids [B, T]`` → features ``[B, T, d]``; ``memory``: per-layer ``[B, M', d]``."""
        if memory is not None and len(memory) != len(self.blocks):
            raise ValueError(f"memory must hold one tensor per layer (got {len(memory)} for "
                             f"{len(self.blocks)} layers).")
        x = self.drop(self.wte(input_ids))                                # [B, T, d]
        new_memory: Optional[list[Tensor]] = [] if self.memory_length > 0 else None
        ffn_input = x
        for layer, block in enumerate(self.blocks):
            mem = None if memory is None else memory[layer]
            if new_memory is not None:
                joined = x if mem is None else torch.cat([mem, x], dim=1)
                new_memory.append(joined[:, -self.memory_length:].detach())
            x, ffn_input = block(x, mem)
        return Features(final=self.ln_f(x), att=ffn_input, memory=new_memory)

    def step(self, input_ids: Tensor, cache: Optional[KVCache] = None
             ) -> tuple[Features, KVCache]:
        """Incremental decoding: the features of ``input_ids [B, T]`` read after the tokens
        ``cache`` holds (None: none), and the cache extended by them. A model with memory starts
        each segment from ``memory_cache(memory)``; the next memory is ``next_memory(cache)``."""
        x = self.drop(self.wte(input_ids))                                # [B, T, d]
        keys, values = [], []
        inputs: Optional[list[Tensor]] = [] if self.memory_length > 0 else None
        ffn_input = x
        for layer, block in enumerate(cast(list[Block], list(self.blocks))):
            past = None if cache is None else (cache.keys[layer], cache.values[layer])
            if inputs is not None:
                before = None if cache is None or cache.inputs is None else cache.inputs[layer]
                inputs.append(x if before is None else torch.cat([before, x], dim=1))
            x, ffn_input, (k, v) = block.step(x, past)
            keys.append(k)
            values.append(v)
        return Features(final=self.ln_f(x), att=ffn_input), KVCache(keys, values, inputs)

    def memory_cache(self, memory: Optional[list[Tensor]]) -> Optional[KVCache]:
        """The cache a segment starts from: Transformer-XL memory (per layer ``[B, M, d]``, the
        layer inputs of the previous segment) as keys and values at positions 0 … M−1, as
        ``forward(..., memory)`` reads it. None without memory."""
        if memory is None:
            return None
        blocks = cast(list[Block], list(self.blocks))
        kv = [block.attn.cached(block.ln1(mem)) for block, mem in zip(blocks, memory)]
        return KVCache([k for k, _ in kv], [v for _, v in kv], list(memory))

    def next_memory(self, cache: KVCache) -> list[Tensor]:
        """The memory the segment a cache has read leaves for the next: each layer's last
        ``memory_length`` inputs, as ``forward`` returns it."""
        if cache.inputs is None:
            raise ValueError("This GPT has no Transformer-XL memory (memory_length = 0).")
        return [x[:, -self.memory_length:].detach() for x in cache.inputs]

    def output_embedding(self) -> tuple[Tensor, Optional[Tensor]]:
        return self.lm_head.weight, None

    def last_block(self) -> list[nn.Module]:
        return [self.blocks[-1], self.ln_f]
