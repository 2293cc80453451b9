"""Which weights a trained part keeps: those of its best validation (``restore_best_weights``),
or its starting weights when training did not improve on them (``keep_initial_weights``), scored
on valid before the first step and saved beside the build (``validate_before_training``); and
the valid curve the fit draws on the way (``validation_curve``), which the manifest records.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from gnnlm.utils.progress import say
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.checkpoints import load_checkpoint, plain_classes

# the trained part's weights before its first step, kept in the unfinished build until it ends
INITIAL_WEIGHTS = "initial_weights.pt"


def validation_metric(trainer) -> tuple[str, str]:
    """The metric that picks the kept weights and its direction: the monitored one, or val/ppl."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.monitor:
        return callback.monitor, callback.mode
    return "val/ppl", "min"


def validate_before_training(trainer, model, datamodule, weights_file: Path) -> Optional[dict]:
    """Score the starting weights on valid (``trainer.validate``, the fit's own limits) and save
    them to ``weights_file``, so that training can never leave a model worse than it started
    (GNN-LM starts as the base LM). None when the config does not validate."""
    if trainer.limit_val_batches == 0:
        return None
    from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states

    metric, mode = validation_metric(trainer)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights_file)
    # the random streams as they were: each loader draws its seed from them, so without this
    # the fit would shuffle (and drop out) otherwise than the same config trained without the
    # extra validation, and a seeded config would no longer give the weights it gave
    rng = _collect_rng_states()
    with torch.serialization.safe_globals(plain_classes()):
        results = trainer.validate(model, datamodule=datamodule, verbose=False)
    _set_rng_states(rng)
    _reset_metrics(model)
    if not results or metric not in results[0]:
        return None
    return {"metric": metric, "mode": mode, "score": float(results[0][metric])}


def _reset_metrics(model) -> None:
    """Reset the model's torchmetrics states outside inference mode: ``trainer.validate`` left
    them as inference tensors, which the fit's validation (under no_grad) cannot update."""
    from torchmetrics import Metric

    for module in model.modules():
        if isinstance(module, Metric):
            module.reset()


def validation_curve(metric: str):
    """A callback that records ``metric`` at every validation of the fit: ``curve``, a list of
    (step, score), and ``step`` / ``score`` of the last one (-1 / nan before any). The curve is
    part of the checkpoint a killed fit resumes from, so a resumed fit records it whole."""
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.trainer.states import TrainerFn

    class ValidationCurve(Callback):
        def __init__(self) -> None:
            self.metric = metric
            self.curve: list[tuple[int, float]] = []

        @property
        def step(self) -> int:
            return self.curve[-1][0] if self.curve else -1

        @property
        def score(self) -> float:
            return self.curve[-1][1] if self.curve else float("nan")

        def on_validation_end(self, trainer, pl_module) -> None:
            value = trainer.callback_metrics.get(metric)
            if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING and \
                    value is not None:
                self.curve.append((int(trainer.global_step), float(value)))

        def state_dict(self) -> dict:
            return {"curve": [list(point) for point in self.curve]}

        def load_state_dict(self, state_dict: dict) -> None:
            self.curve = [(int(step), float(score)) for step, score in state_dict["curve"]]

    return ValidationCurve()


def keep_initial_weights(cli, start: Optional[dict], last,
                         builder: ArtifactBuilder) -> Optional[dict]:
    """Put the starting weights back when the kept weights score worse on valid than they did.

    The kept weights' score is the monitored callback's best, else that of the last validation
    when it ran at the last step, else a validation now. Returns ``{metric: starting score}``
    when the starting weights were kept, else None."""
    if start is None:
        return None
    metric, mode, initial = start["metric"], start["mode"], float(start["score"])
    trainer = cli.trainer
    callback = trainer.checkpoint_callback
    if (callback is not None and callback.monitor == metric and callback.best_model_path
            and callback.best_model_score is not None):
        final = float(callback.best_model_score)
    elif last.step == trainer.global_step:
        final = last.score
    else:
        with torch.serialization.safe_globals(plain_classes()):
            results = trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        final = float(results[0].get(metric, float("nan"))) if results else float("nan")
    better = final < initial if mode == "min" else final > initial
    if better or final == initial:
        return None
    state = torch.load(builder.file(INITIAL_WEIGHTS), map_location="cpu", weights_only=True)
    cli.model.load_state_dict(state)
    say(f"[gnnlm] {builder.path.name}: valid {metric} after training {final:.4g} is not better "
        f"than before it ({initial:.4g}): keeping the initial weights")
    return {metric: initial}


def restore_best_weights(cli) -> Optional[int]:
    """Load the monitored checkpoint callback's best weights into ``cli.model``, if any, and
    return the step they were saved at (None: the last step's weights stay)."""
    callback = cli.trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    if callback is not None and callback.monitor and best:
        checkpoint = load_checkpoint(best)
        cli.model.load_state_dict(checkpoint["state_dict"])
        return int(checkpoint["global_step"])
    return None

