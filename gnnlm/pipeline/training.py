"""Training a trained part of the pipeline (the base LM, a head, the ablations' memory LM) through
LightningCLI: its identity, the fit, resuming a killed fit, stopping it between two steps, and
what the manifest records of how it ended.

Each becomes an artifact ``workdir.model(name)`` holding ``model.ckpt`` and, for heads, the
per-token scores of the valid and test targets (``gnnlm.pipeline.scoring``), so that every row of
the report scores exactly the same tokens. With ``gnnlm.pipeline.scoring`` and the memory rows of
``gnnlm.pipeline.ablations``, this is where the library runs the Lightning glue (``gnnlm.lit``,
``datamodules``). Which weights a fit keeps is ``gnnlm.pipeline.kept_weights``'s;
``gnnlm.pipeline.fit_configs`` parses a trained part's config without building it.
"""
from __future__ import annotations

import datetime
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gnnlm.pipeline.config_files import merged_texts, merged_yaml
from gnnlm.pipeline.fit_configs import cli_bases
from gnnlm.pipeline.kept_weights import (
    INITIAL_WEIGHTS,
    keep_initial_weights,
    restore_best_weights,
    validate_before_training,
    validation_curve,
    validation_metric,
)
from gnnlm.pipeline.scoring import choose_eval_k, predict_extras, predict_tokens, scoring_protocol
from gnnlm.utils.devices import release_unreachable
from gnnlm.utils.progress import say
from gnnlm.utils.quiet import quiet_lightning, resumed_fit
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.checkpoints import load_checkpoint, plain_classes
from gnnlm.workdir.fingerprints import canonical_json
from gnnlm.workdir.layout import EVAL_SPLITS, Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError, refusal

# Settings of a `gnnlm fit` config that do not change what it trains, left out of the trained
# part's identity: the work directory and the log folder, which fit_with_cli sets on the command
# line whatever the YAML says, and where and how progress is shown. Everything else stays, even
# what is probably harmless (logging frequency, data loader workers): a value wrongly left out
# would reuse weights trained otherwise, one wrongly kept only asks for a rebuild.
NOT_IDENTITY = (("trainer", "default_root_dir"), ("trainer", "logger"),
                ("trainer", "enable_progress_bar"), ("trainer", "enable_model_summary"),
                ("data", "init_args", "workdir"))


def fit_values(merged: dict) -> dict:
    """The values of a merged `gnnlm fit` config that identify what it trains: ``merged``
    without ``NOT_IDENTITY`` (and without sections that only held those)."""
    def without(node, path: tuple[str, ...]):
        if not isinstance(node, dict) or path[0] not in node:
            return node
        rest = {k: v for k, v in node.items() if k != path[0]}
        if len(path) > 1:
            inner = without(node[path[0]], path[1:])
            if inner != {} or node[path[0]] == {}:
                rest[path[0]] = inner
        return rest

    for path in NOT_IDENTITY:
        merged = without(merged, path)
    return merged


def trained_part_config(out: Path, name: str, configs: list[str], inputs: dict,
                        rebuild: bool = False) -> dict:
    """The config a trained part is identified by: its name and the merged values of its YAMLs
    (``gnnlm.pipeline.config_files.merged_yaml``, as LightningCLI merges them), so comments, key
    order, whitespace, and one file split into a base and an overlay do not matter.

    A trained part recorded before with its YAML texts (``{"name", "yaml"}``) is the same one
    when those texts give the same values: it keeps the config it was recorded with, so its
    fingerprint (which the ablations record for the memory LM) stays. Texts with other values
    are refused here, naming the fields that differ (unless ``rebuild``)."""
    config = {"name": name, "values": fit_values(merged_yaml(configs))}
    if rebuild:
        return config
    try:
        found = read_manifest(out, kind="trained_model")
    except ArtifactError:
        return config  # none, or not whole: the builder says so
    recorded = found.get("config") or {}
    if not isinstance(recorded.get("yaml"), list):
        return config
    try:
        before = {"name": recorded.get("name"), "values": fit_values(merged_texts(
            [str(text) for text in recorded["yaml"]]))}
    except Exception:  # noqa: BLE001 - texts that do not parse: let the fingerprints decide
        return config
    if canonical_json(before) == canonical_json(config):
        return recorded
    raise refusal(out, "trained_model", {"config": before, "inputs": found.get("inputs")},
                  {"config": config, "inputs": inputs})


