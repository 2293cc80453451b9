"""GNN-LM on the retrieval graph's regular layout: the same layer as ``GNNLMConv``, as dense ops.

A batch of B graphs (blocks of T target tokens, each with k windows of w = l + 1 + r train
positions) has a regular shape, so the message passing of ``GNNLMConv`` (gnnlm/gnn_layer.py) is
a handful of batched tensor operations on ``ctx`` [B, T, d] and ``nbr`` [B, T, k, w, d]:

- ctx ← ctx (causal edges): masked scaled dot-product attention over the block, per head, with
  the prior μ folded into the query scale;
- ctx ← nbr (inter edges): attention of each token over its own k·w window nodes (or its k
  retrieved tokens, ``inter="retrieved"``);
- nbr ← nbr (intra edges): attention of each window node over itself and its two neighbours in
  the window, as three shifted copies.

Absent nodes (clipped windows, fewer than k neighbours, nodes dropped for leakage, the padding
of a short last block) are masked out of every softmax, so the result equals ``GNNLMConv`` on
the HeteroData the dense layout came from (``to_dense``), to float tolerance. The parameters are
those of the ``GNNLMConv`` layers: one module, two ways to run it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.gnn_layer import GNNLMConv
from gnnlm.graph import CTX_INTRA, NBR_INTER, NBR_INTRA, GraphConfig


@dataclass
class DenseGraph:
    """The structure of a batch of retrieval graphs in their regular layout."""
    ctx_mask: Tensor                 # [B, T] bool: the token exists
    nbr_mask: Tensor                 # [B, T, k, w] bool: the window node exists
    center: int                      # the retrieved token's slot in a window (= l)
    inter: str = "window"            # which window nodes send to the context
    ctx_window: Optional[int] = None  # causal edges only from the last ``ctx_window`` tokens

    def causal_mask(self) -> Tensor:
        """[B, 1, T, T] bool: token i reads token j ≤ i (within the ctx window) that exists."""
        T = self.ctx_mask.shape[1]
        i = torch.arange(T, device=self.ctx_mask.device)
        allowed = i[None, :] <= i[:, None]
        if self.ctx_window is not None:
            allowed &= i[:, None] - i[None, :] < self.ctx_window
        return allowed[None, None] & self.ctx_mask[:, None, None, :]


def to_dense(batch, config: GraphConfig, x_key: str = "x") -> tuple[Tensor, Tensor, DenseGraph]:
    """A (batched) HeteroData from ``gnnlm.graph.build_graph`` in the regular layout:
    ``(ctx [B, T, d], nbr [B, T, k, w, d], DenseGraph)``. Node features are ``x_key``. The window
    sizes, inter edges and ctx window are ``config``'s; k is the batch's (``nbr.rank`` + 1), so
    one config serves every step of a k curriculum."""
    ctx_store, nbr_store = batch["ctx"], batch["nbr"]
    ctx_x, nbr_x = ctx_store[x_key], nbr_store[x_key]
    n_ctx, d = ctx_x.shape
    device = ctx_x.device
    ctx_graph = getattr(ctx_store, "batch", None)
    if ctx_graph is None:  # a single graph
        ctx_graph = torch.zeros(n_ctx, dtype=torch.long, device=device)
        nbr_graph = torch.zeros(nbr_x.shape[0], dtype=torch.long, device=device)
    else:
        nbr_graph = nbr_store.batch
    B = int(ctx_graph.max()) + 1 if n_ctx else 1
    counts = torch.bincount(ctx_graph, minlength=B)                      # [B]
    starts = torch.cumsum(counts, 0) - counts
    T = int(counts.max()) if n_ctx else 0
    local = torch.arange(n_ctx, device=device) - starts[ctx_graph]       # [n_ctx]
    w = config.left + config.right + 1
    ctx = ctx_x.new_zeros(B, T, d)
    ctx[ctx_graph, local] = ctx_x
    ctx_mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    ctx_mask[ctx_graph, local] = True
    k = int(nbr_store.rank.max()) + 1 if nbr_x.shape[0] else 1
    nbr = nbr_x.new_zeros(B, T, k, w, d)
    nbr_mask = torch.zeros(B, T, k, w, dtype=torch.bool, device=device)
    slot = (nbr_graph, nbr_store.owner_local, nbr_store.rank, nbr_store.offset + config.left)
    nbr[slot] = nbr_x
    nbr_mask[slot] = True
    return ctx, nbr, DenseGraph(ctx_mask, nbr_mask, config.left, config.inter,
                                config.ctx_window)


def _linear(modules: nn.ModuleDict, node_type: str) -> nn.Linear:
    return cast(nn.Linear, modules[node_type])


def _fold(lin: nn.Linear, relation: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """W^k followed by the head-wise W^ATT (or W^v by W^FEA) as one [d, d] linear map, so that
    ``F.linear(h, *_fold(W^k, W^ATT))`` is K(s) W^ATT of eq. 2 (and likewise eq. 3)."""
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


def conv_dense(conv: GNNLMConv, ctx: Tensor, nbr: Tensor, graph: DenseGraph
               ) -> tuple[Tensor, Tensor]:
    """One ``GNNLMConv`` (eq. 1–4) on the dense layout: ``(ctx', nbr')``. ``nbr`` passes
    through unchanged when the layer does not update it (a last layer read out at ``ctx``)."""
    H, D, d = conv.heads, conv.head_dim, conv.channels
    B, T = ctx.shape[:2]
    k, w = nbr.shape[2:4]
    h = conv.pre_norm({"ctx": ctx, "nbr": nbr})
    root = math.sqrt(D)
    update_nbr = "nbr" in conv.out_types
    out_ctx, out_nbr = ctx, nbr

    # window nodes: their keys and values for each relation they send on, and their queries
    maps = [_fold(_linear(conv.k_lin, "nbr"), conv.w_att["inter"]),
            _fold(_linear(conv.v_lin, "nbr"), conv.w_fea["inter"])]
    if update_nbr:
        maps += [_fold(_linear(conv.k_lin, "nbr"), conv.w_att["intra"]),
                 _fold(_linear(conv.v_lin, "nbr"), conv.w_fea["intra"]),
                 (_linear(conv.q_lin, "nbr").weight, _linear(conv.q_lin, "nbr").bias)]
    # a last layer under inter="retrieved" only reads the retrieved tokens
    senders = h["nbr"] if update_nbr or graph.inter == "window" else \
        h["nbr"][:, :, :, graph.center:graph.center + 1]
    projected = _project(senders, maps, H, D)                   # each [B, T, k, w or 1, H, D]

    if "ctx" in conv.out_types:
        q, key, feat = _project(h["ctx"], [
            (_linear(conv.q_lin, "ctx").weight, _linear(conv.q_lin, "ctx").bias),
            _fold(_linear(conv.k_lin, "ctx"), conv.w_att["intra"]),
            _fold(_linear(conv.v_lin, "ctx"), conv.w_fea["intra"])], H, D)  # each [B, T, H, D]
        # ctx ← ctx: causal attention; μ/√d folded into the query, per head
        scale = (conv.mu["__".join(CTX_INTRA)] / root)[None, :, None, None]
        causal = F.scaled_dot_product_attention(
            q.transpose(1, 2) * scale, key.transpose(1, 2), feat.transpose(1, 2),
            attn_mask=graph.causal_mask(), dropout_p=conv.dropout if conv.training else 0.0,
            scale=1.0).transpose(1, 2)                                      # [B, T, H, D]
        # ctx ← nbr: each token over its own window nodes (or retrieved tokens)
        keys, feats = projected[0], projected[1]
        if graph.inter == "retrieved":
            c = graph.center if keys.shape[3] == w else 0
            keys, feats = keys[:, :, :, c], feats[:, :, :, c]               # [B, T, k, H, D]
            mask = graph.nbr_mask[:, :, :, graph.center]                    # [B, T, k]
        else:
            keys, feats = keys.reshape(B, T, k * w, H, D), feats.reshape(B, T, k * w, H, D)
            mask = graph.nbr_mask.reshape(B, T, k * w)
        scores = (keys * q[:, :, None]).sum(-1) * (conv.mu["__".join(NBR_INTER)] / root)
        inter = _softmax_attend(scores, mask, feats, conv.dropout, conv.training)
        agg = causal + inter
        if conv.edge_aggr == "mean":  # the self loop always reaches a token
            agg = agg / (1.0 + mask.any(dim=-1).to(agg.dtype))[..., None, None]
        update = conv.o_lin["ctx"](agg.reshape(B, T, d))                   # eq. 4
        out_ctx = conv.residual("ctx", ctx, update)                         # eq. 1

    if update_nbr:
        # nbr ← nbr: each window node over its left neighbour, itself and its right neighbour
        key, feat, q = projected[2:]                                        # [B, T, k, w, H, D]
        pad = (0, 0, 0, 0, 1, 1)  # one empty slot on each side of the window axis
        key, feat = F.pad(key, pad), F.pad(feat, pad)                       # [B, T, k, w+2, H, D]
        present = F.pad(graph.nbr_mask, (1, 1))                             # [B, T, k, w+2]
        scale = conv.mu["__".join(NBR_INTRA)] / root
        scores = torch.stack([(q * key[:, :, :, s:s + w]).sum(-1) * scale
                              for s in range(3)], dim=-2)                   # [B, T, k, w, 3, H]
        mask = torch.stack([present[..., s:s + w] for s in range(3)], dim=-1)
        mask = mask & graph.nbr_mask[..., None]                             # [B, T, k, w, 3]
        agg = _softmax_attend(scores, mask, [feat[:, :, :, s:s + w] for s in range(3)],
                              conv.dropout, conv.training)                  # [B, T, k, w, H, D]
        update = conv.o_lin["nbr"](agg.reshape(B, T, k, w, d))
        out_nbr = conv.residual("nbr", nbr, update)
    return out_ctx, out_nbr
