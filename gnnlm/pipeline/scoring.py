"""Scoring a trained head on exactly the report's tokens: predict over valid and test, the
evaluation k chosen on valid, the protocol the scores were computed under, and the extras the
manifest keeps beside them (``gnnlm.pipeline.training`` calls these once a head is trained).

A model or data module may offer hooks the scoring reads (``Deviations``, ``ReportExtras``,
``OwnScoringProtocol``): each is a ``typing.Protocol``, checked with ``isinstance``, so what a
new head may provide is written down in one place.
"""
from __future__ import annotations

import time
import typing

import numpy as np
import torch

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.utils.metrics import check_finite, ppl_from_logprobs
from gnnlm.utils.progress import format_seconds, say
from gnnlm.utils.quiet import quiet_lightning
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.refusals import changed_hint

if typing.TYPE_CHECKING:  # Lightning's names of a precision ("32-true", "bf16-mixed", ...)
    from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT as Precision


@typing.runtime_checkable
class Deviations(typing.Protocol):
    """A model whose options may depart from its paper: ``deviations()`` names those on (the
    report puts them in the row's label)."""

    def deviations(self) -> list[str]: ...


@typing.runtime_checkable
class ReportExtras(typing.Protocol):
    """A model that says what its manifest keeps beside its scores (SPALM end to end: its
    settings and k curve)."""

    def report_extras(self) -> dict: ...


@typing.runtime_checkable
class OwnScoringProtocol(typing.Protocol):
    """A data module that serves its own protocol for a model's memory (segments of parallel
    streams), instead of the features' sliding windows."""

    def scoring_protocol(self, memory_length: int) -> Protocol: ...


def predict_tokens(model, datamodule, split: str, n: int, precision: Precision = "32-true",
                   progress: bool = True, inference_mode: bool = True,
                   accelerator: str = "auto") -> dict[str, np.ndarray]:
    """What ``predict`` gives for every position of ``split``, in position order, as float32
    ``[n]`` arrays by name: ``logprob`` (log p(target)) and any other per-token value of the
    model's predict outputs (SPALM: ``gate``), on one device with the training run's precision.

    This is the one path of every per-token score of a trained head: the report's valid and
    test, and a text's (``gnnlm score``: ``split`` is ``datamodules.splits.TEXT``, the text
    given to the data module beforehand). The split is given to the data module (``connect``),
    which serves it; a model that needs to know it reads it from the batches. With
    ``progress`` the pass prints its progress (tokens, tokens/s, ETA: ``PredictProgress``),
    naming the evaluation k of a GNN-LM data module. ``inference_mode=False`` runs it under
    ``no_grad`` instead, so that what the model keeps (GNN-LM's window states) can be updated
    in place outside it afterwards. ``accelerator``: Lightning's, ``auto`` (a GPU when there is
    one) for the pipeline's reports, ``cpu`` for ``gnnlm.load``, which serves every part of a
    work directory on the CPU."""
    import pytorch_lightning as pl

    from gnnlm.lit.predict_progress import PredictProgress

    datamodule.connect(predict_split=split)
    k = getattr(datamodule, "eval_k", None)
    desc = f"score {type(model).__name__} {split}" + (f" at k = {k}" if k else "")
    quiet_lightning()  # no device banner before each pass: every Trainer would say it
    trainer = pl.Trainer(accelerator=accelerator, devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         precision=precision,
                         inference_mode=inference_mode,
                         callbacks=[PredictProgress(n, desc)] if progress else [])
    # one predict loader: a list of the batches' outputs, each a dict of tensors by name
    outputs = typing.cast(list[dict[str, torch.Tensor]],
                          trainer.predict(model, datamodule=datamodule))
    positions = torch.cat([o["positions"] for o in outputs]).numpy()
    scored = np.zeros(n, dtype=bool)
    scored[positions] = True
    if len(positions) != n or not scored.all():
        raise RuntimeError(f"predict on {split} scored {len(positions)} positions, expected each "
                           f"of the {n} exactly once: the evaluation data module must partition "
                           f"the split (no eval_tokens limit for reports).")
    arrays: dict[str, np.ndarray] = {}
    for name in (key for key in outputs[0] if key != "positions"):
        values = np.full(n, np.nan, dtype=np.float32)
        values[positions] = torch.cat([o[name] for o in outputs]).numpy()
        arrays[name] = values
    check_finite(arrays["logprob"], f"{type(model).__name__}'s predicted {split} log p(target)",
                 "the model gives that target probability 0 or NaN (weights with inf/NaN, or an "
                 "overflow at this precision): check its training run, or train in 32-bit.")
    return arrays


