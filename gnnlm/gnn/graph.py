"""The GNN-LM graph (Meng et al. 2022, §2.2): schema and a vectorised builder.

One sample is a block of T target tokens. Its graph has two node types:

- ``ctx``: the block's tokens, in sequence order (feature = their base-LM feature);
- ``nbr``: for each target token, its top k retrieved train positions p, each widened to the
  window p−l … p+r (feature = the train feature at that position). Windows are not
  deduplicated: every (target token, retrieved p) pair owns its own nodes, as in the paper's
  Figure 1, so a train position retrieved twice appears twice.

and three edge types (PyG convention: ``edge_index[0]`` = source, ``edge_index[1]`` = target):

- ``("ctx", "intra", "ctx")``: causal j → i for j ≤ i, self loop included (a Transformer seen as
  a graph); ``GraphConfig.ctx_window = w`` keeps only i − w < j ≤ i;
- ``("nbr", "intra", "nbr")``: between nodes at adjacent offsets of one window, both directions,
  plus a self loop on every nbr node so each one receives a message in every layer;
- ``("nbr", "inter", "ctx")``: every node of a window → the ctx node that retrieved it (the
  paper's Figure 1, ``GraphConfig.inter = "window"``), or only the retrieved token, the window's
  other nodes reaching the context through it (the reference implementation,
  ``inter = "retrieved"``).

Leakage (§3.1 "Data Leakage Prevention"), for train-split graphs only (the datastore is the train
split, so a valid/test query cannot meet its own text). A feature at train position q was
computed from the C tokens before its target and predicts target q, so it has read, or is, the
target of every position t with q − C ≤ t ≤ q. Information flows nbr → ctx (inter edges) and
ctx j → ctx i for j ≤ i (causal edges), so a window node retrieved by ctx token j reaches j and,
one hop further, every later token of the block. ``build_graph(..., leakage_window=C)`` therefore
drops every window node q that has read the target t_i of any ctx token i ≥ j it can reach:
∃ i ≥ j with q − C ≤ t_i ≤ q. Retrieved tokens that fall under this rule are skipped and the
next of the K stored neighbours take their place, so a token keeps k windows when it can; window
mates that fall under it are dropped alone, and only nodes adjacent in position and both present
are joined. (With ``ctx_window`` or a single layer the reach is smaller and the rule is
conservative.) ``leakage_window=0`` masks nothing, as ``neighbors.leakage_window: 0`` does for
the neighbour files (an ablation only): the graph drops and replaces no node.

Evaluation can leave the windows out (``build_context_graph``). Edges go nbr → nbr inside one
window and nbr → ctx, never ctx → nbr, and valid/test graphs drop no node, so at evaluation a
window node's state at every layer depends only on its retrieved train position p, the node
features and the trained weights, not on the token that retrieved it. An evaluation block is
then its ctx nodes, their causal edges and the k positions each token retrieved
(``ctx.retrieved``); ``gnnlm.gnn.window_states`` computes each retrieved window once and every
token reads it from there, which equals giving every retrieval its own copy.

Datastore positions are plain node attributes (``split_pos``, ``train_pos``, ``retrieved``): no
name contains ``index`` or ``batch``, which PyG would offset when batching, nor ``pos``, which
it treats as coordinates. Building is numpy on [T, k, l+r+1] arrays: no loop per token or per
neighbour.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch_geometric.data import HeteroData

from gnnlm.gnn.settings import GraphConfig  # the settings, without torch: importable from here too

NODE_TYPES = ("ctx", "nbr")
RELATIONS = ("intra", "inter")
CTX_INTRA = ("ctx", "intra", "ctx")
NBR_INTRA = ("nbr", "intra", "nbr")
NBR_INTER = ("nbr", "inter", "ctx")
EDGE_TYPES = (CTX_INTRA, NBR_INTRA, NBR_INTER)
METADATA = (NODE_TYPES, EDGE_TYPES)  # what PyG layers take as ``metadata``


def graph_sizes(T: int, config: GraphConfig) -> dict:
    """Node and edge counts of a block of ``T`` tokens when all k neighbours are present and no
    window is clipped or excluded (an upper bound; for benchmarks and memory planning)."""
    w = T if config.ctx_window is None else min(config.ctx_window, T)
    n_nbr = T * config.k * config.width
    return {
        "ctx": T,
        "nbr": n_nbr,
        CTX_INTRA: T * w - w * (w - 1) // 2,  # target i has min(i + 1, w) sources
        NBR_INTRA: n_nbr + 2 * T * config.k * (config.width - 1),
        NBR_INTER: n_nbr if config.inter == "window" else T * config.k,
    }


def _edges(src: np.ndarray, dst: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack([src, dst]).astype(np.int64))  # [2, E]


def _causal_edges(T: int, config: GraphConfig) -> torch.Tensor:
    """The causal edges ctx → ctx: target i receives from i - d for d = 0 … w-1 (d = 0 is the
    self loop)."""
    w = T if config.ctx_window is None else min(config.ctx_window, T)
    ctx_dst = np.broadcast_to(np.arange(T)[:, None], (T, w))           # [T, w]
    ctx_src = ctx_dst - np.arange(w)[None, :]                          # [T, w]
    causal = ctx_src >= 0
    return _edges(ctx_src[causal], ctx_dst[causal])


def _block_arrays(ctx_pos, nbr_ids, n_train: int, leakage_window: Optional[int] = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``ctx_pos`` [T] and ``nbr_ids`` [T, K] as int64 arrays, refused unless the positions
    increase, the ids lie in [-1, n_train) and ``leakage_window`` is None or >= 0."""
    ctx_pos = np.asarray(ctx_pos, dtype=np.int64)
    nbr_ids = np.asarray(nbr_ids, dtype=np.int64)
    if ctx_pos.ndim != 1:
        raise ValueError(f"ctx_pos must be 1-D [T] (got shape {ctx_pos.shape}).")
    T = ctx_pos.shape[0]
    if nbr_ids.ndim != 2 or nbr_ids.shape[0] != T:
        raise ValueError(f"nbr_ids must be [T, K] with T = {T} (got shape {nbr_ids.shape}).")
    if T > 1 and np.any(np.diff(ctx_pos) <= 0):
        raise ValueError("ctx_pos must increase (the block's tokens in sequence order).")
    if nbr_ids.size and (nbr_ids.min() < -1 or nbr_ids.max() >= n_train):
        raise ValueError(f"nbr_ids must lie in [-1, n_train = {n_train}) "
                         f"(got {nbr_ids.min()} … {nbr_ids.max()}).")
    if leakage_window is not None and leakage_window < 0:
        raise ValueError(f"leakage_window must be >= 0 or None (got {leakage_window}).")
    return ctx_pos, nbr_ids


