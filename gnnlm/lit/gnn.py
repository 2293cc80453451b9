"""GNN-LM (Meng et al. 2022): a GNN over the retrieval graph, read out by the frozen softmax.

The ``ctx`` node of the token before w_t, after ``num_layers`` (paper: 3) HGT-style layers over
the graph of context and neighbour tokens, goes through the base LM's frozen output embedding:
p(w_t | c_t) = softmax(W h_ctx + b) (§2.3, last sentence). The output embedding comes from the
datastore (``features/output_embedding``) and is a non-persistent buffer, so it stays out of
checkpoints; ``attach_output_embedding`` sets it when the module is used outside a Trainer.

``impl="dense"`` runs the layers on the graphs' regular layout (``gnnlm.gnn.dense``), ``"pyg"``
by message passing over the edges (``GNNLMConv.forward``); both compute the same function with
the same weights. The window sizes, inter edges and ctx window of that layout are ``graph_layout``,
the data module's ``graph`` without its k (``GraphLayout``), which ``gnnlm fit`` links into the
model: k has one owner, the data module, and the model reads it from each batch.

The data module's graphs name each window node by its train position (``nbr.train_pos``); the
model reads their features on its own device (``gnnlm.gnn.node_features``: on a GPU from the PQ
codes or features resident there), so a batch moved to the GPU carries 8 bytes per window node
instead of its float32 feature. Evaluation blocks that name their windows by position
(``ctx.retrieved``, the data module's ``eval_windows="once"``) are read through
``gnnlm.gnn.window_states.WindowStates``: each retrieved window is computed once, for every token
and every evaluation that retrieves it while the weights stay the same. The node features are
attached with ``attach_node_features`` (``gnnlm.lit.datastore.AttachDatastore`` in a ``gnnlm``
command).
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from torch.nn import functional as F

from gnnlm.gnn.dense import stack_dense, to_dense
from gnnlm.gnn.graph import METADATA, GraphConfig
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.node_features import HostFeatures, NodeFeatureReader
from gnnlm.gnn.settings import GraphLayout
from gnnlm.gnn.window_states import WindowStates
from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.settings import OptimConfig
from gnnlm.models.base import float32
from gnnlm.utils.metrics import target_nll


class GNNLM(TokenLevelModule):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, num_layers: int = 3,
                 heads: int = 4, dropout: float = 0.1,
                 norm: Literal["none", "pre", "post"] = "none",
                 edge_aggr: Literal["sum", "mean"] = "sum",
                 kind: Literal["gnnlm", "hgt"] = "gnnlm", impl: Literal["dense", "pyg"] = "dense",
                 zero_init_output: bool = True,
                 optim: OptimConfig = OptimConfig(lr=5e-4, weight_decay=0.01),
                 max_windows: Optional[int] = None,
                 graph_layout: Optional[GraphLayout] = None):
        """GNN-LM over the retrieval graph, read out by the base LM's frozen softmax.

        Args:
            vocab_size: the base LM's vocabulary size (linked from the data module).
            feature_dim: the base LM's hidden size d (linked from the data module).
            num_layers: GNN layers (the paper: 3).
            heads: attention heads per layer.
            dropout: dropout probability in training.
            norm: the paper's equations (``none``), a LayerNorm on each layer's inputs
                (``pre``), or the reference implementation's after each residual (``post``).
            edge_aggr: messages summed over edge types (the paper's ``sum``) or averaged
                (the reference implementation's ``mean``).
            kind: GNN-LM layers (``gnnlm``) or the HGT baseline (``hgt``, ``impl='pyg'`` only).
            impl: run on the graphs' regular layout (``dense``) or by message passing (``pyg``).
            zero_init_output: start each layer's W^o at zero: the stack is then the identity and
                the model starts as the base LM (without ``norm='post'``).
            optim: AdamW and its warmup + cosine schedule.
            max_windows: the most retrieved windows whose states evaluation keeps (None: one
                per train position; see ``gnnlm.gnn.window_states``).
            graph_layout: the graphs' window sizes, inter edges and ctx window (linked from the
                data module's ``graph_layout``; the dense path and evaluation windows need it;
                a ``GraphConfig`` is taken without its k). Not named ``graph``: Lightning
                refuses a hyper-parameter the model and the data module both hold, in
                different forms.
        """
        super().__init__()
        if feature_dim <= 0:
            raise ValueError(f"feature_dim must be the base LM's hidden size (got {feature_dim}).")
        if impl == "dense" and kind != "gnnlm":
            raise ValueError(f"impl='dense' computes GNN-LM layers; use impl='pyg' with "
                             f"kind={kind!r}.")
        self.save_hyperparameters()
        self.vocab_size, self.feature_dim = vocab_size, feature_dim
        self.impl, self.max_windows = impl, max_windows
        self.optim = OptimConfig.of(optim)
        self.gnn = GNNStack(feature_dim, METADATA, num_layers=num_layers, heads=heads,
                            dropout=dropout, norm=norm, edge_aggr=edge_aggr, kind=kind,
                            zero_init_output=zero_init_output, readout=("ctx",))
        # a GraphConfig here (tests, or the data module's graph set by hand) reads as its layout
        self.graph: Optional[GraphLayout | GraphConfig] = (
            None if graph_layout is None else GraphLayout.of(graph_layout))
        self._node_features: Optional[tuple[NodeFeatureReader, int]] = None
        self._window_states: Optional[WindowStates] = None

    @property
    def has_node_features(self) -> bool:
        return self._node_features is not None

    def attach_node_features(self, node_features: HostFeatures, n_train: int) -> None:
        """The train node features (positions → float32 [n, d]: ``gnnlm.gnn.pq.PQFeatures``,
        ``RawFeatures`` or any such function) and the train split's size: window nodes given by
        position read them, and so do window states for evaluation blocks without window
        nodes."""
        self._node_features = (NodeFeatureReader(node_features), n_train)
        self._window_states = None

    def read_node_features(self, batch) -> None:
        """Give the window nodes of ``batch`` that carry only their train position
        (``nbr.train_pos``, as the data module builds them) their features, on the batch's
        device."""
        if "nbr" not in batch.node_types:
            return
        nbr = batch["nbr"]
        if "x" in nbr or "train_pos" not in nbr:
            return
        if self._node_features is None:
            raise RuntimeError("The batch's window nodes carry train positions, not features: "
                               "train and evaluate with `gnnlm` on a GraphDataModule, or call "
                               "attach_node_features(data.node_features(), data.n_train).")
        nbr.x = self._node_features[0](nbr.train_pos)

    def window_states(self) -> WindowStates:
        """The window-state table of this model's GNN for the current graph layout."""
        if self._node_features is None or self.graph is None:
            raise RuntimeError("Evaluation blocks without window nodes need the node features "
                               "and the graph layout: evaluate with `gnnlm` on a "
                               "GraphDataModule, or call attach_node_features(...) and set "
                               "model.graph.")
        states = self._window_states
        if states is None or states.config != self.graph:
            states = WindowStates(self.gnn, *self._node_features, self.graph,
                                  max_windows=self.max_windows)
            self._window_states = states
        return states

    def _reconsider_residency(self) -> None:
        """A stage starts: the node features refused residency on the GPU in an earlier stage
        (when a window table or another stage's buffers held its memory) may fit now."""
        if self._node_features is not None:
            self._node_features[0].reconsider()

    def on_train_start(self) -> None:
        self._reconsider_residency()

    def on_validation_start(self) -> None:
        self._reconsider_residency()

    def on_test_start(self) -> None:
        self._reconsider_residency()

    def on_predict_start(self) -> None:
        self._reconsider_residency()

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Release the window-state table before a training step: training reads window nodes,
        not the table, and its step changes the weights the table was computed from. At the
        paper's shape the table is 2 layers × 2.09M windows × 3 nodes × 512 float32 (25.7 GB),
        which the GPU would otherwise hold through every epoch."""
        if self._window_states is not None:
            self._window_states.clear()

    def forward(self, batch) -> torch.Tensor:
        """Logits ``[n_ctx, V]`` at the ``ctx`` nodes of a (batched) HeteroData."""
        self.read_node_features(batch)
        if self.impl == "dense":
            if self.graph is None:
                raise RuntimeError("The dense path needs the graphs' layout: pass graph_layout "
                                   "(`gnnlm` links the GraphDataModule's), or set model.graph.")
            ctx, nbr, layout = to_dense(batch, self.graph)
            if layout.retrieved is not None:  # evaluation: each retrieved window once
                h = layout.tokens(self.window_states()(ctx, layout))          # [n_ctx, d]
            else:
                h = layout.tokens(stack_dense(self.gnn, ctx, nbr, layout)[0])
        elif "retrieved" in batch["ctx"]:
            raise ValueError("impl='pyg' passes messages over window nodes: evaluate with the "
                             "data module's eval_windows='per_retrieval'.")
        else:
            h = self.gnn(batch.x_dict, batch.edge_index_dict)["ctx"]       # [n_ctx, d]
        with float32(h):  # the softmax stays in float32
            return self.logit_transform(F.linear(h.float(), *self.output_embedding()))

    def token_nll(self, batch, stage: str):
        nll = target_nll(self(batch), batch["ctx"].y)
        if stage == "train" and "nodes_masked" in batch:
            self.log_leakage(batch)
        return nll, torch.ones_like(nll), batch["ctx"].split_pos

    def log_leakage(self, batch) -> None:
        """The share of train-graph windows and nodes the leakage rule replaced or dropped,
        logged as tensors: a training step reads nothing back from the device."""
        windows = (batch["nbr"].offset == 0).sum()
        replaced = batch.windows_masked.sum()
        dropped = batch.nodes_masked.sum()
        self.log_dict({"leakage/windows_replaced": replaced / (windows + replaced).clamp(min=1),
                       "leakage/nodes_dropped": dropped / (batch["nbr"].num_nodes
                                                           + dropped).clamp(min=1)},
                      on_step=False, on_epoch=True, batch_size=int(batch["ctx"].num_nodes))
