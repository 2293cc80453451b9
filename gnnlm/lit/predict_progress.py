"""Progress of a ``predict`` pass (the report's per-token scores) in tokens, rate and ETA.

The pipeline scores each head's valid and test splits with ``Trainer.predict`` and no progress
bar; GNN-LM scores valid once per evaluation k as well, which on a large datastore takes minutes
per pass. ``PredictProgress`` counts the tokens each predict batch scored through
``gnnlm.utils.progress.Progress``: a bar on a terminal, otherwise a plain line at most every
``GNNLM_PROGRESS_SECONDS`` (default 30) and one when the pass ends, e.g.

    score GNNLM valid at k = 16: 4096/8192 tokens, 812.40 token/s, 5s elapsed, ETA 5s
"""
from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from gnnlm.utils.progress import Progress


class PredictProgress(Callback):
    """Counts the tokens of ``total`` scored by a predict pass (the ``positions`` of each
    batch's outputs: padding and unscored slots are not tokens)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc = int(total), desc
        self._progress: Optional[Progress] = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._progress = Progress(self.total, self.desc, unit="token")

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if self._progress is not None and isinstance(outputs, dict) and "positions" in outputs:
            self._progress.update(len(outputs["positions"]))

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._progress is not None:  # the totals: one line per pass, however short
            self._progress.close()
            self._progress = None
