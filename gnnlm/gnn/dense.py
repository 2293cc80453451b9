"""GNN-LM on the retrieval graph's regular layout: the same layer as ``GNNLMConv``, as dense ops.

A batch of B graphs (blocks of T target tokens, each with k windows of w = l + 1 + r train
positions) has a regular shape, so the message passing of ``GNNLMConv`` (gnnlm/gnn/layer.py) is
a handful of batched tensor operations on ``ctx`` [B, T, d] and ``nbr`` [B, T, k, w, d]:

- ctx ← ctx (causal edges): masked scaled dot-product attention over the block, per head, with
  the prior μ folded into the query scale;
- ctx ← nbr (inter edges): attention of each token over its own k·w window nodes (or its k
  retrieved tokens, ``inter="retrieved"``);
- nbr ← nbr (intra edges): attention of each window node over itself and its two neighbours in
  the window, as three shifted copies.

An evaluation block built without its windows (``gnnlm.gnn.graph.build_context_graph``) carries
``DenseGraph.retrieved`` [B, T, k] instead, and ``gnnlm.gnn.window_states`` supplies the windows.

Absent nodes (clipped windows, fewer than k neighbours, nodes dropped for leakage, the padding
of a short last block) are masked out of every softmax, so the result equals ``GNNLMConv`` on
the HeteroData the dense layout came from (``to_dense``), to float tolerance. The parameters are
those of the ``GNNLMConv`` layers: one module, two ways to run it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.gnn.graph import CTX_INTRA, NBR_INTER, NBR_INTRA, GraphConfig
from gnnlm.gnn.layer import GNNLMConv, GNNStack
from gnnlm.gnn.settings import GraphLayout
from gnnlm.utils.tensor_digest import autocast_state, tensor_digest


@dataclass
class DenseGraph:
    """The structure of a batch of retrieval graphs in their regular layout."""
    ctx_mask: Tensor                 # [B, T] bool: the token exists
    nbr_mask: Tensor                 # [B, T, k, w] bool: the window node exists
    center: int                      # the retrieved token's slot in a window (= l)
    inter: str = "window"            # which window nodes send to the context
    ctx_window: Optional[int] = None  # causal edges only from the last ``ctx_window`` tokens
    retrieved: Optional[Tensor] = None  # [B, T, k] train positions, blocks without windows
    ctx_slots: Optional[tuple[Tensor, Tensor]] = None  # each [n_ctx]: a token's graph, row

    def causal_mask(self) -> Tensor:
        """[B, 1, T, T] bool: token i reads token j ≤ i (within the ctx window) that exists."""
        T = self.ctx_mask.shape[1]
        i = torch.arange(T, device=self.ctx_mask.device)
        allowed = i[None, :] <= i[:, None]
        if self.ctx_window is not None:
            allowed &= i[:, None] - i[None, :] < self.ctx_window
        return allowed[None, None] & self.ctx_mask[:, None, None, :]

    def tokens(self, dense: Tensor) -> Tensor:
        """The rows of ``dense`` [B, T, ...] at the existing tokens, in node order: [n_ctx, ...].
        Gathered at ``ctx_slots`` when the layout has them (indexing by ``ctx_mask`` would
        read the mask back from the device to size its result)."""
        if self.ctx_slots is None:
            return dense[self.ctx_mask]
        return dense[self.ctx_slots]


def context_layout(ctx_mask: Tensor, retrieved: Tensor, config: GraphConfig | GraphLayout,
                   ctx_slots: Optional[tuple[Tensor, Tensor]] = None) -> DenseGraph:
    """The layout of blocks without window nodes (``build_context_graph``'s): tokens
    ``ctx_mask`` [B, T] that retrieved the train positions ``retrieved`` [B, T, k] (-1: none),
    whose windows ``gnnlm.gnn.window_states`` supplies."""
    no_nodes = torch.zeros(*ctx_mask.shape, 0, config.left + config.right + 1, dtype=torch.bool,
                           device=ctx_mask.device)
    return DenseGraph(ctx_mask, no_nodes, config.left, config.inter, config.ctx_window, retrieved,
                      ctx_slots)


def layout_sizes(batch) -> tuple[int, int, int]:
    """(B graphs, T rows, k window slots) of a (batched) HeteroData's dense layout.

    Graphs from ``gnnlm.gnn.graph`` carry their ``layout_size`` as Python ints (a list of them
    once batched), so the sizes are known on the host. Other graphs' sizes are read from their
    index tensors, which on a GPU waits for every queued kernel."""
    sizes = getattr(batch, "layout_size", None)
    if sizes is not None:
        # one graph's (T, k), or a batch's list of them; PyG's ``.to`` makes tuples lists
        per_graph = [sizes] if isinstance(sizes[0], int) else list(sizes)
        return (len(per_graph), max(T for T, _ in per_graph),
                max(max(k for _, k in per_graph), 1))
    ctx_store, nbr_store = batch["ctx"], batch["nbr"]
    n_ctx = ctx_store.num_nodes
    ctx_graph = getattr(ctx_store, "batch", None)
    k = int(nbr_store.rank.max()) + 1 if nbr_store.num_nodes else 1
    if ctx_graph is None or not n_ctx:  # a single graph (or none)
        return 1, n_ctx, k
    B = int(ctx_graph.max()) + 1
    return B, int(torch.bincount(ctx_graph, minlength=B).max()), k


def to_dense(batch, config: GraphConfig | GraphLayout, x_key: str = "x"
             ) -> tuple[Tensor, Tensor, DenseGraph]:
    """A (batched) HeteroData from ``gnnlm.gnn.graph.build_graph`` in the regular layout:
    ``(ctx [B, T, d], nbr [B, T, k, w, d], DenseGraph)``. Node features are ``x_key``. The window
    sizes, inter edges and ctx window are ``config``'s; k is the batch's (``nbr.rank`` + 1), so
    one config serves every step of a k curriculum. A batch of ``build_context_graph`` blocks
    has no window nodes: its ``ctx.retrieved`` comes back as ``DenseGraph.retrieved``.

    Nothing here reads a value back from the device when the graphs carry ``layout_size``
    (``layout_sizes``): a training step on a GPU is then queued without waiting."""
    ctx_store, nbr_store = batch["ctx"], batch["nbr"]
    ctx_x, nbr_x = ctx_store[x_key], nbr_store.get(x_key)
    n_ctx, d = ctx_x.shape
    device = ctx_x.device
    B, T, k = layout_sizes(batch)
    ctx_graph = getattr(ctx_store, "batch", None)
    local = torch.arange(n_ctx, device=device)                           # [n_ctx]
    if ctx_graph is None:  # a single graph
        ctx_graph = torch.zeros(n_ctx, dtype=torch.long, device=device)
    else:                  # a row's place in its graph: minus its graph's first node
        local = local - ctx_store.ptr[ctx_graph]
    w = config.left + config.right + 1
    ctx = ctx_x.new_zeros(B, T, d)
    ctx[ctx_graph, local] = ctx_x
    ctx_mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    ctx_mask[ctx_graph, local] = True
    retrieved = None
    if "retrieved" in ctx_store:                                         # no window nodes
        ids = ctx_store.retrieved                                        # [n_ctx, k]
        retrieved = ids.new_full((B, T, ids.shape[1]), -1)
        retrieved[ctx_graph, local] = ids
        return ctx, ctx_x.new_zeros(B, T, 0, w, d), context_layout(ctx_mask, retrieved, config,
                                                                     (ctx_graph, local))
    nbr_graph = getattr(nbr_store, "batch", None)
    if nbr_graph is None:
        nbr_graph = torch.zeros(nbr_x.shape[0], dtype=torch.long, device=device)
    nbr = nbr_x.new_zeros(B, T, k, w, d)
    nbr_mask = torch.zeros(B, T, k, w, dtype=torch.bool, device=device)
    slot = (nbr_graph, nbr_store.owner_local, nbr_store.rank, nbr_store.offset + config.left)
    nbr[slot] = nbr_x
    nbr_mask[slot] = True
    return ctx, nbr, DenseGraph(ctx_mask, nbr_mask, config.left, config.inter,
                                config.ctx_window, ctx_slots=(ctx_graph, local))


def _linear(modules: nn.ModuleDict, node_type: str) -> nn.Linear:
    return cast(nn.Linear, modules[node_type])


def fold(lin: nn.Linear, relation: Tensor, weights_key: Optional[Hashable] = None
         ) -> tuple[Tensor, Optional[Tensor]]:
    """W^k followed by the head-wise W^ATT (or W^v by W^FEA) as one [d, d] linear map, so that
    ``F.linear(h, *fold(W^k, W^ATT))`` is K(s) W^ATT of eq. 2 (and likewise eq. 3).

    Without autograd (evaluation, generation) the map is kept on ``lin`` until a weight
    changes: a generated token runs every layer once, and folding cost it as much as the
    layer's attention. The weights are told by a digest of their bits
    (``gnnlm.utils.tensor_digest``), which a write through ``.data`` changes too. A caller
    that has just digested weights including these passes that digest as ``weights_key``
    (``WindowStates.weights_key``: the whole stack's, taken once per batch or decoding step),
    so that the 4 maps of each layer are not digested again one by one; without it,
    ``relation`` and ``lin`` are digested here. A map is kept per autocast state as well:
    under bf16 autocast it is folded in bf16."""
    if torch.is_grad_enabled():
        return _fold(lin, relation)
    if weights_key is None:
        weights_key = tensor_digest([relation, lin.weight, lin.bias])
    key = (id(relation), weights_key, autocast_state(relation.device))
    kept = lin.__dict__.setdefault("_folded", {})
    if key not in kept:
        if len(kept) >= 8:  # maps of earlier weights: a map reads at most two relations
            kept.clear()
        kept[key] = _fold(lin, relation)
    return kept[key]


def _fold(lin: nn.Linear, relation: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    H, D, _ = relation.shape
    weight = lin.weight.view(H, D, -1)                                     # [H, D, d]
    folded = torch.einsum("hde,hdi->hei", relation, weight).reshape(H * D, -1)
    bias = None if lin.bias is None else torch.einsum(
        "hde,hd->he", relation, lin.bias.view(H, D)).reshape(H * D)
    return folded, bias


def _project(h: Tensor, maps: list[tuple[Tensor, Optional[Tensor]]], H: int, D: int
             ) -> list[Tensor]:
    """Several linear maps of ``h`` [..., d] in one matrix product; each [..., H, D]."""
    weight = torch.cat([w for w, _ in maps])
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in maps])
    out = F.linear(h, weight, bias)
    return [part.view(*h.shape[:-1], H, D) for part in out.split(H * D, dim=-1)]


def _softmax_attend(scores: Tensor, mask: Tensor, values: Union[Tensor, list[Tensor]],
                    dropout: float, training: bool) -> Tensor:
    """``scores`` [..., S, H] of S sources (``mask`` [..., S]) → Σ_s att_s · values[s]
    [..., H, D], with ``values`` a list of S tensors [..., H, D] or one [..., S, H, D] tensor.
    Rows without sources aggregate to zero (no NaN, forward or backward)."""
    scores = scores.masked_fill(~mask[..., None], torch.finfo(scores.dtype).min)
    att = torch.softmax(scores, dim=-2) * mask[..., None]                   # eq. 2
    att = F.dropout(att, dropout, training)
    if isinstance(values, Tensor):
        return (att[..., None] * values).sum(dim=-3)
    out = att[..., 0, :, None] * values[0]
    for s in range(1, len(values)):
        out = out + att[..., s, :, None] * values[s]
    return out


def _inter_attend(conv: GNNLMConv, q: Tensor, keys: Tensor, feats: Tensor,
                  graph: DenseGraph) -> tuple[Tensor, Tensor]:
    """The inter edges, ctx ← nbr (eq. 2–3): each token's attention over its windows' nodes
    (or retrieved tokens). ``q`` [B, T, H, D]; ``keys``/``feats`` [B, T, k, w', H, D], w' = w,
    or 1 when only the retrieved tokens were projected. Returns the messages [B, T, H, D] and
    whether any source reached each token [B, T]."""
    B, T, H, D = q.shape
    read = slice(None) if graph.inter == "window" else slice(graph.center, graph.center + 1)
    sent = read if keys.shape[3] == graph.nbr_mask.shape[3] else slice(None)
    keys = keys[:, :, :, sent].reshape(B, T, -1, H, D)                    # [B, T, S, H, D]
    feats = feats[:, :, :, sent].reshape(B, T, -1, H, D)
    mask = graph.nbr_mask[:, :, :, read].reshape(B, T, -1)                # [B, T, S]
    scores = (keys * q[:, :, None]).sum(-1) * (conv.mu["__".join(NBR_INTER)] / math.sqrt(D))
    return _softmax_attend(scores, mask, feats, conv.dropout, conv.training), mask.any(-1)


def _ctx_projections(conv: GNNLMConv, h_ctx: Tensor, weights_key: Optional[Hashable]
                     ) -> list[Tensor]:
    """The ctx nodes' query, intra key (K W^ATT) and intra value (V W^FEA), each
    [..., H, D], of ``h_ctx`` [..., d] (after the pre-norm); ``weights_key`` as ``fold``'s."""
    return _project(h_ctx, [
        (_linear(conv.q_lin, "ctx").weight, _linear(conv.q_lin, "ctx").bias),
        fold(_linear(conv.k_lin, "ctx"), conv.w_att["intra"], weights_key),
        fold(_linear(conv.v_lin, "ctx"), conv.w_fea["intra"], weights_key)],
        conv.heads, conv.head_dim)


def _causal_attend(conv: GNNLMConv, q: Tensor, key: Tensor, feat: Tensor,
                   mask: Optional[Tensor]) -> Tensor:
    """The ctx ← ctx messages: the queries ``q`` [B, T, H, D] over ``key``/``feat``
    [B, S, H, D] where ``mask`` [..., T, S] allows (None: all of them); μ/√d folded into the
    query, per head. [B, T, H, D]."""
    scale = (conv.mu["__".join(CTX_INTRA)] / math.sqrt(conv.head_dim))[None, :, None, None]
    return F.scaled_dot_product_attention(
        q.transpose(1, 2) * scale, key.transpose(1, 2), feat.transpose(1, 2), attn_mask=mask,
        dropout_p=conv.dropout if conv.training else 0.0, scale=1.0).transpose(1, 2)


def _ctx_output(conv: GNNLMConv, ctx: Tensor, causal: Tensor, messages: Tensor,
                any_source: Tensor) -> Tensor:
    """Eq. 4 and 1 at the ctx nodes: the causal and inter messages summed (or averaged over
    the edge types that reach each token), W^o, the residual."""
    B, T, d = ctx.shape
    agg = causal + messages
    if conv.edge_aggr == "mean":  # the self loop always reaches a token
        agg = agg / (1.0 + any_source.to(agg.dtype))[..., None, None]
    return conv.residual("ctx", ctx, conv.o_lin["ctx"](agg.reshape(B, T, d)))


def ctx_update(conv: GNNLMConv, ctx: Tensor, h_ctx: Tensor, graph: DenseGraph,
               inter: Callable[[Tensor], tuple[Tensor, Tensor]],
               weights_key: Optional[Hashable] = None) -> Tensor:
    """The ctx nodes' layer output (eq. 1–4): causal attention over the block plus the inter
    messages, ``inter(q)`` → (messages [B, T, H, D], any source [B, T]) for the queries
    ``q`` [B, T, H, D]. ``h_ctx`` is ``ctx`` [B, T, d] after the pre-norm; ``weights_key``
    as ``fold``'s."""
    q, key, feat = _ctx_projections(conv, h_ctx, weights_key)               # each [B, T, H, D]
    causal = _causal_attend(conv, q, key, feat, graph.causal_mask())
    return _ctx_output(conv, ctx, causal, *inter(q))                       # inter: ctx ← nbr


def ctx_step(conv: GNNLMConv, ctx: Tensor, h_ctx: Tensor,
             past: Optional[tuple[Tensor, Tensor]], ctx_window: Optional[int],
             inter: Callable[[Tensor], tuple[Tensor, Tensor]],
             weights_key: Optional[Hashable] = None
             ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``ctx_update`` for T tokens appended after the P earlier tokens of their block, whose
    intra keys and values at this layer are ``past`` ([B, P, H, D] each; None: none): the
    layer output of the new tokens [B, T, d], and the keys and values of all P + T. The causal
    edges run j → i for j ≤ i (within ``ctx_window``), so the earlier tokens' outputs do not
    change and are not recomputed. ``weights_key`` as ``fold``'s."""
    q, key, feat = _ctx_projections(conv, h_ctx, weights_key)               # each [B, T, H, D]
    if past is not None:
        key, feat = torch.cat([past[0], key], dim=1), torch.cat([past[1], feat], dim=1)
    T, S = q.shape[1], key.shape[1]
    i = torch.arange(S - T, S, device=q.device)[:, None]                   # absolute positions
    j = torch.arange(S, device=q.device)[None, :]
    allowed = j <= i
    if ctx_window is not None:
        allowed &= i - j < ctx_window
    # one new token reads every earlier one: no mask to apply
    causal = _causal_attend(conv, q, key, feat,
                            None if T == 1 and ctx_window is None else allowed)
    return _ctx_output(conv, ctx, causal, *inter(q)), (key, feat)


def window_update(conv: GNNLMConv, nbr: Tensor, h: Tensor, present: Tensor,
                  weights_key: Optional[Hashable] = None) -> Tensor:
    """The window nodes' layer output (eq. 1–4 over the intra edges): each node [..., w, d]
    over its left neighbour, itself and its right neighbour. ``h`` is ``nbr`` after the
    pre-norm, ``present`` [..., w] the nodes that exist; ``weights_key`` as ``fold``'s."""
    H, D, d = conv.heads, conv.head_dim, conv.channels
    w = nbr.shape[-2]
    key, feat, q = _project(h, [fold(_linear(conv.k_lin, "nbr"), conv.w_att["intra"],
                                     weights_key),
                                fold(_linear(conv.v_lin, "nbr"), conv.w_fea["intra"],
                                     weights_key),
                                (_linear(conv.q_lin, "nbr").weight,
                                 _linear(conv.q_lin, "nbr").bias)], H, D)  # [..., w, H, D]
    pad = (0, 0, 0, 0, 1, 1)  # one empty slot on each side of the window axis
    key, feat = F.pad(key, pad), F.pad(feat, pad)                           # [..., w+2, H, D]
    padded = F.pad(present, (1, 1))                                         # [..., w+2]
    scale = conv.mu["__".join(NBR_INTRA)] / math.sqrt(D)
    scores = torch.stack([(q * key[..., s:s + w, :, :]).sum(-1) * scale
                          for s in range(3)], dim=-2)                       # [..., w, 3, H]
    mask = torch.stack([padded[..., s:s + w] for s in range(3)], dim=-1)
    mask = mask & present[..., None]                                        # [..., w, 3]
    agg = _softmax_attend(scores, mask, [feat[..., s:s + w, :, :] for s in range(3)],
                          conv.dropout, conv.training)                      # [..., w, H, D]
    return conv.residual("nbr", nbr, conv.o_lin["nbr"](agg.reshape(*nbr.shape[:-1], d)))


def conv_dense(conv: GNNLMConv, ctx: Tensor, nbr: Tensor, graph: DenseGraph
               ) -> tuple[Tensor, Tensor]:
    """One ``GNNLMConv`` (eq. 1–4) on the dense layout: ``(ctx', nbr')``. ``nbr`` passes
    through unchanged when the layer does not update it (a last layer read out at ``ctx``)."""
    H, D = conv.heads, conv.head_dim
    h = conv.pre_norm({"ctx": ctx, "nbr": nbr})
    update_nbr = "nbr" in conv.out_types
    out_ctx, out_nbr = ctx, nbr
    if "ctx" in conv.out_types:
        # the window nodes' inter keys and values (a last layer under inter="retrieved" only
        # reads the retrieved tokens)
        senders = h["nbr"] if update_nbr or graph.inter == "window" else \
            h["nbr"][:, :, :, graph.center:graph.center + 1]
        keys, feats = _project(senders, [
            fold(_linear(conv.k_lin, "nbr"), conv.w_att["inter"]),
            fold(_linear(conv.v_lin, "nbr"), conv.w_fea["inter"])], H, D)  # [B, T, k, w', H, D]
        out_ctx = ctx_update(conv, ctx, h["ctx"], graph,
                             lambda q: _inter_attend(conv, q, keys, feats, graph))
    if update_nbr:
        out_nbr = window_update(conv, nbr, h["nbr"], graph.nbr_mask)
    return out_ctx, out_nbr


def stack_dense(stack: GNNStack, ctx: Tensor, nbr: Tensor, graph: DenseGraph
                ) -> tuple[Tensor, Tensor]:
    """``stack``'s layers in turn (``conv_dense``) on ``ctx`` [B, T, d] and ``nbr``
    [B, T, k, w, d] of ``graph``: what ``stack(x_dict, edge_index_dict)`` computes by message
    passing. Returns both after the last layer."""
    if stack.kind != "gnnlm":
        raise ValueError(f"the dense path computes GNNLMConv layers (got kind={stack.kind!r}).")
    for layer in stack.layers:
        ctx, nbr = conv_dense(cast(GNNLMConv, layer), ctx, nbr, graph)
    return ctx, nbr