def fit_with_cli(workdir: Workdir, name: str, configs: list[str], inputs: dict,
                 predict: bool = True, rebuild: bool = False,
                 overrides: Optional[list[str]] = None) -> dict:
    """Train with ``gnnlm fit -c configs[0] -c configs[1] … [overrides]`` into
    ``workdir.model(name)`` unless that is done already. ``overrides`` are ``--field=value``
    flags after the configs (the pipeline's corpus for its base LM); ``inputs`` must identify
    what they change (e.g. the tokens' fingerprint), as they are not part of the config.

    When the config's ``ModelCheckpoint`` monitors a metric, the weights are those of its best
    checkpoint (a base LM trained too long on WikiText-2 overfits: the features and the report
    then come from the best validation step, not the last). The starting weights are scored on
    valid first and kept instead when training did not improve on them (a head that starts as
    the base LM never ends worse than it); the manifest records both scores.

    A killed fit resumes from its last checkpoint (``TrainingRun``) when run again with the same
    config: weights, optimiser, schedulers and loop counters as they were.
    """
    out = workdir.model(name)
    builder = ArtifactBuilder(out, kind="trained_model",
                              config=trained_part_config(out, name, configs, inputs, rebuild),
                              inputs=inputs, rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out)
    t0 = time.perf_counter()
    with builder:
        cli = instantiate_fit(workdir, name, configs, overrides)
        run = TrainingRun(cli.trainer, workdir, name, builder)
        start = run.start(cli.model, cli.datamodule)
        # a resumed fit: Lightning's restoring lines and warnings give way to run.start's line
        with torch.serialization.safe_globals(plain_classes()), resumed_fit(
                run.resume_from is not None):
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=run.resume_from,
                            weights_only=True)
        if cli.trainer.interrupted:  # e.g. a signal Lightning handled: the build is not done
            raise KeyboardInterrupt(f"training {name} was interrupted")
        ended = how_training_ended(cli.trainer, builder.progress.get("training") or {})
        best_step = restore_best_weights(cli)
        # the fit's last metrics, before keep_initial_weights may validate again
        last_metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        kept = keep_initial_weights(cli, start, run.validations, builder)
        training, metrics = what_was_kept(cli.trainer, ended, last_metrics, start,
                                          run.validations, best_step, kept)
        cli.trainer.save_checkpoint(builder.file("model.ckpt"))
        extra = {"ckpt": "model.ckpt", "train_seconds": round(time.perf_counter() - t0, 2),
                 "metrics": metrics, "model_class": type(cli.model).__name__,
                 "training": training}
        if start is not None:
            extra["valid_before_training"] = {start["metric"]: start["score"]}
            extra["kept_initial_weights"] = kept is not None
        if predict:  # heads: per-token scores on exactly the report's tokens
            t_scoring = time.perf_counter()
            scores: dict[str, dict[str, np.ndarray]] = {}
            if (cli.datamodule.hparams.get("eval_ks") or None) is not None:
                extra["eval_k"], valid = choose_eval_k(
                    cli.model, cli.datamodule, workdir.n_positions("valid"),
                    cli.trainer.precision)
                scores["valid"] = {"logprob": valid}
            for split in EVAL_SPLITS:
                if split not in scores:
                    scores[split] = predict_tokens(cli.model, cli.datamodule, split,
                                                   workdir.n_positions(split),
                                                   cli.trainer.precision)
            # log p of every split first, then what else predict gives (SPALM: the mean gate)
            names = dict.fromkeys(name for split in EVAL_SPLITS for name in scores[split])
            for name in names:
                for split in EVAL_SPLITS:
                    if name in scores[split]:
                        values = scores[split][name]
                        builder.array(f"{split}_{name}", np.float32, values.shape)[...] = values
            extra["predict_seconds"] = round(time.perf_counter() - t_scoring, 2)
            extra.update(predict_extras(cli.model))
            extra["protocol"] = scoring_protocol(cli.model, cli.datamodule, workdir)
            # what predict's autocast was: gnnlm.inference serves the row the same way
            extra["precision"] = str(cli.trainer.precision)
        builder.file(INITIAL_WEIGHTS).unlink(missing_ok=True)
        manifest = builder.finish(extra=extra)
    run.clean_up()
    del cli, run  # the part's last references here: its trainer and modules are freed now
    release_unreachable()
    return manifest


