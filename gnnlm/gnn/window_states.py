"""GNN-LM evaluation with each retrieved window computed once: window states by train position.

Edges go nbr → nbr inside one window and nbr → ctx, never ctx → nbr, and evaluation graphs drop
no node (the leakage rule is for train graphs). So the state of the node at offset o of the
window retrieved at train position p, at the input of any layer, is a function of p, the node
features and the trained weights alone: the same for every token, of any split, that retrieves
p. ``WindowStates`` computes it once per position and keeps it; each layer of a token then
attends over its k windows' kept states. Evaluation costs one window computation per distinct
retrieved position instead of one per retrieval: on WikiText-2's test split at k = 128, about 2M
distinct positions instead of 31M retrievals.

Reading a window is a gather, not a projection. Eq. 2's score K(s) W^ATT · Q(n) equals
h_s · (W^ATT-folded W^k)ᵀ Q(n), so the key map is applied to the token's query, once per token
and head; eq. 3's messages Σ_s att_s (W^FEA-folded W^v h_s + b) equal W (Σ_s att_s h_s) +
b Σ_s att_s, so the value map is applied once to the aggregate. The numbers equal those of
``gnnlm.gnn.dense.conv_dense`` on graphs with one window per retrieval, to float rounding.

What is kept, per train position p and layer ℓ = 1 … L−1: the pre-normed inputs of the window's
w nodes (of the retrieved node alone under ``inter="retrieved"``), float32, so (L−1)·w·d·4 bytes
per position (3 KiB for 3 layers, l = r = 1, d = 128; 12 KiB at d = 512), plus a row number per
train position (8 bytes); layer 0 reads the node features. Rows are taken in the order positions
are first retrieved, up to ``max_windows`` (default: every train position; on a CPU, rows never
taken take no memory; a GPU allocates them at once, so there the default is at most what half
its free memory holds, said once); a batch that would overflow it empties the table and starts
again, so memory stays bounded and the numbers stay exact. Weights that change (a training step, a
loaded checkpoint, a write through ``p.data``, a move to another device) empty it before the
next read: each ``prepare`` compares a digest of the weights' bits
(``gnnlm.utils.tensor_digest``) with the one the table was computed from. That digest
(``weights_key``) also keys the relation maps the layers fold (``gnnlm.gnn.dense.fold``) until
the next ``prepare``, so that a batch or a decoding step digests the stack once.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from functools import partial
from typing import Optional, cast

import torch
from torch import Tensor, nn

from gnnlm.gnn.dense import DenseGraph, ctx_update, fold, window_update
from gnnlm.gnn.graph import NBR_INTER, GraphConfig
from gnnlm.gnn.layer import GNNLMConv, GNNStack
from gnnlm.gnn.node_features import HostFeatures, NodeFeatureReader
from gnnlm.gnn.settings import GraphLayout
from gnnlm.utils import devices
from gnnlm.utils.progress import say
from gnnlm.utils.tensor_digest import autocast_state, tensor_digest


class WindowStates:
    """The states of retrieved windows at every layer's input, computed once per position.

    Args:
        stack: the trained ``GNNStack`` (``kind="gnnlm"``) the states belong to.
        node_features: train positions → their node features (``gnnlm.gnn.pq.RawFeatures`` or
            ``PQFeatures``, read on the table's device by a ``NodeFeatureReader``), as the
            graphs the stack was trained on read them.
        n_train: the train split's size (windows are clipped to it).
        config: the window sizes and inter edges of those graphs.
        max_windows: the most windows kept (default: ``n_train``, every train position; on a
            GPU whose free memory cannot hold them in half of it, as many as it can, said once).
        windows_per_step: windows computed at once when filling (bounds the memory of a fill).
    """

    def __init__(self, stack: GNNStack, node_features: HostFeatures | NodeFeatureReader,
                 n_train: int, config: GraphConfig | GraphLayout,
                 max_windows: Optional[int] = None, windows_per_step: int = 16384):
        if stack.kind != "gnnlm":
            raise ValueError(f"window states are GNNLMConv layers' (got kind={stack.kind!r}).")
        self.stack, self.n_train = stack, n_train
        self.node_features = (node_features if isinstance(node_features, NodeFeatureReader)
                              else NodeFeatureReader(node_features))
        self.config, self.windows_per_step = config, windows_per_step
        self.max_windows = n_train if max_windows is None else max_windows
        if self.max_windows < 1:
            raise ValueError(f"max_windows must be at least 1 (got {max_windows}).")
        self._asked = max_windows
        self._said: set[str] = set()          # devices told the default does not fit
        self.layers = [cast(GNNLMConv, layer) for layer in stack.layers]
        self.offsets = torch.arange(-config.left, config.right + 1)         # [w]
        # the window slots the context reads: all, or the retrieved token's
        self.slots = slice(None) if config.inter == "window" else \
            slice(config.left, config.left + 1)
        self._table: Optional[Tensor] = None  # [L-1, 1 + max_windows, w', d]; row 0: no window
        self._row: Optional[Tensor] = None    # [n_train + 1] position -> row (0: not kept)
        self._used = 0                        # rows taken
        self._weights: Optional[tuple] = None  # what the table was computed from
        self.computed = 0                     # windows computed since the weights changed

    # -- the table ------------------------------------------------------------------------
    def _weights_key(self, device: torch.device) -> tuple:
        """Changes whenever a parameter or buffer changes, however it was written: a digest of
        the bits (``_version`` misses writes through ``.data`` and fused optimiser steps); and
        with the autocast the windows are computed under (bf16 autocast gives other numbers)."""
        return (str(device), autocast_state(device),
                tensor_digest([*self.stack.parameters(), *self.stack.buffers()]))

    @property
    def weights_key(self) -> Optional[tuple]:
        """The digest of the weights the table was computed from, taken by the last
        ``prepare``: valid until the weights next change, which ``fold`` may key its maps on
        (None before a ``prepare``, and for one layer, which keeps no table)."""
        return self._weights

    def clear(self) -> None:
        self._table = self._row = self._weights = None
        self._used = self.computed = 0

    def _ensure_table(self, device: torch.device) -> tuple[Tensor, Tensor]:
        key = self._weights_key(device)
        if self._table is None or key != self._weights:
            self.clear()
            d, w = self.layers[0].channels, len(self.offsets[self.slots])
            self.max_windows = self._rows_on(device, w, d)
            # one table per layer, rows of whole windows: reading is a row gather
            self._table = torch.empty(max(len(self.layers) - 1, 0), 1 + self.max_windows, w, d,
                                      device=device, dtype=self._dtype())
            self._table[:, 0] = 0.0  # what a missing neighbour (-1) reads
            self._row = torch.zeros(self.n_train + 1, dtype=torch.long, device=device)
            self._weights = key
        assert self._table is not None and self._row is not None
        return self._table, self._row

    def _window_inputs(self, positions: Tensor, slots: slice = slice(None)
                       ) -> tuple[Tensor, Tensor]:
        """Node features of the windows around ``positions`` [U] (≥ 0), in window slots
        ``slots``: ``(x [U, w', d], present [U, w'])``. A node outside the split reads the
        nearest row instead: every softmax masks it out, so it only has to be finite."""
        q = positions[:, None] + self.offsets[slots].to(positions.device)   # [U, w']
        present = (q >= 0) & (q < self.n_train)
        x = self.node_features(q.clamp(0, self.n_train - 1).flatten()).to(self._dtype())
        return x.view(*q.shape, -1), present

    def _rows_on(self, device: torch.device, w: int, d: int) -> int:
        """``max_windows`` as given; by default every train position, or on a GPU whose free
        memory cannot hold their table in half of it (a CPU touches only the rows it takes; a
        GPU allocates them all at once), as many windows as half of it holds."""
        if self._asked is not None:
            return self._asked
        row_bytes = (len(self.layers) - 1) * w * d * self._dtype().itemsize
        row_map = 8 * (self.n_train + 1)
        nbytes = (1 + self.n_train) * row_bytes + row_map
        room = devices.resident_room(device)
        if room is None or nbytes <= room:
            return self.n_train
        rows = max(1, (room - row_map) // row_bytes - 1)
        if str(device) not in self._said:
            self._said.add(str(device))
            say(f"[gnnlm] GNN-LM window states: a window for every train position "
                f"({nbytes / 2**30:.1f} GiB) {devices.why_not_resident(device, nbytes)}: "
                f"keeping {rows} windows, computed again when the table fills (the same "
                f"numbers); model.max_windows sets it")
        return rows

    def _dtype(self) -> torch.dtype:
        return next(self.stack.parameters()).dtype  # float32 (float64 in reference tests)

    @torch.no_grad()
    def _fill(self, positions: Tensor, rows: Tensor, table: Tensor) -> None:
        """Compute the windows of ``positions`` [U] (distinct) through layers 0 … L−2 into
        table ``rows`` [U]."""
        for start in range(0, positions.shape[0], self.windows_per_step):
            part = positions[start:start + self.windows_per_step]
            h, present = self._window_inputs(part)                          # [u, w, d]
            for layer, (conv, following) in enumerate(zip(self.layers, self.layers[1:])):
                h = window_update(conv, h, conv.pre_norm({"nbr": h})["nbr"], present,
                                  self.weights_key)
                table[layer].index_copy_(0, rows[start:start + len(part)], following.pre_norm(
                    {"nbr": h})["nbr"][:, self.slots].contiguous())
            self.computed += part.shape[0]

    def prepare(self, retrieved: Tensor) -> None:
        """Compute the windows of the positions in ``retrieved`` [...] (-1: none) that are not
        in the table yet."""
        if self.stack.training:
            raise RuntimeError("Window states are for evaluation: in training the weights "
                               "change at every step (call model.eval() first).")
        if len(self.layers) == 1:  # one layer reads the node features alone
            return
        table, row = self._ensure_table(retrieved.device)
        positions = torch.unique(retrieved[retrieved >= 0])                  # sorted
        if positions.numel() > self.max_windows:
            raise ValueError(f"A batch retrieves {positions.numel()} distinct windows but the "
                             f"window states keep at most max_windows = {self.max_windows}: "
                             f"raise it or evaluate smaller batches.")
        missing = positions[row[positions] == 0]
        if self._used + missing.numel() > self.max_windows:  # full: start again
            row.zero_()
            self._used, missing = 0, positions
        if missing.numel():
            rows = torch.arange(self._used + 1, self._used + 1 + missing.numel(),
                                device=row.device)
            self._fill(missing, rows, table)
            row[missing] = rows
            self._used += missing.numel()

    def read(self, retrieved: Tensor) -> tuple[Callable[[int], Tensor], Tensor, Tensor]:
        """What the layers read of the windows of ``retrieved`` [B, T, k]: a function of the
        layer → the pre-normed node states of the distinct windows ``[U, w', d]``, which window
        each retrieval reads ``[B, T, k]`` (an index into U), and which nodes exist
        ``[B, T, k·w']``. The table is read once per distinct window, in row order (a sorted
        gather is several times faster than one in token order)."""
        B, T, k = retrieved.shape
        q = retrieved[..., None] + self.offsets[self.slots].to(retrieved.device)  # [B, T, k, w']
        present = (retrieved[..., None] >= 0) & (q >= 0) & (q < self.n_train)
        positions = torch.where(retrieved >= 0, retrieved, self.n_train)
        distinct, inverse = torch.unique(positions, return_inverse=True)      # sorted

        def states(layer: int) -> Tensor:
            if layer > 0:
                assert self._table is not None and self._row is not None
                return self._table[layer - 1].index_select(0, self._row[distinct])  # [U, w', d]
            # the node features (position n_train, no window, reads a clamped row: masked out)
            x, _ = self._window_inputs(distinct, self.slots)                  # [U, w', d]
            return self.layers[0].pre_norm({"nbr": x})["nbr"]

        return states, inverse, present.reshape(B, T, -1)

    # -- the context ----------------------------------------------------------------------
    def forward(self, ctx: Tensor, graph: DenseGraph) -> Tensor:
        """The stack's output at the ctx nodes [B, T, d] of blocks whose windows are given by
        position (``graph.retrieved``, from ``gnnlm.gnn.graph.build_context_graph``)."""
        if graph.retrieved is None:
            raise ValueError("WindowStates reads blocks built by build_context_graph "
                             "(ctx.retrieved); this batch has window nodes.")
        self.prepare(graph.retrieved)
        states_at, inverse, present = self.read(graph.retrieved)
        for layer, conv in enumerate(self.layers):
            states = states_at(layer)
            h_ctx = conv.pre_norm({"ctx": ctx})["ctx"]
            ctx = ctx_update(conv, ctx, h_ctx, graph, partial(
                inter_messages, conv, states=states, windows=inverse, present=present,
                weights_key=self.weights_key), self.weights_key)
        return ctx

    __call__ = forward


def inter_messages(conv: GNNLMConv, q: Tensor, states: Tensor, windows: Tensor,
                   present: Tensor, weights_key: Optional[Hashable] = None
                   ) -> tuple[Tensor, Tensor]:
    """The inter messages, ctx ← nbr (eq. 2–3), for the tokens' queries ``q`` [B, T, H, D]
    from their windows' pre-normed node states: ``states`` [U, w', d] of the distinct windows,
    ``windows`` [B, T, k] which one each retrieval reads, ``present`` [B, T, k·w'] which nodes
    exist. The relation-folded key map is applied to the query, the value map to the aggregate
    (see the module docstring). A block at a time, so that its gathered states [T, k·w', d] are read
    back from cache. Returns the messages [B, T, H, D] and whether any source reached each
    token [B, T]. ``weights_key`` as ``gnnlm.gnn.dense.fold``'s."""
    H, D, d = conv.heads, conv.head_dim, conv.channels
    B, T, k = windows.shape
    # a key bias would add the same score to every source of a token: the softmax cancels it
    key_map, _ = fold(cast(nn.Linear, conv.k_lin["nbr"]), conv.w_att["inter"],
                      weights_key)                                        # [H·D, d]
    value_map, value_bias = fold(cast(nn.Linear, conv.v_lin["nbr"]), conv.w_fea["inter"],
                                 weights_key)
    query = torch.einsum("bthe,hed->bthd", q, key_map.view(H, D, d))      # [B, T, H, d]
    query = query * (conv.mu["__".join(NBR_INTER)] / math.sqrt(D))[:, None]
    agg = query.new_empty(B, T, H, d)
    weight = query.new_empty(B, T, H)                                     # Σ_s att_s
    for b in range(B):
        sources = states.index_select(0, windows[b].flatten()).view(T, -1, d)  # [T, S, d]
        scores = torch.bmm(sources, query[b].transpose(1, 2))             # [T, S, H]
        scores = scores.masked_fill(~present[b, :, :, None], torch.finfo(scores.dtype).min)
        att = torch.softmax(scores, dim=1) * present[b, :, :, None]       # rows of none: 0
        agg[b] = torch.bmm(att.transpose(1, 2), sources)                  # [T, H, d]
        weight[b] = att.sum(1)
    messages = torch.einsum("bthd,hed->bthe", agg, value_map.view(H, D, d))
    if value_bias is not None:
        messages = messages + value_bias.view(H, D) * weight[..., None]
    return messages, present.any(-1)
