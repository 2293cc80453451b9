"""The callback that hands a model the work directory's arrays it reads but does not own: the
base LM's output embedding (heads on frozen features: GNN-LM, SPALM's gate) and the train node
features that GNN-LM's evaluation reads windows from.

They are arrays, not settings, so they are not init arguments linked from the data module
(which would save them as hyper-parameters in every checkpoint); and the model does not fetch
them from ``trainer.datamodule`` itself. Every ``gnnlm`` Lightning command adds this callback
(``gnnlm.lit.cli.GnnlmCLI``); outside a Trainer, call the model's ``attach_output_embedding`` /
``attach_node_features``.
"""
from __future__ import annotations

import pytorch_lightning as pl

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.gnn import GNNLM


class AttachDatastore(pl.Callback):
    """At ``setup``, give the model what the data module serves, where the model has none yet."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # (Lightning sets Trainer.datamodule in a connector, so its type does not declare it)
        data = trainer.datamodule  # type: ignore[attr-defined]
        if data is None:
            return
        if (isinstance(pl_module, TokenLevelModule) and pl_module.uses_output_embedding
                and not pl_module.has_output_embedding and hasattr(data, "output_embedding")):
            weight, bias = data.output_embedding()
            pl_module.attach_output_embedding(weight, bias,
                                              getattr(data, "logit_transform", None))
        if (isinstance(pl_module, GNNLM) and not pl_module.has_node_features
                and hasattr(data, "node_features")):
            pl_module.attach_node_features(data.node_features(), data.n_train)
