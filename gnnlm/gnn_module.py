"""GNN-LM (Meng et al. 2022): a GNN over the retrieval graph, read out by the frozen softmax.

The ``ctx`` node of the token before w_t, after ``num_layers`` (paper: 3) HGT-style layers over
the graph of context and neighbour tokens, goes through the base LM's frozen output embedding:
p(w_t | c_t) = softmax(W h_ctx + b) (§2.3, last sentence). The output embedding comes from the
datastore (``features/output_embedding``) and is a non-persistent buffer, so it stays out of
checkpoints; ``attach_output_embedding`` sets it when the module is used outside a Trainer.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from torch.nn import functional as F

from gnnlm.gnn_layer import GNNStack
from gnnlm.graph import METADATA
from gnnlm.training import TokenLevelModule


class GNNLM(TokenLevelModule):
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
                            zero_init_output=zero_init_output)
        self.register_buffer("out_weight", torch.empty(0), persistent=False)
        self.register_buffer("out_bias", torch.empty(0), persistent=False)

    def attach_output_embedding(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        V, d = weight.shape
        if d != self.hparams.feature_dim or (self.hparams.vocab_size and V != self.hparams.vocab_size):
            raise ValueError(f"output embedding is {V}×{d} but the model expects "
                             f"{self.hparams.vocab_size}×{self.hparams.feature_dim}.")
        self.out_weight = weight.to(self.device, torch.float32)
        self.out_bias = (bias if bias is not None else torch.zeros(V)).to(self.device,
                                                                        torch.float32)

    def setup(self, stage: str) -> None:
        if self.out_weight.numel() == 0 and self.trainer is not None:
            self.attach_output_embedding(*self.trainer.datamodule.output_embedding())

    def forward(self, batch) -> torch.Tensor:
        """Logits ``[n_ctx, V]`` at the ``ctx`` nodes of a (batched) HeteroData."""
        if self.out_weight.numel() == 0:
            raise RuntimeError("No output embedding: call attach_output_embedding(W, b) first.")
        h = self.gnn(batch.x_dict, batch.edge_index_dict)["ctx"]          # [n_ctx, d]
        return F.linear(h, self.out_weight, self.out_bias)

    def token_nll(self, batch, stage: str):
        nll = F.cross_entropy(self(batch).float(), batch["ctx"].y, reduction="none")
        return nll, torch.ones_like(nll), batch["ctx"].split_pos
