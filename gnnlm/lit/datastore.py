"""The callback that hands a model the work directory's arrays it reads but does not own: the
base LM's output embedding (heads on frozen features: GNN-LM, SPALM's gate) and the train node
features that GNN-LM's evaluation reads windows from.

They are arrays, not settings, so they are not init arguments linked from the data module
(which would save them as hyper-parameters in every checkpoint); and the model does not fetch
them from ``trainer.datamodule`` itself. Every ``gnnlm`` Lightning command adds this callback
(``gnnlm.lit.cli.GnnlmCLI``); outside a Trainer, ``attach_datastore(model, data)`` does the
same.
"""
from __future__ import annotations

import pytorch_lightning as pl

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.gnn import GNNLM


def attach_datastore(module: pl.LightningModule, data) -> None:
    """Give ``module`` what the data module ``data`` serves, where the module has none yet."""
    if (isinstance(module, TokenLevelModule) and module.uses_output_embedding
            and not module.has_output_embedding and hasattr(data, "output_embedding")):
        weight, bias = data.output_embedding()
        module.attach_output_embedding(weight, bias, getattr(data, "logit_transform", None))
    if (isinstance(module, GNNLM) and not module.has_node_features
            and hasattr(data, "node_features")):
        module.attach_node_features(data.node_features(), data.n_train)


class AttachDatastore(pl.Callback):
    """At ``setup``, give the model what the data module serves, where the model has none yet."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # (Lightning sets Trainer.datamodule in a connector, so its type does not declare it)
        data = trainer.datamodule  # type: ignore[attr-defined]
        if data is not None:
            attach_datastore(pl_module, data)
