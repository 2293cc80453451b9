"""What a built work directory serves: its report's rows and the settings fitted for them.

``gnnlm pipeline`` ends by writing ``reports/<name>/results.json``: every row it scored, and for
each interpolation what it fitted on valid (kNN-LM's k, T and λ; GNN+kNN's; a learned W_ds's λ
with the base LM). It is served only as written and only with the artifacts it was computed
from (``gnnlm.workdir.reports``): an edited report, or one the work directory's artifacts have
been rebuilt after, is refused. GNN-LM's evaluation k, chosen on valid, is in its model's manifest
(``gnnlm.inference.heads``). Those are a row's defaults here; any can be overridden per call
(``RowSettings``), and is checked as the pipeline's config checks it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from gnnlm.pipeline.precision import FLOAT32, scored_precision
from gnnlm.retrieval.settings import check_lambda, check_temperature
from gnnlm.workdir import rows
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError
from gnnlm.workdir.reports import check_report


class NotServed(ValueError):
    """A work directory, report or row that cannot be used: the message says what to do."""


@dataclass(frozen=True)
class RowSettings:
    """What a row reads besides its weights: kNN-LM's ``knn_k`` neighbours, ``knn_temperature``
    and the interpolation weight ``lam`` (of kNN-LM, GNN+kNN, or a learned W_ds with the base
    LM), and GNN-LM's ``gnn_k`` windows per token. None: the row does not read it."""
    knn_k: Optional[int] = None
    knn_temperature: Optional[float] = None
    lam: Optional[float] = None
    gnn_k: Optional[int] = None

    def override(self, **given: Any) -> RowSettings:
        """These settings with the ``given`` values that are not None, each checked; a value
        the row does not read is refused (it would change nothing)."""
        changes = {name: value for name, value in given.items() if value is not None}
        for name, value in changes.items():
            if getattr(self, name) is None:
                raise NotServed(f"{name} = {value} changes nothing here: the row does not read "
                                f"it (it reads {', '.join(self.read()) or 'none of them'}).")
        out = dataclasses.replace(self, **changes)
        if out.knn_temperature is not None:
            check_temperature(out.knn_temperature)
        if out.lam is not None:
            check_lambda(out.lam)
        for name in ("knn_k", "gnn_k"):
            value = getattr(out, name)
            if value is not None and (int(value) != value or value < 1):
                raise NotServed(f"{name} must be a positive integer (got {value}).")
        return out

    def knn(self) -> tuple[int, float]:
        """kNN-LM's ``(k, T)``, for a row that reads them."""
        if self.knn_k is None or self.knn_temperature is None:
            raise NotServed("this row has no kNN-LM part.")
        return int(self.knn_k), float(self.knn_temperature)

    @property
    def weight(self) -> float:
        """The interpolation weight λ, for a row that has one."""
        if self.lam is None:
            raise NotServed("this row is not an interpolation.")
        return float(self.lam)

    def read(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]


def find_report(workdir: Workdir, report: Optional[str]) -> Path:
    """``reports/<report>/results.json`` (None: the one report; of several, none is guessed)."""
    if not workdir.root.is_dir():
        raise NotServed(f"{workdir.root} does not exist: give the work directory a `gnnlm "
                        f"pipeline` run built (its config's `workdir`).")
    if report is not None:
        path = workdir.report(report) / "results.json"
        if not path.is_file():
            names = sorted(p.parent.name for p in workdir.root.glob("reports/*/results.json"))
            raise NotServed(f"{workdir.root} has no report {report!r} (it has "
                            f"{', '.join(names) or 'none'}).")
        return path
    found: list[Path] = sorted(workdir.root.glob("reports/*/results.json"))
    if not found:
        raise NotServed(f"{workdir.root} is not a built gnnlm work directory: it holds no "
                        f"reports/<name>/results.json. Run `gnnlm pipeline` with the config "
                        f"whose `workdir` it is, to the end, then use it.")
    if len(found) > 1:  # the newest need not describe what the work directory holds: ask
        raise NotServed(f"{workdir.root} holds several reports "
                        f"({', '.join(p.parent.name for p in found)}): name the one to serve "
                        f"(report= in gnnlm.load, --report on the command line).")
    return found[0]


