"""Lightning's messages that are not true here, or only promotional or repeated, silenced by
every ``gnnlm`` command before it runs, and those of a resumed fit, which gnnlm says in its own
words (``resumed_fit``). Standard library only: silencing Lightning does not import it.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# the loggers Lightning's rank_zero_info and checkpoint messages go through
LIGHTNING_LOGGERS = ("pytorch_lightning.utilities.rank_zero",
                     "lightning_fabric.utilities.rank_zero",
                     "pytorch_lightning.trainer.connectors.checkpoint_connector")


class _DropLines(logging.Filter):
    """Drops the log records that begin with one of ``dropped``."""

    def __init__(self, dropped: tuple[str, ...]):
        super().__init__()
        self.dropped = dropped

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.dropped)


_ALWAYS = _DropLines((
    "💡 Tip",                           # promotional tips
    "`weights_only` was not set",       # said when saving the full training state, which is
                                        # meant; loading is weights-only
    # the device banner every Trainer logs when it is made: the pipeline makes one per fit and
    # per evaluation, so it came before every score; the device a stage runs on is in its own
    # line and in the report. (Lightning's "GPU available but not used" is a warning: it stays.)
    "GPU available: ", "TPU available: ", "HPU available: "))

# Lightning's note of a SIGTERM it caught: gnnlm's own handler (``gnnlm.utils.stopping``) stops
# the run and says so in one line, naming the stage
SIGNAL_LOGGER = "pytorch_lightning.trainer.connectors.signal_connector"
_SIGNAL_NOTE = _DropLines(("Received SIGTERM", "[rank: 0] Received SIGTERM"))

# what Lightning says when a fit resumes; gnnlm's own line says what resuming means instead
_RESUMING = _DropLines(("Restoring states from the checkpoint path at ",
                        "Restored all states from the checkpoint at "))
RESUME_WARNINGS = (
    # the train loader keeps no position within an epoch: known, and said by gnnlm's line
    "You're resuming from a checkpoint that ended before the epoch ended",
    # the resume folder holds this very build's checkpoints
    "Checkpoint directory .* not empty")


def quiet_lightning() -> None:
    """Silence Lightning's promotional tips and the messages that are not true here."""
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(_ALWAYS)  # (a filter is added once)
    logging.getLogger(SIGNAL_LOGGER).addFilter(_SIGNAL_NOTE)
    for message in (
            ".*tensorboardX.*",                     # the CSV logger is the intended default
            ".*sync_dist=True.*",                   # epoch metrics are reduced over ranks already
            ".*LightningCLI's args parameter.*",    # the pipeline runs the CLI from Python
            ".*isinstance\\(treespec, LeafSpec\\).*",
            ".*does not have many workers.*",       # two cores: loading in-process is intended
            ".*The number of training batches.*log_every_n_steps.*"):
        warnings.filterwarnings("ignore", message=message)


@contextlib.contextmanager
def resumed_fit(resuming: bool = True) -> Iterator[None]:
    """Inside, a fit resumed from a checkpoint says nothing of it through Lightning: neither its
    restoring lines nor its warnings about the checkpoint, which the caller's own line replaces
    (``gnnlm.lit.progress_log.resume_line``). Nothing changes when ``resuming`` is false."""
    with warnings.catch_warnings():
        if not resuming:
            yield
            return
        for message in RESUME_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
        for logger in loggers:
            logger.addFilter(_RESUMING)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(_RESUMING)