def predict_logprobs(model, datamodule, split: str, n: int, precision: Precision = "32-true"
                     ) -> np.ndarray:
    """Log p(target) for every position of ``split``, in position order (``predict_tokens``)."""
    return predict_tokens(model, datamodule, split, n, precision)["logprob"]


def choose_eval_k(model, datamodule, n_valid: int, precision: Precision = "32-true"
                  ) -> tuple[dict, np.ndarray]:
    """Score valid with each of the data module's ``eval_ks`` windows per token and keep the
    best, as kNN-LM's k is chosen on valid (GNN-LM's k is a property of the graph, not of the
    weights: a model trained with k windows reads any number). Connects the data module to it
    (``connect(eval_k=...)``) and returns ``({"valid_ppl": {k: ppl}, "seconds": {k: s},
    "chosen": k}, valid log p at the
    chosen k)``."""
    curve, seconds, best = {}, {}, None
    ks = sorted(set(datamodule.hparams.eval_ks))
    for i, k in enumerate(ks):
        datamodule.connect(eval_k=k)
        say(f"[gnnlm] scoring valid at evaluation k = {k} ({i + 1} of {len(ks)}: "
            f"{', '.join(map(str, ks))})")
        t0 = time.perf_counter()
        logprob = predict_logprobs(model, datamodule, "valid", n_valid, precision)
        seconds[k] = round(time.perf_counter() - t0, 2)
        curve[k] = ppl_from_logprobs(logprob)
        say(f"  valid at k = {k}: ppl {curve[k]:.2f} ({format_seconds(seconds[k])})")
        if best is None or curve[k] < curve[best[0]]:
            best = (k, logprob)
    assert best is not None
    datamodule.connect(eval_k=best[0])
    say("[gnnlm] valid ppl by evaluation k: " + ", ".join(
        f"{k}: {ppl:.2f} ({seconds[k]:.0f} s)" for k, ppl in curve.items())
        + f"; chosen k = {best[0]}")
    return ({"valid_ppl": {str(k): v for k, v in curve.items()},
             "seconds": {str(k): v for k, v in seconds.items()}, "chosen": best[0]}, best[1])


def predict_extras(model) -> dict:
    """Per-model extras saved in the manifest beside the scores (a ``ReportExtras`` model says
    its own: SPALM end to end its settings and k curve) and, under ``deviations``, the options
    on that depart from the model's paper (a ``Deviations`` model's ``deviations()``), which the
    report names in the row's label."""
    deviations = model.deviations() if isinstance(model, Deviations) else []
    extras: dict = {"deviations": deviations} if deviations else {}
    if isinstance(model, ReportExtras):
        return {**model.report_extras(), **extras}
    return extras


def scoring_protocol(model, datamodule, workdir: Workdir) -> Protocol:
    """How the head's valid/test scores were computed (``gnnlm.models.protocols``): the data
    module's own protocol for the model's memory (``OwnScoringProtocol``), or, for heads that
    score the datastore's positions (features, graphs), the features' sliding windows."""
    if isinstance(datamodule, OwnScoringProtocol):
        return datamodule.scoring_protocol(int(getattr(model, "memory_length", 0) or 0))
    return protocols.of_features(workdir.features_manifest("test"))


def head_logprobs(workdir: Workdir, name: str, split: str) -> np.ndarray:
    """A head's saved log p(target) of ``split``, refused when a value is inf or NaN."""
    path = workdir.model(name)
    manifest = read_manifest(path)
    values = np.asarray(open_array(path, f"{split}_logprob", manifest))
    file = path / manifest["arrays"][f"{split}_logprob"]["file"]
    check_finite(values, str(file), changed_hint(path, "trained_model"))
    return values

