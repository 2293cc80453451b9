"""GNN-LM (Meng et al. 2022): a GNN over the retrieval graph, read out by the frozen softmax.

The ``ctx`` node of the token before w_t, after ``num_layers`` (paper: 3) HGT-style layers over
the graph of context and neighbour tokens, goes through the base LM's frozen output embedding:
p(w_t | c_t) = softmax(W h_ctx + b) (§2.3, last sentence). The output embedding comes from the
datastore (``features/output_embedding``) and is a non-persistent buffer, so it stays out of
checkpoints; ``attach_output_embedding`` sets it when the module is used outside a Trainer.

``impl="dense"`` runs the layers on the graphs' regular layout (``gnnlm.gnn_dense``), ``"pyg"``
by message passing over the edges (``GNNLMConv.forward``); both compute the same function with
the same weights. The window sizes, inter edges and ctx window of that layout are the data
module's ``graph``, taken at ``setup`` (or given with ``graph``).
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from torch.nn import functional as F

from gnnlm.gnn_dense import to_dense
from gnnlm.gnn_layer import GNNStack
from gnnlm.graph import METADATA, GraphConfig
from gnnlm.lit.base import TokenLevelModule
from gnnlm.metrics import target_nll


class GNNLM(TokenLevelModule):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, num_layers: int = 3,
                 heads: int = 4, dropout: float = 0.1,
                 norm: Literal["none", "pre", "post"] = "none",
                 edge_aggr: Literal["sum", "mean"] = "sum",
                 kind: Literal["gnnlm", "hgt"] = "gnnlm", impl: Literal["dense", "pyg"] = "dense",
                 zero_init_output: bool = True, lr: float = 5e-4, weight_decay: float = 0.01,
                 warmup_steps: int = 100, min_lr_ratio: float = 0.1):
        """``vocab_size`` and ``feature_dim`` are linked from the graph data module by the CLI.
        ``norm``/``edge_aggr`` choose between the paper's equations (``"none"``, ``"sum"``)
        and the reference implementation's layer (``"post"``, ``"mean"``)."""
        super().__init__()
        if feature_dim <= 0:
            raise ValueError(f"feature_dim must be the base LM's hidden size (got {feature_dim}).")
        if impl == "dense" and kind != "gnnlm":
            raise ValueError(f"impl='dense' computes GNN-LM layers; use impl='pyg' with "
                             f"kind={kind!r}.")
        self.save_hyperparameters()
        self.gnn = GNNStack(feature_dim, METADATA, num_layers=num_layers, heads=heads,
                            dropout=dropout, norm=norm, edge_aggr=edge_aggr, kind=kind,
                            zero_init_output=zero_init_output, readout=("ctx",))
        self.graph: Optional[GraphConfig] = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = self.trainer.datamodule if self.trainer is not None else None
        if self.graph is None and datamodule is not None:
            self.graph = datamodule.graph

    def forward(self, batch) -> torch.Tensor:
        """Logits ``[n_ctx, V]`` at the ``ctx`` nodes of a (batched) HeteroData."""
        if self.hparams.impl == "dense":
            if self.graph is None:
                raise RuntimeError("The dense path needs the graphs' layout: train with a "
                                   "GraphDataModule, or set model.graph = its GraphConfig.")
            ctx, nbr, layout = to_dense(batch, self.graph)
            h = self.gnn.forward_dense(ctx, nbr, layout)[0][layout.ctx_mask]  # [n_ctx, d]
        else:
            h = self.gnn(batch.x_dict, batch.edge_index_dict)["ctx"]       # [n_ctx, d]
        with torch.autocast(h.device.type, enabled=False):  # the softmax stays in float32
            return F.linear(h.float(), *self.output_embedding())

    def token_nll(self, batch, stage: str):
        nll = target_nll(self(batch), batch["ctx"].y)
        if stage == "train" and "nodes_masked" in batch:
            self.log_leakage(batch)
        return nll, torch.ones_like(nll), batch["ctx"].split_pos

    def log_leakage(self, batch) -> None:
        """The share of train-graph windows and nodes the leakage rule replaced or dropped."""
        windows = float((batch["nbr"].offset == 0).sum())
        replaced = float(batch.windows_masked.sum())
        dropped = float(batch.nodes_masked.sum())
        self.log_dict({"leakage/windows_replaced": replaced / max(windows + replaced, 1.0),
                       "leakage/nodes_dropped": dropped / max(batch["nbr"].num_nodes + dropped,
                                                              1.0)},
                      on_step=False, on_epoch=True, batch_size=int(batch["ctx"].num_nodes))
