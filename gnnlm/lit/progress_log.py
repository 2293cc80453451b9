"""Training progress as plain lines, for logs that are not a terminal.

Lightning's progress bar redraws one line in place; with stdout redirected (``make demo > log``)
it shows nothing until the run ends. ``ProgressLog`` then writes, on stderr like the pipeline's
other progress lines (``gnnlm.utils.progress``), one line at most every ``GNNLM_PROGRESS_SECONDS``
(default 30) while training, one per validation, and one when training ends:

    fit GNNLM: step 410/1368 (30%), epoch 1/2, 1.71 steps/s, 4:00 elapsed, ETA 9:20, train/loss 6.31

On a terminal with the bar on, it stays silent; ``GNNLM_QUIET=1`` silences it too.

``EpochBar`` is Lightning's rich bar (every ``gnnlm`` fit's, ``gnnlm.lit.cli``) with an epoch
total only where the epoch count bounds training: Lightning's own says ``Epoch 0/-2`` when
``max_steps`` does (``max_epochs`` is then -1), and a redirected log keeps its last frame.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, RichProgressBar, Timer
from pytorch_lightning.trainer.states import TrainerFn

from gnnlm.utils.progress import format_seconds, say


class ProgressLog(Callback):
    """Plain progress lines of ``fit`` when no progress bar can be seen.

    ``every_seconds``: the interval between lines (default ``GNNLM_PROGRESS_SECONDS`` or 30);
    ``enabled``: force the lines on or off (default: on when stdout is not a terminal or the
    trainer shows no progress bar)."""

    def __init__(self, every_seconds: Optional[float] = None, enabled: Optional[bool] = None):
        self.every_seconds = every_seconds
        self.enabled = enabled
        self._on = False
        self._t0 = self._last = 0.0
        self._start_step = 0

    def _every(self) -> float:
        if self.every_seconds is not None:
            return float(self.every_seconds)
        return float(os.environ.get("GNNLM_PROGRESS_SECONDS", 30))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        shown = self.enabled
        if shown is None:  # a bar nobody can see: stdout redirected, or no bar at all
            shown = not sys.stdout.isatty() or trainer.progress_bar_callback is None
        self._on = bool(shown) and trainer.is_global_zero
        self._t0 = self._last = time.perf_counter()
        self._start_step = trainer.global_step  # a resumed run counts its rate from here

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._on and now - self._last >= self._every():
            self._last = now
            say(f"  {self.line(trainer, pl_module)}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._on or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        scores = ", ".join(f"{key} {float(value):.4g}"
                           for key, value in trainer.callback_metrics.items()
                           if key.startswith("val/") and key != "val/tokens")
        say(f"  fit {type(pl_module).__name__}: validation at step {trainer.global_step}: "
            f"{scores or 'no metrics'}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._on:  # a log always ends with the totals
            say(f"  {self.line(trainer, pl_module)}")

    def line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``fit <Model>: step s/total (p%), epoch e[/E], rate, elapsed, ETA, last train loss``
        (the step total is Lightning's estimate from max_steps or max_epochs, whichever ends
        training first)."""
        step, elapsed = trainer.global_step, time.perf_counter() - self._t0
        total = trainer.estimated_stepping_batches
        rate = (step - self._start_step) / elapsed if elapsed > 0 else 0.0
        parts = [f"fit {type(pl_module).__name__}: step {step}"]
        left = math.inf
        if math.isfinite(total) and total > 0:
            parts[0] += f"/{int(total)} ({100 * step / total:.0f}%)"
            if rate > 0:
                left = (total - step) / rate
        parts.append(epoch_part(trainer.current_epoch, trainer.max_epochs, trainer.max_steps))
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set when a fit starts
        timer = next((c for c in callbacks if isinstance(c, Timer)), None)
        if timer is not None:  # trainer.max_time ends training first when it is sooner
            remaining = timer.time_remaining()
            if remaining is not None:
                left = min(left, max(remaining, 0.0))
        parts += [f"{rate:.2f} steps/s", f"{format_seconds(elapsed)} elapsed",
                  f"ETA {format_seconds(left) if math.isfinite(left) else '?'}"]
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            parts.append(f"train/loss {float(loss):.4f}")
        return ", ".join(parts)


