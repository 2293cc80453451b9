"""GNN-LM (Meng et al. 2022): a GNN over the retrieval graph, read out by the frozen softmax.

The ``ctx`` node of the token before w_t, after ``num_layers`` (paper: 3) HGT-style layers over
the graph of context and neighbour tokens, goes through the base LM's frozen output embedding:
p(w_t | c_t) = softmax(W h_ctx + b) (§2.3, last sentence). The output embedding comes from the
datastore (``features/output_embedding``) and is a non-persistent buffer, so it stays out of
checkpoints; ``attach_output_embedding`` sets it when the module is used outside a Trainer.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch.nn import functional as F

from gnnlm.gnn_layer import GNNStack
from gnnlm.graph import METADATA
from gnnlm.lit.base import TokenLevelModule
from gnnlm.metrics import target_nll


class GNNLM(TokenLevelModule):
    uses_output_embedding = True

    def __init__(self, vocab_size: int = 0, feature_dim: int = 0, num_layers: int = 3,
                 heads: int = 4, dropout: float = 0.1, layer_norm: bool = False,
                 kind: Literal["gnnlm", "hgt"] = "gnnlm", zero_init_output: bool = True,
                 lr: float = 5e-4, weight_decay: float = 0.01, warmup_steps: int = 100,
                 min_lr_ratio: float = 0.1):
        """``vocab_size`` and ``feature_dim`` are linked from the graph data module by the CLI."""
        super().__init__()
        if feature_dim <= 0:
            raise ValueError(f"feature_dim must be the base LM's hidden size (got {feature_dim}).")
        self.save_hyperparameters()
        self.gnn = GNNStack(feature_dim, METADATA, num_layers=num_layers, heads=heads,
                            dropout=dropout, layer_norm=layer_norm, kind=kind,
                            zero_init_output=zero_init_output, readout=("ctx",))

    def forward(self, batch) -> torch.Tensor:
        """Logits ``[n_ctx, V]`` at the ``ctx`` nodes of a (batched) HeteroData."""
        h = self.gnn(batch.x_dict, batch.edge_index_dict)["ctx"]          # [n_ctx, d]
        with torch.autocast(h.device.type, enabled=False):  # the softmax stays in float32
            return F.linear(h.float(), *self.output_embedding())

    def token_nll(self, batch, stage: str):
        nll = target_nll(self(batch), batch["ctx"].y)
        return nll, torch.ones_like(nll), batch["ctx"].split_pos
