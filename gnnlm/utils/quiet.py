"""Lightning's messages that are not true here, or only promotional, silenced by every ``gnnlm``
command before it runs. Standard library only: silencing Lightning does not import it.
"""
from __future__ import annotations

import logging
import warnings


class _DropLines(logging.Filter):
    DROPPED = ("💡 Tip",                           # promotional tips
               "`weights_only` was not set")       # said when saving the full training state,
                                                   # which is meant; loading is weights-only

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.DROPPED)


def quiet_lightning() -> None:
    """Silence Lightning's promotional tips and the messages that are not true here."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                 "pytorch_lightning.trainer.connectors.checkpoint_connector"):
        logging.getLogger(name).addFilter(_DropLines())
    for message in (
            ".*tensorboardX.*",                     # the CSV logger is the intended default
            ".*sync_dist=True.*",                   # epoch metrics are reduced over ranks already
            ".*LightningCLI's args parameter.*",    # the pipeline runs the CLI from Python
            ".*isinstance\\(treespec, LeafSpec\\).*",
            ".*does not have many workers.*",       # two cores: loading in-process is intended
            ".*The number of training batches.*log_every_n_steps.*"):
        warnings.filterwarnings("ignore", message=message)