def epoch_part(current_epoch: int, max_epochs: Optional[int], max_steps: Optional[int]) -> str:
    """``epoch e/E`` while the epoch count bounds training, else ``epoch e`` (the step total
    before it says how far training goes).

    Lightning's ``max_epochs`` is -1 when ``max_steps`` bounds training instead, and when both
    are set the steps may end it first: then an epoch total would be untrue. Its
    ``current_epoch`` counts the epochs begun, and once the last has ended it is one past them,
    so the count is kept to the total (a log's final line says ``epoch 2/2``, not ``3/2``)."""
    epoch = current_epoch + 1
    if max_epochs is None or not epochs_bound(max_epochs, max_steps):
        return f"epoch {epoch}"
    return f"epoch {min(epoch, max_epochs)}/{max_epochs}"


def epochs_bound(max_epochs: Optional[int], max_steps: Optional[int]) -> bool:
    """Whether the epoch count ends training: ``max_epochs`` is set (not Lightning's -1) and
    no ``max_steps`` may end it first."""
    return max_epochs is not None and max_epochs >= 1 and (max_steps is None or max_steps < 0)


class EpochBar(RichProgressBar):
    """Lightning's rich progress bar, whose train line reads ``Epoch 0`` rather than
    ``Epoch 0/-2`` when the epoch count does not bound training (``epochs_bound``); else as
    Lightning's (``Epoch 0/1`` of 2, counted from 0). It shows the train loss read at most
    once every ``LOSS_SECONDS``: the loss is not a progress-bar metric, which Lightning reads
    back from the device after every step (on a GPU a wait for all its queued kernels)."""
    LOSS_SECONDS = 1.0

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                    ) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        # the instance is Lightning's bar with its class swapped (gnnlm.lit.cli): no __init__
        shown: Optional[tuple[float, float]] = getattr(self, "_loss_shown", None)
        loss = trainer.callback_metrics.get("train/loss")
        now = time.perf_counter()
        if loss is not None and (shown is None or now - shown[1] >= self.LOSS_SECONDS):
            shown = (float(loss), now)
            self._loss_shown = shown
        if shown is not None:
            metrics["train/loss"] = shown[0]
        return metrics

    def _get_train_description(self, current_epoch: int) -> str:
        epochs, description = self.trainer.max_epochs, f"Epoch {current_epoch}"
        if epochs is not None and epochs_bound(epochs, self.trainer.max_steps):
            description += f"/{epochs - 1}"
        # as wide as the validation line, as Lightning pads it (no flicker between the two)
        return f"{description:{len(self.validation_description)}}"


def resume_line(name: str, path: str, checkpoint: dict) -> str:
    """What resuming ``name`` from the Lightning checkpoint at ``path`` does, in one line (in
    place of Lightning's restoring lines and its warning about a checkpoint written mid-epoch).

    Lightning restores the weights, the optimiser, the schedulers and the loop counters, but
    gnnlm's train loaders keep no position within an epoch: a fit resumed in the middle of one
    draws the rest of that epoch from the loader's start again (under a fixed seed in the order
    it had before, so the batches it began with come again and its last ones are not seen)."""
    step = int(checkpoint.get("global_step", 0))
    epoch = int(checkpoint.get("epoch", 0)) + 1
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    batches = loop.get("epoch_loop.batch_progress") or {}
    done = int(((batches.get("current") or {}).get("processed")) or 0)
    head = f"resuming {name} from step {step} ({path})"
    if done == 0 or batches.get("is_last_batch"):  # saved as an epoch ended: the next begins
        epoch += 1 if batches.get("is_last_batch") else 0
        return f"{head}, at the start of epoch {epoch}: weights, optimiser and schedule as saved"
    return (f"{head}: weights, optimiser and schedule as saved; epoch {epoch} stopped after "
            f"{done} batches and goes on with batches drawn from the train loader's start "
            f"again (a loader keeps no position), so some batches of this epoch are seen twice "
            f"and others not at all: the weights end close to an uninterrupted run's, not equal")
