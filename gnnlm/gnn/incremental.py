"""GNN-LM for text that grows: the context nodes of the current block, appended token by token.

Evaluation (``gnnlm.gnn.window_states.WindowStates.forward``) reads a whole block of T tokens at
once. Generation appends one token at a time, and nothing already computed has to change: the
context → context edges are causal (j → i for j ≤ i, GNN-LM §2.2), so a new context node reads
the earlier ones and no earlier node reads it, and window nodes never read the context. So, as a
Transformer's key/value cache, ``ContextStates`` keeps for each layer the intra keys and values
of the block's context nodes so far; a new token's node computes, layer by layer, its attention
over them and over its own k retrieved windows, whose states come from the same window-state
table as evaluation's (each retrieved window computed once). A block ends after ``block_size``
tokens, as evaluation's blocks do, and the next starts empty.

The output equals ``WindowStates.forward`` on the block so far, at its last rows, to float
rounding (``tests/inference/test_inference.py``).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import Tensor

from gnnlm.gnn.dense import ctx_step
from gnnlm.gnn.window_states import WindowStates, inter_messages


class ContextStates:
    """The context nodes of one block per stream (a batch of B streams that stay aligned).

    Args:
        states: the window-state table of the trained stack (``GNNLM.window_states``).
        block_size: tokens per block (the evaluation blocks' size).
    """

    def __init__(self, states: WindowStates, block_size: int):
        self.states, self.block_size = states, block_size
        self.layers = states.layers
        self.ctx_window = states.config.ctx_window
        self._past: list[Optional[tuple[Tensor, Tensor]]] = [None] * len(self.layers)
        self.length = 0  # context nodes in the current block

    def new_block(self) -> None:
        self._past = [None] * len(self.layers)
        self.length = 0

    @torch.no_grad()
    def append(self, ctx: Tensor, retrieved: Tensor) -> Tensor:
        """The stack's output [B, n, d] at ``n`` new context nodes: ``ctx`` [B, n, d], their
        base-LM features, and ``retrieved`` [B, n, k], the train positions of their windows
        (-1: none). They must fit in the current block (``room``)."""
        n = ctx.shape[1]
        if n > self.room:
            raise ValueError(f"{n} tokens do not fit in the block's {self.room} free places: "
                             f"call new_block() at each block boundary.")
        self.states.prepare(retrieved)  # digests the stack: its folded maps reuse the key
        states_at, windows, present = self.states.read(retrieved)
        weights_key = self.states.weights_key
        x = ctx
        for layer, conv in enumerate(self.layers):
            h = conv.pre_norm({"ctx": x})["ctx"]
            x, self._past[layer] = ctx_step(
                conv, x, h, self._past[layer], self.ctx_window,
                partial(inter_messages, conv, states=states_at(layer), windows=windows,
                        present=present, weights_key=weights_key), weights_key)
        self.length += n
        return x

    @property
    def room(self) -> int:
        """Tokens the current block can still take."""
        return self.block_size - self.length
