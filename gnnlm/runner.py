"""Trained parts of the pipeline (the base LM and the heads), run through LightningCLI.

Each becomes an artifact ``workdir.head(name)`` holding ``model.ckpt`` and, for heads, the
per-token log-probabilities of the valid and test targets, so that every row of the report
scores exactly the same tokens. This is the one module of the library that imports the Lightning
glue (``gnnlm.lit``, ``datamodules``).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gnnlm import protocols
from gnnlm.artifacts import ArtifactBuilder, open_array, read_manifest
from gnnlm.checkpoints import datamodule_args, load_checkpoint
from gnnlm.metrics import ppl_from_logprobs
from gnnlm.progress import say
from gnnlm.protocols import Protocol
from gnnlm.workdir import EVAL_SPLITS, Workdir


def fit_with_cli(workdir: Workdir, name: str, configs: list[str], inputs: dict,
                 predict: bool = True, rebuild: bool = False) -> dict:
    """Train with ``gnnlm fit -c configs[0] -c configs[1] …`` into ``workdir.head(name)``
    unless that is done already.

    When the config's ``ModelCheckpoint`` monitors a metric, the weights are those of its best
    checkpoint (a base LM trained too long on WikiText-2 overfits: the features and the report
    then come from the best validation step, not the last).
    """
    from gnnlm.cli import lightning_main  # LightningCLI is slow to import; only needed here

    out = workdir.head(name)
    builder = ArtifactBuilder(out, kind="trained_model",
                              config={"name": name,
                                      "yaml": [Path(c).read_text() for c in configs]},
                              inputs=inputs, rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out)
    t0 = time.perf_counter()
    with builder:
        args = ["fit", *(arg for c in configs for arg in ("-c", c)),
                f"--data.init_args.workdir={workdir.root}",
                f"--trainer.default_root_dir={workdir.logs(name)}"]
        cli = lightning_main(args)
        restore_best_weights(cli)
        cli.trainer.save_checkpoint(builder.file("model.ckpt"))
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        extra = {"ckpt": "model.ckpt", "train_seconds": round(time.perf_counter() - t0, 2),
                 "metrics": metrics, "model_class": type(cli.model).__name__}
        if predict:  # heads: per-token scores on exactly the report's tokens
            scores = {}
            if (cli.datamodule.hparams.get("eval_ks") or None) is not None:
                extra["eval_k"], scores["valid"] = choose_eval_k(
                    cli.model, cli.datamodule, workdir.n_positions("valid"),
                    cli.trainer.precision)
            for split in EVAL_SPLITS:
                n = workdir.n_positions(split)
                if split not in scores:
                    scores[split] = predict_logprobs(cli.model, cli.datamodule, split, n,
                                                     cli.trainer.precision)
                builder.array(f"{split}_logprob", np.float32, (n,))[...] = scores[split]
            extra.update(predict_extras(cli.model))
            extra["protocol"] = scoring_protocol(cli.model, cli.datamodule, workdir)
            for array, values in getattr(cli.model, "predict_arrays", dict)().items():
                builder.array(array, values.dtype, values.shape)[...] = values  # e.g. gates
        return builder.finish(extra=extra)


def restore_best_weights(cli) -> None:
    """Load the monitored checkpoint callback's best weights into ``cli.model``, if any."""
    callback = cli.trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    if callback is not None and callback.monitor and best:
        cli.model.load_state_dict(load_checkpoint(best)["state_dict"])


def predict_logprobs(model, datamodule, split: str, n: int, precision: str = "32-true"
                     ) -> np.ndarray:
    """Log p(target) for every position of ``split``, in position order, via ``predict`` (on one
    device, with the training run's precision)."""
    import pytorch_lightning as pl

    datamodule.hparams.predict_split = split
    trainer = pl.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, precision=precision)
    outputs = trainer.predict(model, datamodule=datamodule)
    positions = torch.cat([o["positions"] for o in outputs]).numpy()
    logprob = np.full(n, np.nan, dtype=np.float32)
    logprob[positions] = torch.cat([o["logprob"] for o in outputs]).numpy()
    if len(positions) != n or np.isnan(logprob).any():
        raise RuntimeError(f"predict on {split} scored {len(positions)} positions, expected each "
                           f"of the {n} exactly once: the evaluation data module must partition "
                           f"the split (no eval_tokens limit for reports).")
    return logprob


def choose_eval_k(model, datamodule, n_valid: int, precision: str = "32-true"
                  ) -> tuple[dict, np.ndarray]:
    """Score valid with each of the data module's ``eval_ks`` windows per token and keep the
    best, as kNN-LM's k is chosen on valid (GNN-LM's k is a property of the graph, not of the
    weights: a model trained with k windows reads any number). Sets ``datamodule.eval_k`` to it
    and returns ``({"valid_ppl": {k: ppl}, "seconds": {k: s}, "chosen": k}, valid log p at the
    chosen k)``."""
    curve, seconds, best = {}, {}, None
    for k in sorted(set(datamodule.hparams.eval_ks)):
        datamodule.eval_k = k
        t0 = time.perf_counter()
        logprob = predict_logprobs(model, datamodule, "valid", n_valid, precision)
        seconds[k] = round(time.perf_counter() - t0, 2)
        curve[k] = ppl_from_logprobs(logprob)
        if best is None or curve[k] < curve[best[0]]:
            best = (k, logprob)
    assert best is not None
    datamodule.eval_k = best[0]
    say("[gnnlm] valid ppl by evaluation k: " + ", ".join(
        f"{k}: {ppl:.2f} ({seconds[k]:.0f} s)" for k, ppl in curve.items())
        + f"; chosen k = {best[0]}")
    return ({"valid_ppl": {str(k): v for k, v in curve.items()},
             "seconds": {str(k): v for k, v in seconds.items()}, "chosen": best[0]}, best[1])


