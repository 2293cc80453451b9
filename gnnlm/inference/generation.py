"""Generation with retrieval: greedy or sampled, one token at a time, under any row.

Each step reads the token just chosen into the row's ``Decoder`` (``gnnlm.inference.decoding``):
the base LM extends its key/value cache, kNN-LM searches once, GNN-LM appends one context node.
The next token is the argmax (``greedy``) or a sample from the distribution reshaped as Hugging
Face's warpers reshape it: divided by ``temperature``, cut to the ``top_k`` most likely tokens,
then to the smallest set whose probability reaches ``top_p`` (at least one token). A ``seed``
makes sampling repeatable. Exactly ``max_new_tokens`` tokens are generated (an end-of-text token
is a token like any other here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from gnnlm.inference.decoding import Decoder
from gnnlm.inference.parts import LMParts, Text
from gnnlm.inference.sampling import check_sampling


@dataclass
class Retrieved:
    """The top train neighbour the last position's query found: its datastore position, its
    similarity, and its value (the train token after it)."""
    position: int
    similarity: float
    value: int


@dataclass
class Generation:
    """One prompt's continuation: ``ids`` and ``text`` of the new tokens, ``logprobs`` the row's
    log p of each chosen token; with ``show_retrieval``, ``retrieved`` per new token (the
    neighbour the position before it found); with ``keep_distributions``, ``distributions``
    [max_new_tokens, V], the row's log p at each step."""
    row: str
    prompt_ids: np.ndarray
    ids: np.ndarray
    text: str
    logprobs: np.ndarray
    retrieved: list[Retrieved] = field(default_factory=list)
    distributions: Optional[Tensor] = None


def choose(logprobs: Tensor, greedy: bool, temperature: Optional[float], top_k: Optional[int],
           top_p: Optional[float], generator: torch.Generator) -> Tensor:
    """The next token of each row of ``logprobs`` [B, V]: [B] int64."""
    if greedy:
        return logprobs.argmax(-1)
    # from the best token's 0 down: a tiny temperature sends the others to -inf, never the
    # best one (the softmax of all -inf is NaN)
    scores = (logprobs - logprobs.max(-1, keepdim=True).values) / (temperature or 1.0)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(int(top_k), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1:
        ordered, order = scores.sort(dim=-1)                               # ascending
        below = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        below[:, -1] = False                                               # keep the best
        scores = scores.masked_fill(below.scatter(1, order, below), -torch.inf)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]


def generate(lm: LMParts, prompt: Union[Text, list[str]], row: str, max_new_tokens: int,
             greedy: bool = False, temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None, show_retrieval: bool = False,
             keep_distributions: bool = False, incremental: bool = True,
             **overrides: Any) -> Union[Generation, list[Generation]]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens under ``row``. A list of texts is a
    batch: prompts of one token length are decoded together. ``overrides``: the row's settings
    (``knn_k``, ``knn_temperature``, ``lam``, ``gnn_k``). ``incremental=False`` recomputes
    every step from scratch (the reference the incremental decoder is tested against)."""
    check_sampling(max_new_tokens, greedy, temperature, top_k, top_p)
    served = lm.served.row(row)  # the row parsed once, at the door
    settings = lm.settings(served, **overrides)
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str) for p in prompt)
    texts: list[Any] = list(prompt) if batch else [prompt]
    prompts = [lm.encode(p, prompt=True) for p in texts]
    generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    if seed is None:
        generator.seed()
    out: list[Optional[Generation]] = [None] * len(prompts)
    for length in sorted({len(p) for p in prompts}):
        group = [i for i, p in enumerate(prompts) if len(p) == length]
        tokens = torch.from_numpy(np.stack([prompts[i] for i in group]))
        decoder = Decoder(lm, served, settings, incremental)
        results = _decode(decoder, tokens, max_new_tokens, greedy, temperature, top_k, top_p,
                          generator, show_retrieval, keep_distributions)
        for i, result in zip(group, results):
            out[i] = result
    done = [g for g in out if g is not None]
    return done if batch else done[0]


def _decode(decoder: Decoder, tokens: Tensor, steps: int, greedy: bool,
            temperature: Optional[float], top_k: Optional[int], top_p: Optional[float],
            generator: torch.Generator, show_retrieval: bool, keep: bool) -> list[Generation]:
    lm = decoder.lm
    logprobs = decoder.start(tokens)
    chosen, scores, seen, found = [], [], [], []
    for step in range(steps):
        if keep:
            seen.append(logprobs)
        if show_retrieval:
            found.append(_top_neighbour(decoder))
        token = choose(logprobs, greedy, temperature, top_k, top_p, generator)
        chosen.append(token)
        scores.append(logprobs.gather(1, token[:, None])[:, 0])
        if step + 1 < steps:
            logprobs = decoder.append(token[:, None])
    ids = torch.stack(chosen, 1).numpy()
    values = torch.stack(scores, 1).numpy()
    return [Generation(decoder.row.name, tokens[b].numpy(), ids[b], lm.decode(ids[b]), values[b],
                       [f[b] for f in found], torch.stack([s[b] for s in seen]) if keep else None)
            for b in range(len(ids))]


def _top_neighbour(decoder: Decoder) -> list[Retrieved]:
    """Each stream's top neighbour of the last position, under the primary retrieval."""
    key, metric = decoder.lm.primary_retrieval()
    sims, ids = (a[:, -1, 0] for a in decoder.neighbours(key, metric))
    values = decoder.lm.lookup(key, metric).values(ids[:, None])[:, 0]
    return [Retrieved(int(i), float(s), int(v)) for s, i, v in zip(sims, ids, values)]