def leaky(q: np.ndarray, owner: np.ndarray, ctx_pos: np.ndarray, context: int) -> np.ndarray:
    """bool, per window node: has train position ``q`` (retrieved for ctx row ``owner``) read, or
    is it, the target of a ctx token it can reach, i.e. ∃ i ≥ owner: q − C ≤ ctx_pos[i] ≤ q.

    ``ctx_pos`` must increase; broadcasting shapes of ``q`` and ``owner`` are kept.
    """
    T = len(ctx_pos)
    # the first ctx row i ≥ owner whose target is ≥ q − C; it leaks if that target is ≤ q
    first = np.maximum(np.searchsorted(ctx_pos, q - context, side="left"), owner)
    return (first < T) & (ctx_pos[np.minimum(first, T - 1)] <= q)


def select_neighbors(nbr_ids: np.ndarray, k: int, keep: Optional[np.ndarray] = None
                     ) -> np.ndarray:
    """The first k ids of each row [T, K] that exist and are kept (-1 padded), order preserved."""
    ok = nbr_ids >= 0
    if keep is not None:
        ok &= keep
    order = np.argsort(~ok, axis=1, kind="stable")[:, :k]               # kept ones first
    chosen = np.take_along_axis(nbr_ids, order, axis=1)
    chosen[~np.take_along_axis(ok, order, axis=1)] = -1
    if chosen.shape[1] < k:
        chosen = np.pad(chosen, ((0, 0), (0, k - chosen.shape[1])), constant_values=-1)
    return chosen


def _windows(ctx_pos: np.ndarray, nbr_ids: np.ndarray, k: int, C: int) -> tuple[np.ndarray, int]:
    """The k windows per token [T, k] (-1 padded): retrieved tokens that leak (``C`` > 0) are
    skipped for the next stored neighbours. Also how many of the first k the rule replaced."""
    if not C:
        return select_neighbors(nbr_ids, k), 0
    rows = np.arange(len(ctx_pos))[:, None]
    usable = ~leaky(nbr_ids, np.broadcast_to(rows, nbr_ids.shape), ctx_pos, C)
    unmasked = select_neighbors(nbr_ids, k)
    windows_masked = int(((unmasked >= 0) & leaky(
        unmasked, np.broadcast_to(rows, unmasked.shape), ctx_pos, C)).sum())
    return select_neighbors(nbr_ids, k, usable), windows_masked


