"""The report's rows: one registry of their names, table labels, order and kinds.

A row is one model's per-token scores of the same test tokens. Three kinds:

- the frozen base LM (``base``);
- trained heads and LMs (``gnnlm fit``), each configured by the pipeline config's field of the
  same name: GNN-LM (Meng et al. 2022), SPALM's gate on the frozen LM and with its last block
  fine-tuned, SPALM trained end to end with its transformer and Transformer-XL baselines
  (Yogatama et al. 2021; Dai et al. 2019), learned W_ds (Xu et al. 2023: one row per config,
  ``learned_wds`` then ``learned_wds[n=…]``);
- interpolations fitted on valid: kNN-LM (Khandelwal et al. 2020) over the primary key
  (``knn``) and over other keys (``knn[<key>]``), GNN-LM with kNN-LM (``gnn+knn``), a learned
  W_ds with the base LM (``<head>+base``), kNN-LM with each Transformer-XL row of the SPALM
  comparison (``<head>+knn``, and ``<head>+knn[k=4]`` at SPALM's k): what retrieval can add
  to that LM at all, the ceiling SPALM is measured against.

The results.json keys are these names; tables list them in ``ROWS`` order (each ``knn[<key>]``
after ``knn``, rows of no fixed place such as ``learned_wds…`` sorted at the end). A name is all
a report keeps of a row, so ``row(name)`` gives back the whole ``Row``, with the head that
scored it and that head's folder under ``models/``: the families of names (``knn[<key>]``,
``learned_wds[n=…]``, ``<head>+base``) are made and read back here, next to each other, and
nowhere else, and so is the way back from a folder to its row (``of_folder``: what
``--rebuild`` names a trained part by). Plain Python, at the bottom of the stack with the folders
it names: the config, the refusals that say what to rebuild, the report and the served rows read
it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Row:
    """One report row. ``trained``: trained by ``gnnlm fit`` and configured by the pipeline
    config's field ``name``. ``interpolation``: a mixture fitted on valid, not a model of its
    own. ``head``: the trained row whose model scored this row's tokens (the row itself, or what
    an interpolation mixes: ``gnn`` for ``gnn+knn``); None where only the base LM did (``base``,
    ``knn``). ``folder``: that head's folder under ``models/`` (no brackets in paths:
    ``learned_wds[n=3]`` → ``learned_wds_n3``). ``knn``: an interpolation with kNN-LM (over the
    base LM when ``head`` is None, else over that head). ``spalm_baseline``: a SPALM row, whose
    gate and frequency analyses compare it with that row on the same tokens. ``fixed``: the row
    has its place in the tables' order (a family such as ``learned_wds…`` is sorted at the end)."""
    name: str
    label: str
    trained: bool = False
    interpolation: bool = False
    knn: bool = False
    head: Optional[str] = None
    folder: Optional[str] = None
    spalm_baseline: Optional[str] = None
    fixed: bool = True

    @property
    def on_base_lm(self) -> bool:
        """Scored by the base LM alone, or with kNN-LM: no trained model is read."""
        return self.head is None

    @property
    def is_knn_lm(self) -> bool:
        """kNN-LM itself, on the base LM (``knn``, ``knn[<key>]``), not over a head."""
        return self.knn and self.on_base_lm


def trained_row(name: str, label: str, folder: Optional[str] = None, **kinds: Any) -> Row:
    """A trained row: its own head, in ``models/<folder>`` (``name`` unless given)."""
    return Row(name, label, trained=True, head=name, folder=folder or name, **kinds)


BASE = "base"
KNN = "knn"
GNN = "gnn"
GNN_KNN = "gnn+knn"
LEARNED_WDS = "learned_wds"

ROWS: tuple[Row, ...] = (
    Row(BASE, "base LM"),
    Row(KNN, "+kNN", interpolation=True, knn=True),
    trained_row(GNN, "+GNN"),
    Row(GNN_KNN, "+GNN+kNN", interpolation=True, knn=True, head=GNN, folder=GNN),
    trained_row("spalm", "SPALM: gate on frozen LM", spalm_baseline=BASE),
    trained_row("spalm_ft", "SPALM: gate + last block", spalm_baseline=BASE),
    trained_row("transformer", "transformer (no memory)"),
    trained_row("transformer_xl", "Transformer-XL (short-term memory)"),
    trained_row("spalm_xl", "SPALM (short + long-term memory)", spalm_baseline="transformer_xl"),
    # its options are named after it, from the head's manifest (``label``'s ``deviations``)
    trained_row("spalm_xl_variant", "SPALM (short + long-term memory)",
                spalm_baseline="transformer_xl"),
    # the same pair trained from random initial weights
    trained_row("transformer_xl_scratch", "Transformer-XL (from scratch)"),
    trained_row("spalm_xl_scratch", "SPALM (short + long-term memory, from scratch)",
                spalm_baseline="transformer_xl_scratch"),
    # one row per config: ``learned_wds``, ``learned_wds[n=…]`` (``learned_wds_row``)
    trained_row(LEARNED_WDS, "learned W_ds alone", fixed=False),
)
BY_NAME = {row.name: row for row in ROWS}

# the pipeline config's fields of trained heads, in table order (each a ``HeadConfig`` but
# ``learned_wds``, a list of configs); ``--rebuild`` names a head by its row
HEAD_FIELDS: tuple[str, ...] = tuple(row.name for row in ROWS if row.trained)
HEAD_CONFIGS: tuple[str, ...] = tuple(name for name in HEAD_FIELDS if name != LEARNED_WDS)
# the SPALM rows and the row each is compared with (Yogatama et al. 2021, §5)
SPALM_BASELINES: dict[str, str] = {row.name: row.spalm_baseline for row in ROWS
                                   if row.spalm_baseline is not None}