def checkpoint_seconds() -> float:
    """How often a fit writes the checkpoint it resumes from: ``GNNLM_CHECKPOINT_SECONDS``
    (default 300, so a killed run loses at most five minutes)."""
    return float(os.environ.get("GNNLM_CHECKPOINT_SECONDS", 300))


def instantiate_fit(workdir: Workdir, name: str, configs: list[str],
                    overrides: Optional[list[str]] = None):
    """``gnnlm fit -c configs[0] … [overrides]`` built but not run (LightningCLI ``run=False``):
    the pipeline validates before training and passes the checkpoint to resume from to
    ``trainer.fit``."""
    from gnnlm.lit.cli import GnnlmCLI

    quiet_lightning()
    return GnnlmCLI(*cli_bases(), subclass_mode_model=True, subclass_mode_data=True,
                    args=[*(a for c in configs for a in ("-c", c)),
                          f"--data.init_args.workdir={workdir.root}",
                          f"--trainer.default_root_dir={workdir.logs(name)}",
                          *(overrides or [])],
                    run=False, save_config_kwargs={"overwrite": True})


class TrainingRun:
    """The checkpoints of one trained part's fit, and whether it resumes.

    Every ``ModelCheckpoint`` of the config without a ``dirpath`` writes to
    ``logs/<name>/checkpoints/<fingerprint>``, and one more writes ``last.ckpt`` (weights,
    optimiser, schedulers, loop counters, the other callbacks' state) every
    ``checkpoint_seconds()`` to ``logs/<name>/resume/<fingerprint>``. Both folders are the
    build's own: a build with another fingerprint never reads them, and they are cleared when a
    build starts afresh. The fit resumes from ``last.ckpt`` when the unfinished build
    (``<head>.partial``, same fingerprint) recorded that its training had started; the
    monitored callback, writing to the same folder as before, then keeps its best score."""

    def __init__(self, trainer, workdir: Workdir, name: str, builder: ArtifactBuilder):
        from pytorch_lightning.callbacks import ModelCheckpoint

        self.trainer, self.name, self.builder, self.root = trainer, name, builder, workdir.root
        logs = workdir.logs(name)
        self.checkpoints = Path(os.path.realpath(logs / "checkpoints" / builder.fingerprint))
        self.resume_dir = Path(os.path.realpath(logs / "resume" / builder.fingerprint))
        self.resume_from: Optional[str] = None
        monitored = trainer.checkpoint_callback
        self.validations = validation_curve(validation_metric(trainer)[0])
        trainer.callbacks.append(self.validations)
        last = self.resume_dir / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt"
        # a stop signal ends the fit between two steps, saving ``last`` first
        trainer.callbacks.append(stop_between_steps(last if monitored is not None else None))
        if monitored is None:  # the config turned checkpointing off: nothing to resume from
            return
        if builder.progress.get("training") and last.is_file():
            self.resume_from = str(last)
        else:
            shutil.rmtree(self.checkpoints, ignore_errors=True)
            shutil.rmtree(self.resume_dir, ignore_errors=True)
        for callback in trainer.checkpoint_callbacks:
            if callback.dirpath is None:
                callback.dirpath = str(self.checkpoints)
        trainer.callbacks.append(ModelCheckpoint(
            dirpath=str(self.resume_dir), save_top_k=0, save_last=True,
            # (a zero timedelta would turn the interval off: at least a millisecond)
            train_time_interval=datetime.timedelta(seconds=max(checkpoint_seconds(), 1e-3))))

    def start(self, model, datamodule) -> Optional[dict]:
        """Say where a resumed fit starts, or validate the starting weights of a new one (see
        ``validate_before_training``); record that training started. Returns the valid score
        before training (``{"metric", "mode", "score"}``) or None."""
        training = dict(self.builder.progress.get("training") or {})
        if self.resume_from is not None:
            from gnnlm.lit.progress_log import resume_line

            checkpoint = load_checkpoint(self.resume_from)
            step = int(checkpoint.get("global_step", 0))
            say(f"[gnnlm] {resume_line(self.name, self.resume_from, checkpoint)}")
            # a resumed fit ends close to an uninterrupted one, not equal to it: say so
            training["resumed_from_steps"] = [*training.get("resumed_from_steps", []), step]
            self.builder.save_progress(training=training)
            return training.get("initial")
        initial = validate_before_training(self.trainer, model, datamodule,
                                           self.builder.file(INITIAL_WEIGHTS))
        if initial is not None:
            say(f"[gnnlm] {self.name}: valid {initial['metric']} before training "
                f"{initial['score']:.4g}")
        self.builder.save_progress(training={"initial": initial})
        return initial

    def clean_up(self) -> None:
        """After the build is complete: its resume checkpoint serves nothing any more."""
        shutil.rmtree(self.resume_dir, ignore_errors=True)


