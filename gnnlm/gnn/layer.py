"""GNN layers on the retrieval graph (``gnnlm.gnn.graph``): the GNN-LM layer, an HGT baseline,
the stack.

``GNNLMConv`` is the self-attention augmented layer of GNN-LM (Meng et al. 2022, §2.3, eq. 1–4),
an HGT-style layer (Hu et al. 2020) whose relation matrices are shared by relation (``intra``,
``inter``) rather than by full edge type, with a plain residual. It is the reference
implementation, by message passing over any graph; ``gnnlm.gnn.dense`` computes the same layer on
the retrieval graph's regular layout, far faster. ``HGTLayer`` wraps PyG's ``HGTConv`` behind the
same call so the two can be compared. ``GNNStack`` applies either in turn.

Two options follow the reference implementation (ShannonAI/GNN-LM) rather than the paper's
equations: ``edge_aggr="mean"`` averages the messages of the edge types that reach a node instead
of summing them, and ``norm="post"`` adds a LayerNorm after each layer's residual.

Every layer maps ``x_dict`` to a dict with the same node types and shapes: node types that
receive no edge (or have no nodes) keep their representation, so a stack never loses a type.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch_geometric.nn import HGTConv, MessagePassing
from torch_geometric.typing import EdgeType, Metadata, NodeType
from torch_geometric.utils import softmax


def _check_sizes(channels: int, heads: int, dropout: float) -> None:
    if channels <= 0 or heads <= 0 or channels % heads:
        raise ValueError(f"channels must be a positive multiple of heads "
                         f"(got channels={channels}, heads={heads}).")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1) (got {dropout}).")


def _check_options(norm: str, edge_aggr: str) -> None:
    if norm not in ("none", "pre", "post"):
        raise ValueError(f"norm must be 'none', 'pre' or 'post' (got {norm!r}).")
    if edge_aggr not in ("sum", "mean"):
        raise ValueError(f"edge_aggr must be 'sum' or 'mean' (got {edge_aggr!r}).")


def _check_inputs(metadata: Metadata, x_dict: dict[NodeType, Tensor],
                  edge_index_dict: dict[EdgeType, Tensor]) -> None:
    """Refuse node and edge types the layer has no parameters for."""
    node_types, edge_types = metadata
    for node_type in x_dict:
        if node_type not in node_types:
            raise ValueError(f"Unknown node type {node_type!r}; the layer was built for "
                             f"{list(node_types)} (got {node_type!r}).")
    for edge_type in edge_index_dict:
        if tuple(edge_type) not in edge_types:
            raise ValueError(f"Unknown edge type {edge_type!r}; the layer was built for "
                             f"{list(edge_types)} (got {edge_type!r}).")
        if edge_type[0] not in x_dict or edge_type[2] not in x_dict:
            raise ValueError(f"Edge type {edge_type!r} needs features for both its node types "
                             f"(got x_dict with {list(x_dict)}).")


class GNNLMConv(MessagePassing):
    r"""One GNN-LM layer (Meng et al. 2022, eq. 1–4; after Hu et al. 2020, "Heterogeneous Graph
    Transformer").

    For an edge (s, e, n) from source s to target n, per head (d_h = channels / heads):

    .. math::
        K(s) = W^k_{\tau(s)} h_s, \quad Q(n) = W^q_{\tau(n)} h_n                        \\
        \mathrm{Att}(s, e, n) = \mathrm{softmax}_{s' \in N_{\phi(e)}(n)}
            \big(K(s)\, W^{ATT}_{\phi(e)}\, Q(n)^\top \cdot \mu(\tau(s), \phi(e), \tau(n))
            / \sqrt{d_h}\big)                                                   \quad (2) \\
        \mathrm{Feat}(s, e, n) = W^v_{\tau(s)} h_s\, W^{FEA}_{\phi(e)}          \quad (3) \\
        h_n' = W^o_{\tau(n)} \textstyle\bigoplus_{(s, e)} \mathrm{Att} \cdot \mathrm{Feat}
            + h_n                                                       \quad (4), (1)

    The softmax runs over the incoming edges of one edge type (eq. 2's Z); messages are summed
    over edge types (``edge_aggr="sum"``, eq. 4's ⊕) or averaged over the edge types that reach
    the node (``"mean"``). τ is the node type, φ(e) the relation (``intra``/``inter``): W^ATT and
    W^FEA are shared by ``("ctx","intra","ctx")`` and ``("nbr","intra","nbr")``, while the prior
    μ has one value per head for each (source type, relation, target type).

    Shapes: ``x_dict[t]`` [N_t, channels] → the same; ``edge_index_dict[(s, rel, n)]``
    [2, E] with row 0 the source and row 1 the target.

    Args:
        channels: feature size d of every node type (input = output, for the residual).
        metadata: ``(node_types, edge_types)``, e.g. ``gnnlm.gnn.graph.METADATA``.
        heads: attention heads; must divide ``channels``.
        dropout: on the attention weights and on the layer's update before the residual.
        norm: ``"none"`` (the paper's eq. 1); ``"pre"``, a LayerNorm per node type on the inputs
            to W^q, W^k, W^v, the residual adding the raw input, so the stream that reaches the
            frozen output embedding is never normalised by the GNN (and a zero update is still
            the identity); ``"post"``, a LayerNorm per node type after the residual (the
            reference implementation; the layer is then not the identity at initialisation).
        edge_aggr: ``"sum"`` or ``"mean"`` over edge types (see above).
        zero_init_output: start W^o (weight and bias) at zero, so the layer — and a stack of
            them — is exactly the identity at initialisation (without ``norm="post"``) and a
            GNN-LM starts at the base LM's distribution instead of a random perturbation of it.
            W^o receives gradient at once; the other weights do from the first step that
            moves W^o.
    """

    def __init__(self, channels: int, metadata: Metadata, heads: int = 4, dropout: float = 0.0,
                 norm: str = "none", edge_aggr: str = "sum", zero_init_output: bool = True,
                 out_types: Optional[Sequence[NodeType]] = None):
        super().__init__(aggr="add", node_dim=0)
        _check_sizes(channels, heads, dropout)
        _check_options(norm, edge_aggr)
        self.norm_mode, self.edge_aggr = norm, edge_aggr
        node_types, edge_types = metadata
        self.channels, self.heads, self.head_dim = channels, heads, channels // heads
        self.dropout, self.zero_init_output = dropout, zero_init_output
        self.metadata = (tuple(node_types), tuple(tuple(e) for e in edge_types))
        # out_types: the node types this layer updates (a last layer read out at ``ctx`` has no
        # parameters, and does no work, for targets nobody reads); the others pass through.
        self.out_types = tuple(node_types if out_types is None else out_types)
        if not set(self.out_types) <= set(node_types):
            raise ValueError(f"out_types must be node types of the metadata {list(node_types)} "
                             f"(got {list(self.out_types)}).")
        self.edge_types = tuple(e for e in self.metadata[1] if e[2] in self.out_types)
        sources = sorted({e[0] for e in self.edge_types})
        relations = sorted({rel for _, rel, _ in self.edge_types})

        def per_node_type(types, bias: bool = True) -> nn.ModuleDict:
            return nn.ModuleDict({t: nn.Linear(channels, channels, bias=bias) for t in types})

        self.q_lin = per_node_type(self.out_types)
        # a key bias adds the same score to every edge into a target: the softmax cancels it
        self.k_lin = per_node_type(sources, bias=False)
        self.v_lin = per_node_type(sources)
        self.o_lin = per_node_type(self.out_types)
        norm_types = node_types if norm == "pre" else self.out_types
        self.norm = nn.ModuleDict({t: nn.LayerNorm(channels) for t in norm_types}) \
            if norm != "none" else None
        shape = (heads, self.head_dim, self.head_dim)
        self.w_att = nn.ParameterDict({rel: nn.Parameter(torch.empty(shape)) for rel in relations})
        self.w_fea = nn.ParameterDict({rel: nn.Parameter(torch.empty(shape)) for rel in relations})
        self.mu = nn.ParameterDict({"__".join(e): nn.Parameter(torch.empty(heads))
                                    for e in self.edge_types})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for lins in (self.q_lin, self.k_lin, self.v_lin, self.o_lin):
            for lin in lins.values():
                cast(nn.Linear, lin).reset_parameters()
        if self.zero_init_output:
            for lin in self.o_lin.values():
                nn.init.zeros_(cast(nn.Linear, lin).weight)
                nn.init.zeros_(cast(nn.Linear, lin).bias)
        if self.norm is not None:
            for norm in self.norm.values():
                cast(nn.LayerNorm, norm).reset_parameters()
        # identity relation maps and μ = 1: attention starts as plain scaled dot-product per head
        eye = torch.eye(self.head_dim)
        with torch.no_grad():
            for p in (*self.w_att.values(), *self.w_fea.values()):
                p.copy_(eye.expand_as(p))
        for p in self.mu.values():
            nn.init.ones_(p)

    def forward(self, x_dict: dict[NodeType, Tensor],
                edge_index_dict: dict[EdgeType, Tensor]) -> dict[NodeType, Tensor]:
        _check_inputs(self.metadata, x_dict, edge_index_dict)
        H, D = self.heads, self.head_dim
        targets = set(self.out_types) & set(x_dict)
        edges = {e: ei for e, ei in edge_index_dict.items() if e[2] in targets}
        sources = {e[0] for e in edges}
        h = self.pre_norm(x_dict)
        q = {t: self.q_lin[t](h[t]).view(-1, H, D) for t in targets}    # [N_t, H, D]
        k = {t: self.k_lin[t](h[t]).view(-1, H, D) for t in sources}
        v = {t: self.v_lin[t](h[t]).view(-1, H, D) for t in sources}
        agg = {t: x_dict[t].new_zeros(x_dict[t].shape[0], H, D) for t in targets}
        reached = {t: x_dict[t].new_zeros(x_dict[t].shape[0]) for t in targets}  # edge types

        for edge_type, edge_index in edges.items():
            src, rel, dst = edge_type
            key = torch.einsum("nhd,hde->nhe", k[src], self.w_att[rel])  # K(s) W^ATT [N_s, H, D]
            feat = torch.einsum("nhd,hde->nhe", v[src], self.w_fea[rel])  # eq. 3 [N_s, H, D]
            agg[dst] = agg[dst] + self.propagate(
                edge_index, key=key, query=q[dst], feat=feat, mu=self.mu["__".join(edge_type)],
                size=(key.shape[0], q[dst].shape[0]))                      # [N_dst, H, D]
            hit = torch.zeros_like(reached[dst], dtype=torch.bool)
            hit[edge_index[1]] = True
            reached[dst] = reached[dst] + hit

        out = dict(x_dict)
        for t in targets:
            if self.edge_aggr == "mean":
                agg[t] = agg[t] / reached[t].clamp(min=1)[:, None, None]
            update = self.o_lin[t](agg[t].reshape(-1, self.channels))      # eq. 4 [N_t, d]
            out[t] = self.residual(t, x_dict[t], update)                   # eq. 1
        return out

    def pre_norm(self, x_dict: dict[NodeType, Tensor]) -> dict[NodeType, Tensor]:
        """The inputs of W^q, W^k, W^v: normalised with ``norm="pre"``, else as given."""
        if self.norm is None or self.norm_mode != "pre":
            return x_dict
        return {t: self.norm[t](x) for t, x in x_dict.items()}

    def residual(self, node_type: NodeType, x: Tensor, update: Tensor) -> Tensor:
        """Eq. 1: h + dropout(update), then the post-norm when asked for."""
        out = x + F.dropout(update, self.dropout, self.training)
        if self.norm is not None and self.norm_mode == "post":
            out = self.norm[node_type](out)
        return out

    def message(self, key_j: Tensor, query_i: Tensor, feat_j: Tensor, mu: Tensor, index: Tensor,
                ptr: Optional[Tensor], size_i: Optional[int]) -> Tensor:
        score = (key_j * query_i).sum(-1) * mu / math.sqrt(self.head_dim)  # [E, H]
        att = softmax(score, index, ptr, size_i)                           # eq. 2, per target
        att = F.dropout(att, self.dropout, self.training)
        return feat_j * att.unsqueeze(-1)                                  # [E, H, D]

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.channels}, heads={self.heads})"


class HGTLayer(nn.Module):
    """PyG's ``HGTConv`` (Hu et al. 2020) with GNNLMConv's call and guarantees.

    ``HGTConv`` returns α·A + (1−α)·h for the node types that receive edges (its own gated
    skip, α = σ(skip)) and leaves the others out of its output. This wrapper adds the
    conv's update, ``HGTConv(h) − h``, to the raw input x: without ``layer_norm`` and dropout
    that is exactly HGTConv's output, node types it leaves out are carried forward unchanged,
    and with ``layer_norm`` the residual stream stays un-normalised as in ``GNNLMConv``.
    HGTConv's skip cannot start at the identity, so there is no ``zero_init_output`` here.
    """

    def __init__(self, channels: int, metadata: Metadata, heads: int = 4, dropout: float = 0.0,
                 layer_norm: bool = False):
        super().__init__()
        _check_sizes(channels, heads, dropout)
        node_types, edge_types = metadata
        self.metadata = (tuple(node_types), tuple(tuple(e) for e in edge_types))
        self.conv = HGTConv(channels, channels, (list(node_types), list(self.metadata[1])),
                            heads=heads)
        self.norm = nn.ModuleDict({t: nn.LayerNorm(channels) for t in node_types}) \
            if layer_norm else None
        self.dropout = dropout

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()
        if self.norm is not None:
            for norm in self.norm.values():
                cast(nn.LayerNorm, norm).reset_parameters()

    def forward(self, x_dict: dict[NodeType, Tensor],
                edge_index_dict: dict[EdgeType, Tensor]) -> dict[NodeType, Tensor]:
        _check_inputs(self.metadata, x_dict, edge_index_dict)
        h = {t: self.norm[t](x) for t, x in x_dict.items()} if self.norm is not None else x_dict
        conv_out = self.conv(h, edge_index_dict)
        out = {}
        for t, x in x_dict.items():
            new = conv_out.get(t)
            if new is None:  # no incoming edges: HGTConv dropped the type
                out[t] = x
            else:
                out[t] = x + F.dropout(new - h[t], self.dropout, self.training)
        return out


class GNNStack(nn.Module):
    """``num_layers`` GNN layers applied in turn (paper: 3 layers); ``kind`` picks the layer:
    ``"gnnlm"`` (``GNNLMConv``, eq. 1–4) or ``"hgt"`` (PyG ``HGTConv`` via ``HGTLayer``;
    ``zero_init_output`` does not apply to it).

    ``readout``: the node types read after the stack (GNN-LM: ``("ctx",)``). The last GNNLMConv
    then updates only those, so it has no parameter that the loss does not reach (which DDP
    requires) and skips the work on ``nbr`` targets. HGTConv always updates every type: under
    DDP use ``strategy=ddp_find_unused_parameters_true`` with ``kind="hgt"``. ``norm`` and
    ``edge_aggr`` are GNNLMConv's (HGTLayer takes ``norm="pre"`` or ``"none"``, and sums).

    ``forward`` passes messages over any ``edge_index_dict``; ``gnnlm.gnn.dense.stack_dense``
    computes the same stack on the graphs' regular layout (``kind="gnnlm"`` only).
    """

    def __init__(self, channels: int, metadata: Metadata, num_layers: int = 3, heads: int = 4,
                 dropout: float = 0.0, norm: str = "none", edge_aggr: str = "sum",
                 kind: str = "gnnlm", zero_init_output: bool = True,
                 readout: Optional[Sequence[NodeType]] = None):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1 (got {num_layers}).")
        if kind not in ("gnnlm", "hgt"):
            raise ValueError(f"kind must be 'gnnlm' or 'hgt' (got {kind!r}).")
        _check_options(norm, edge_aggr)
        if kind == "hgt" and (norm == "post" or edge_aggr == "mean"):
            raise ValueError(f"kind='hgt' (PyG HGTConv) sums edge types and takes norm 'none' or "
                             f"'pre' (got norm={norm!r}, edge_aggr={edge_aggr!r}).")
        self.kind = kind
        self.layers = nn.ModuleList(
            GNNLMConv(channels, metadata, heads, dropout, norm, edge_aggr, zero_init_output,
                      out_types=readout if i == num_layers - 1 else None)
            if kind == "gnnlm" else HGTLayer(channels, metadata, heads, dropout, norm == "pre")
            for i in range(num_layers))

    def reset_parameters(self) -> None:
        for layer in self.layers:
            cast(GNNLMConv | HGTLayer, layer).reset_parameters()

    def forward(self, x_dict: dict[NodeType, Tensor],
                edge_index_dict: dict[EdgeType, Tensor]) -> dict[NodeType, Tensor]:
        for layer in self.layers:
            x_dict = layer(x_dict, edge_index_dict)
        return x_dict