def predict_extras(model) -> dict:
    """Per-model extras saved beside the scores (SPALM: gate values over the test split; a
    model with ``report_extras()`` says its own) and, under ``deviations``, the options on
    that depart from the model's paper (``deviations()``), which the report names in the
    row's label."""
    deviations = model.deviations() if callable(getattr(model, "deviations", None)) else []
    extras: dict = {"deviations": deviations} if deviations else {}
    if callable(getattr(model, "report_extras", None)):
        return {**model.report_extras(), **extras}
    histogram = getattr(model, "gate_histogram", None)
    if histogram is None:
        return extras
    counts = histogram.numpy()
    centres = (np.arange(len(counts)) + 0.5) / len(counts)
    return {**extras, "gate": {"histogram": counts.tolist(),
                               "mean": float((counts * centres).sum() / max(counts.sum(), 1))}}


def scoring_protocol(model, datamodule, workdir: Workdir) -> Protocol:
    """How the head's valid/test scores were computed (``gnnlm.protocols``): the data module's
    own protocol for the model's memory, or, for heads that score the datastore's positions
    (features, graphs), the features' sliding windows."""
    own = getattr(datamodule, "scoring_protocol", None)
    if callable(own):
        return own(int(getattr(model, "memory_length", 0) or 0))
    return protocols.of_features(workdir.features_manifest("test"))


def head_logprobs(workdir: Workdir, name: str, split: str) -> np.ndarray:
    return np.asarray(open_array(workdir.head(name), f"{split}_logprob"))


def memory_rows(workdir: Workdir, name: str) -> list[dict]:
    """Transformer-XL short-term memory on and off: the memory LM trained as ``name`` on its
    test split, served as contiguous segments of parallel streams; the memory is carried, or
    dropped."""
    import pytorch_lightning as pl

    from datamodules.lm import LMDataModule

    ckpt = workdir.head(name) / "model.ckpt"
    model = load_language_model(ckpt)
    data = LMDataModule(**{**datamodule_args(ckpt), "workdir": str(workdir.root),
                           "segments": True})
    memory = model.memory_length
    rows = []
    for length in (memory, 0):
        model.memory_length = model.model.memory_length = length
        trainer = pl.Trainer(accelerator="auto", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        (metrics,) = trainer.test(model, datamodule=data, verbose=False)
        protocol = data.scoring_protocol(length)
        tokens = int(metrics["test/tokens"])
        rows.append({"row": f"Transformer-XL base LM, memory "
                            f"{f'M = {length}' if length else 'off'}",
                     "test_ppl": float(metrics["test/ppl"]), "tokens": tokens,
                     "segment": data.hparams.block_size, "protocol": protocol,
                     "mean_left_context": float(protocols.left_context(protocol, tokens).mean())})
    return rows


def load_language_model(ckpt: str | Path, hparams: Optional[dict] = None):
    """A ``gnnlm.lit.lm.LanguageModel`` from a checkpoint, read as plain data."""
    from gnnlm.lit.lm import LanguageModel

    checkpoint = load_checkpoint(ckpt)
    saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items()
             if not k.startswith("_")}
    model = LanguageModel(**{**saved, **(hparams or {})})
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


class _Parsed(Exception):
    """Raised by ``check_fit_config`` once LightningCLI has parsed, before it builds anything."""


def check_fit_config(configs: list[str]) -> None:
    """Parse ``gnnlm fit -c configs[0] -c configs[1] …`` without building anything: an unknown
    key, a typo'd class path or a value of the wrong type stops the pipeline before its slow
    stages, with one message naming the files."""
    import contextlib
    import io

    from gnnlm.cli import GnnlmCLI, quiet_lightning

    class ParseOnly(GnnlmCLI):
        def before_instantiate_classes(self) -> None:
            raise _Parsed()

    quiet_lightning()
    printed = io.StringIO()
    seed_log = logging.getLogger("lightning_fabric.utilities.seed")
    level, seed_log.level = seed_log.level, logging.WARNING  # no "Seed set" line per check
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
            ParseOnly(*_cli_bases(), subclass_mode_model=True, subclass_mode_data=True,
                      args=["fit", *(a for c in configs for a in ("-c", c))])
    except _Parsed:
        return
    except SystemExit:
        text = printed.getvalue()
        error = text[text.find("error:") + len("error:"):] if "error:" in text else text
        details = [line.strip() for line in error.splitlines()
                   if line.strip() and not line.strip().startswith(("Subtypes:", "- Expected a",
                                                                     "Given value"))]
        raise ValueError(f"The `gnnlm fit` config {' + '.join(configs)} does not parse: "
                         f"{' '.join(details)[:600]}") from None
    finally:
        seed_log.setLevel(level)


def _cli_bases():
    import pytorch_lightning as pl

    return pl.LightningModule, pl.LightningDataModule