def stop_between_steps(resume_checkpoint: Optional[Path]):
    """A callback that lets a stop signal (``gnnlm.utils.stopping``) end a fit's training only
    where a training step has ended, after writing the checkpoint the fit resumes from to
    ``resume_checkpoint`` (None: checkpointing is off, the rerun trains afresh).

    The signal is held from the start of training to its end. One received during a step is
    acted on at the step's end. One received between two steps ends the fit where Lightning
    acts on a SIGTERM of its own (``SIGTERMException``, after the step's bookkeeping: the
    checkpoint is written as that exception passes), or else at the end of the next step (the
    next batch was being loaded; SIGINT, which Lightning leaves alone); one received after the
    last step, as training ends. Elsewhere the fit stops at once, and the rerun resumes from the
    last checkpoint written every ``checkpoint_seconds()``: in validation (a signal during it,
    or held when it begins), and when a SIGTERM comes as an epoch's last step ends."""
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from gnnlm.utils import stopping

    class StopBetweenSteps(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.holding = False     # the signal is held (training, outside validation)
            self.validating = False  # validation inside training, the signal not held

        def hold(self, on: bool) -> None:
            if on and not self.holding:
                stopping.begin_deferring()
            elif not on and self.holding:
                stopping.end_deferring()
            self.holding = on

        def save(self, trainer) -> None:
            if resume_checkpoint is None:
                return
            part = resume_checkpoint.with_name(resume_checkpoint.name + ".part")
            trainer.save_checkpoint(part)  # written whole, then renamed over the last one
            os.replace(part, resume_checkpoint)
            say(f"[gnnlm] saved the checkpoint to resume from at step {trainer.global_step} "
                f"({resume_checkpoint})")

        def on_train_start(self, trainer, pl_module) -> None:
            self.hold(True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if stopping.pending() is None:
                return
            self.save(trainer)
            self.hold(False)
            stopping.check_pending()

        def on_validation_start(self, trainer, pl_module) -> None:
            if self.holding:  # (not the sanity check, nor a validation outside a fit)
                self.validating = True
                self.hold(False)
                stopping.check_pending()

        def on_validation_end(self, trainer, pl_module) -> None:
            if self.validating:
                self.validating = False
                self.hold(True)

        def resumable_here(self, trainer) -> bool:
            """After a step's bookkeeping, a held signal: a checkpoint here resumes as one
            written at the step's end, except after an epoch's last step (resumed, it would
            count that epoch twice)."""
            return (self.holding and stopping.pending() is not None
                    and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

        def on_train_end(self, trainer, pl_module) -> None:  # told after the last step
            if self.resumable_here(trainer):
                self.save(trainer)
            self.hold(False)
            stopping.check_pending()

        def on_exception(self, trainer, pl_module, exception) -> None:
            # Lightning's SIGTERM exit, raised after a step's bookkeeping
            if isinstance(exception, SIGTERMException) and self.resumable_here(trainer):
                self.save(trainer)
            self.hold(False)  # a fit that raised leaves no block open
            self.validating = False

    return StopBetweenSteps()


def how_training_ended(trainer, training: dict) -> dict:
    """What the manifest records of how a fit went: the optimiser steps it took, the steps it
    was resumed from (``TrainingRun.start``), and ``stopped_by``: "max_time" when the time limit
    ended it before ``max_steps`` (its weights are then those of a shorter training than the
    config names), "diverged" when EarlyStopping stopped it because its monitored metric became
    NaN or infinite (or crossed its ``divergence_threshold``), else "max_steps", "max_epochs" or
    "early stopping". ``what_was_kept`` adds which weights were kept."""
    from pytorch_lightning.callbacks import Timer

    steps, max_steps = int(trainer.global_step), trainer.max_steps
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    remaining = timer.time_remaining() if timer is not None else None
    if diverged(trainer):  # whatever bound it also reached, it stopped being trained there
        stopped_by = "diverged"
    elif max_steps is not None and 0 <= max_steps <= steps:
        stopped_by = "max_steps"
    elif remaining is not None and remaining <= 0:
        stopped_by = "max_time"
    elif trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch:
        stopped_by = "max_epochs"  # (-1: no bound on epochs)
    else:
        stopped_by = "early stopping"
    return {"steps": steps, "max_steps": max_steps, "stopped_by": stopped_by,
            "resumed_from_steps": list(training.get("resumed_from_steps", []))}


def diverged(trainer) -> bool:
    """Whether an EarlyStopping callback stopped the fit because its metric diverged: NaN or
    infinite (``check_finite``), or past ``divergence_threshold``. Lightning records why it
    stopped (``stopping_reason``); a version that does not is asked the metric itself."""
    from pytorch_lightning.callbacks import EarlyStopping

    for callback in trainer.callbacks:
        if not isinstance(callback, EarlyStopping):
            continue
        reason = getattr(callback, "stopping_reason", None)
        if reason is not None:
            if getattr(reason, "name", None) in ("NON_FINITE_METRIC", "DIVERGENCE_THRESHOLD"):
                return True
            continue
        value = trainer.callback_metrics.get(callback.monitor)
        if (callback.check_finite and value is not None
                and not torch.isfinite(torch.as_tensor(value)).all()):
            return True
    return False


def what_was_kept(trainer, training: dict, metrics: dict, start: Optional[dict], validations,
                  best_step: Optional[int], kept: Optional[dict]) -> tuple[dict, dict]:
    """The manifest's ``training`` and ``metrics`` with the weights the fit keeps: ``training``
    (``how_training_ended``'s) with ``kept_step``, the step whose weights are kept (0: the
    starting ones, ``kept``; else the best validation's, ``best_step``; else the last step's),
    and ``valid_curve``, the monitored metric at every validation (``validations``; step 0: the
    starting weights' score, ``start``); ``metrics`` (the fit's last) with the kept weights'
    score in place of the last validation's."""
    metrics = dict(metrics)
    if best_step is not None:  # the kept weights' score, not the last validation's
        callback = trainer.checkpoint_callback
        metrics[callback.monitor] = float(callback.best_model_score)
    if kept is not None:
        metrics.update(kept)
    # which weights are scored: the best validation's, the starting ones, or the last step's
    training = {**training, "kept_step": 0 if kept is not None else (
        best_step if best_step is not None else training["steps"])}
    curve = ([(0, float(start["score"]))] if start is not None else []) + validations.curve
    if curve:
        training["valid_curve"] = {"metric": validations.metric,
                                   "steps": [step for step, _ in curve],
                                   "scores": [score for _, score in curve]}
    return training, metrics