class ServedRow:
    """A row of the report, its name parsed once (``rows.row``) when the report is read: the
    registry's ``Row`` (its head, the head's folder, kNN-LM or not, interpolation or not), and,
    each read when first asked for, the retrieval its kNN-LM part reads and the precision it was
    scored in. Everything below the door (``TrainedLM``'s methods, the command line) takes this,
    never the name again."""

    def __init__(self, served: Served, row: rows.Row):
        self.served, self.row = served, row

    def __repr__(self) -> str:
        return f"ServedRow({self.name!r})"

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def head(self) -> Optional[str]:
        """The trained row whose model scores this row's tokens (None: the base LM alone)."""
        return self.row.head

    @property
    def folder(self) -> str:
        """The ``models/`` folder of the head this row reads (``gnn+knn``: ``gnn``)."""
        if self.row.folder is None:
            raise NotServed(f"row {self.name!r} reads no trained model: the base LM scores it.")
        return self.row.folder

    def fitted(self, gnn_k: Optional[int] = None) -> RowSettings:
        """The row's defaults: what the pipeline fitted on valid (``gnn_k``: the GNN-LM's
        chosen evaluation k, for rows that read GNN-LM)."""
        fitted = self.served.hparams.get(self.name, {})
        return RowSettings(
            knn_k=fitted.get("k"), knn_temperature=fitted.get("temperature"),
            lam=fitted.get("lambda"), gnn_k=gnn_k if self.head == rows.GNN else None)

    @cached_property
    def precision(self) -> str:
        """The precision the report scored the row in (``gnnlm.pipeline.precision``): as the
        report records it, or for a report written before it did, as its head's manifest says."""
        recorded = self.served.results.get("precisions", {}).get(self.name)
        if recorded is not None:
            return str(recorded)
        if self.head is None:
            return FLOAT32
        return scored_precision(read_manifest(self.served.workdir.model(self.folder),
                                              kind="trained_model"))

    @cached_property
    def retrieval(self) -> tuple[str, str, str]:
        """``(key, metric, scores)`` of the kNN-LM the row interpolates with."""
        fitted = self.served.hparams[self.name]
        key, metric = fitted["key"], fitted["similarity"]
        scores = fitted.get("knn_scores")
        if scores is None:  # a report written before it recorded the cache's setting
            caches = sorted(self.served.workdir.root.glob(f"knn_cache/{key}-{metric}-*/test"))
            if len(caches) != 1:
                raise NotServed(f"{self.served.path} does not say which kNN cache its "
                                f"{self.name!r} row read: rerun `gnnlm pipeline` (the finished "
                                f"stages are reused) to record it.")
            scores = read_manifest(caches[0], kind="knn_cache")["scores"]
        return key, metric, scores


class Served:
    """The rows of a work directory's report and their fitted settings.

    ``rows``: every row the report scored, in table order; ``row(name)``: that row as served
    (``ServedRow``), parsed once here.
    """

    def __init__(self, workdir: Workdir, report: Optional[str] = None):
        self.workdir = workdir
        self.path = find_report(workdir, report)
        self.name = self.path.parent.name
        try:  # sealed, and made from the artifacts the work directory holds now
            self.results = check_report(self.path, workdir.root)
        except ArtifactError as err:
            raise NotServed(str(err)) from None
        try:
            features = workdir.features_manifest("train")
        except ArtifactError as err:
            raise NotServed(f"{err} The report {self.path} needs its work directory's "
                            f"features.") from None
        if self.results["base_lm"]["fingerprint"] != features["base_lm"]["fingerprint"]:
            raise NotServed(f"{self.path} was written for base LM weights "
                            f"{self.results['base_lm']['fingerprint']}, but the features in "
                            f"{workdir.root} are of {features['base_lm']['fingerprint']}: rerun "
                            f"`gnnlm pipeline` on it so that the report describes its models.")
        self.hparams: dict = self.results.get("hparams", {})
        self._rows = {name: ServedRow(self, rows.row(name))
                      for name in rows.order(self.results["ppl"])}
        self.rows: list[str] = list(self._rows)

    def row(self, name: str) -> ServedRow:
        """The report's row ``name``, as served."""
        if name not in self._rows:
            raise NotServed(f"{self.workdir.root} has no row {name!r}; its rows are "
                            f"{', '.join(self.rows)}.")
        return self._rows[name]