# the Transformer-XL rows whose kNN-LM interpolations bound what SPALM's retrieval can add
KNN_CEILING_HEADS: tuple[str, ...] = ("transformer_xl", "transformer_xl_scratch")
# SPALM's k and its kNN-LM baseline's (Yogatama et al. 2021, §4 and Table 5)
SPALM_K = 4

_KNN_KEY = re.compile(rf"{KNN}\[(?P<key>[^\]]+)\]")
_LEARNED_WDS_N = re.compile(rf"{LEARNED_WDS}\[n=(?P<n>\d+)\]")
_WITH_BASE = f"+{BASE}"
_WITH_KNN = re.compile(rf"(?P<head>[a-z_]+)\+{KNN}(\[k=(?P<k>\d+)\])?")


def knn_row(key: str, primary: str) -> str:
    """The kNN-LM row of ``key``: ``knn`` for the primary key, ``knn[<key>]`` for another."""
    return KNN if key == primary else f"{KNN}[{key}]"


def with_base(head: str) -> str:
    """The row of ``head`` interpolated with the base LM (Xu et al. 2023 §4.1)."""
    return f"{head}{_WITH_BASE}"


def with_knn(head: str, k: Optional[int] = None) -> str:
    """The row of ``head`` interpolated with kNN-LM: (k, T, λ) fitted on valid, or with k
    fixed (``<head>+knn[k=4]``)."""
    return f"{head}+{KNN}" if k is None else f"{head}+{KNN}[k={k}]"


def learned_wds_row(position: int, embeddings_per_word: int) -> str:
    """The row of the ``position``-th learned W_ds config: the first is ``learned_wds``, the
    others are named by their embeddings per word, ``learned_wds[n=3]``."""
    return LEARNED_WDS if position == 0 else f"{LEARNED_WDS}[n={embeddings_per_word}]"


def row(name: str) -> Row:
    """The row called ``name``: a registry row, or one of the families the functions above
    name (``knn[<key>]``, ``learned_wds[n=…]``, ``<head>+base``). A name of none of them is a
    row of no known kind, labelled by its name."""
    if name in BY_NAME:
        return BY_NAME[name]
    if name.endswith(_WITH_BASE):
        head = row(name[:-len(_WITH_BASE)])
        if head.trained:
            return Row(name, f"{BY_NAME[BASE].label} + {head.label.removesuffix(' alone')}",
                       interpolation=True, head=head.head, folder=head.folder, fixed=False)
    if (match := _WITH_KNN.fullmatch(name)) and row(match["head"]).trained:
        head = row(match["head"])
        fixed_k = f" (k = {match['k']})" if match["k"] else ""
        return Row(name, f"{head.label} + kNN-LM{fixed_k}", interpolation=True, knn=True,
                   head=head.head, folder=head.folder, fixed=False)
    if match := _KNN_KEY.fullmatch(name):
        return Row(name, f"{BY_NAME[KNN].label}, {match['key']} keys", interpolation=True,
                   knn=True, fixed=False)
    if match := _LEARNED_WDS_N.fullmatch(name):
        n = match["n"]
        return trained_row(name, f"learned W_ds (n = {n}) alone",
                           folder=f"{LEARNED_WDS}_n{n}", fixed=False)
    return Row(name, name, fixed=False)


_LEARNED_WDS_FOLDER = re.compile(rf"{LEARNED_WDS}_n(?P<n>\d+)")


def of_folder(folder: str) -> Optional[str]:
    """The trained row whose head ``models/<folder>`` holds (``learned_wds_n3`` →
    ``learned_wds[n=3]``); None for a folder of no row (the base LM's, ``base_lm``)."""
    if folder in BY_NAME and BY_NAME[folder].trained:
        return folder
    if match := _LEARNED_WDS_FOLDER.fullmatch(folder):
        return f"{LEARNED_WDS}[n={match['n']}]"
    return None


def model_folder(name: str) -> str:
    """The folder under ``models/`` of the trained row ``name`` (``learned_wds[n=3]`` →
    ``learned_wds_n3``)."""
    folder = row(name).folder
    if folder is None:
        raise ValueError(f"{name!r} is not a trained row: it has no folder under models/.")
    return folder


def is_spalm(name: str) -> bool:
    """Whether ``name`` is a SPALM row (a gate over retrieved values)."""
    return name in SPALM_BASELINES


def order(names: Iterable[str]) -> list[str]:
    """``names`` in table order: the registry's fixed rows, each ``knn[<key>]`` (sorted) after
    ``knn`` and each ``<head>+knn…`` after its head, then every other row sorted."""
    names = list(names)
    placed: list[str] = []
    for fixed in ROWS:
        if not fixed.fixed:
            continue
        placed.append(fixed.name)
        if fixed.name == KNN:
            placed += sorted(n for n in names if _KNN_KEY.fullmatch(n))
        placed += sorted(n for n in names if n not in BY_NAME and
                         (m := _WITH_KNN.fullmatch(n)) is not None and m["head"] == fixed.name)
    return ([n for n in placed if n in names] + sorted(n for n in names if n not in placed))


def label(name: str, deviations: Optional[list[str]] = None) -> str:
    """How a row reads in a table; ``deviations`` (the options on that depart from the model's
    paper) are named after it: "SPALM (…) (+memory scale)"."""
    text = row(name).label
    return f"{text} ({', '.join('+' + d for d in deviations)})" if deviations else text