def build_graph(ctx_pos, nbr_ids, n_train: int, config: GraphConfig,
                leakage_window: Optional[int] = None) -> HeteroData:
    """The graph of one block of T target tokens.

    Args:
        ctx_pos: int [T], split positions of the block's target tokens, increasing (causal
            edges follow this row order; gaps between positions are allowed).
        nbr_ids: int [T, K], retrieved train positions, best first, -1 = none. The first
            ``config.k`` usable ones are used.
        n_train: train datastore size; windows are clipped to [0, n_train).
        config: window sizes, k, the ctx window and the inter edges.
        leakage_window: C for train-split graphs (the context length the features were
            computed with): drop every node that has read a reachable ctx token's target (see
            the module docstring). None for valid/test graphs; 0 (the no-masking ablation)
            masks nothing either.

    Node attributes (all int64): ``ctx.split_pos`` [T]; ``nbr.train_pos``, ``nbr.offset``
    (−l … r, 0 = the retrieved token), ``nbr.rank`` (0 … k−1, the window's slot) and
    ``nbr.owner_local`` (the ctx row that retrieved it), each [n_nbr]. ``owner_local`` is per
    graph: PyG does not offset it when batching; after batching use ``ctx.batch`` and
    ``nbr.batch``. The graph also carries ``windows_masked`` (retrieved tokens the leakage rule
    replaced by later neighbours), ``nodes_masked`` (window mates it dropped) and
    ``layout_size``, the block's extent in the dense layout (``gnnlm.gnn.dense``): (T, the
    highest window slot used + 1), as Python ints, which PyG batches into a list that stays on
    the host.
    """
    ctx_pos, nbr_ids = _block_arrays(ctx_pos, nbr_ids, n_train, leakage_window)
    T = ctx_pos.shape[0]
    # None (valid/test) and 0 (neighbors.leakage_window: 0, the no-masking ablation) mask
    # nothing: 0 is not a rule with C = 0, which would still drop every reachable target
    C = leakage_window or 0
    rows = np.arange(T)[:, None]
    ids, windows_masked = _windows(ctx_pos, nbr_ids, config.k, C)      # [T, k]

    # neighbour windows, laid out [T, k, width]: node ids follow this row-major order
    offsets = np.arange(-config.left, config.right + 1)                # [width]
    q = ids[:, :, None] + offsets                                      # [T, k, width]
    keep = (ids[:, :, None] >= 0) & (q >= 0) & (q < n_train)           # [T, k, width]
    nodes_masked = 0
    if C:
        masked = keep & leaky(q, rows[:, :, None], ctx_pos, C)
        nodes_masked = int(masked.sum())
        keep &= ~masked
    node = (np.cumsum(keep) - 1).reshape(keep.shape)                   # [T, k, width]
    owner, rank, slot = np.nonzero(keep)                               # each [n_nbr]
    n_nbr = owner.shape[0]

    # adjacent slots of one window are adjacent train positions: join those both kept
    pair = keep[..., :-1] & keep[..., 1:]                              # [T, k, width-1]
    left_node = node[..., :-1][pair]                                   # [n_pairs]
    right_node = node[..., 1:][pair]                                   # [n_pairs]
    loops = np.arange(n_nbr)
    inter = loops if config.inter == "window" else loops[offsets[slot] == 0]

    data = HeteroData()
    data["ctx"].num_nodes = T
    data["ctx"].split_pos = torch.from_numpy(ctx_pos.copy())
    data["nbr"].num_nodes = n_nbr
    data["nbr"].train_pos = torch.from_numpy(q[keep])
    data["nbr"].offset = torch.from_numpy(offsets[slot])
    data["nbr"].rank = torch.from_numpy(rank.astype(np.int64))
    data["nbr"].owner_local = torch.from_numpy(owner.astype(np.int64))
    data[CTX_INTRA].edge_index = _causal_edges(T, config)
    data[NBR_INTRA].edge_index = _edges(np.concatenate([loops, left_node, right_node]),
                                        np.concatenate([loops, right_node, left_node]))
    data[NBR_INTER].edge_index = _edges(inter, owner[inter])
    # leakage statistics: retrieved tokens replaced by later neighbours, window mates dropped
    data.windows_masked = windows_masked
    data.nodes_masked = nodes_masked
    data.layout_size = (T, int(rank.max()) + 1 if n_nbr else 1)
    return data


def build_context_graph(ctx_pos, nbr_ids, n_train: int, config: GraphConfig) -> HeteroData:
    """An evaluation block without its windows: the ctx nodes, their causal edges, and in
    ``ctx.retrieved`` [T, k] the first ``config.k`` retrieved train positions of each token
    (-1 = none), whose windows ``gnnlm.gnn.window_states`` supplies. The ``nbr`` node type is
    present and empty, so batches keep ``build_graph``'s schema. Arguments as ``build_graph``
    (no leakage rule: evaluation graphs only)."""
    ctx_pos, nbr_ids = _block_arrays(ctx_pos, nbr_ids, n_train)
    T = ctx_pos.shape[0]
    data = HeteroData()
    data["ctx"].num_nodes = T
    data["ctx"].split_pos = torch.from_numpy(ctx_pos.copy())
    data["ctx"].retrieved = torch.from_numpy(select_neighbors(nbr_ids, config.k))  # [T, k]
    data["nbr"].num_nodes = 0
    data[CTX_INTRA].edge_index = _causal_edges(T, config)
    data.layout_size = (T, 0)                                          # no window slots
    return data
