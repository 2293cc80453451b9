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
  W_ds with the base LM (``<head>+base``).

The results.json keys are these names; tables list them in ``ROWS`` order (each ``knn[<key>]``
after ``knn``, rows of no fixed place such as ``learned_wds…`` sorted at the end). Plain Python:
the config module reads it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Row:
    """One report row. ``head``: trained by ``gnnlm fit`` and configured by the pipeline
    config's field ``name``. ``interpolation``: a mixture fitted on valid, not a model of its
    own. ``spalm_baseline``: a SPALM row, whose gate and frequency analyses compare it with
    that row on the same tokens. ``fixed``: the row has its place in the tables' order (a
    family such as ``learned_wds…`` is sorted at the end)."""
    name: str
    label: str
    head: bool = False
    interpolation: bool = False
    spalm_baseline: Optional[str] = None
    fixed: bool = True


BASE = "base"
KNN = "knn"
GNN = "gnn"
GNN_KNN = "gnn+knn"
LEARNED_WDS = "learned_wds"

ROWS: tuple[Row, ...] = (
    Row(BASE, "base LM"),
    Row(KNN, "+kNN", interpolation=True),
    Row(GNN, "+GNN", head=True),
    Row(GNN_KNN, "+GNN+kNN", interpolation=True),
    Row("spalm", "SPALM: gate on frozen LM", head=True, spalm_baseline=BASE),
    Row("spalm_ft", "SPALM: gate + last block", head=True, spalm_baseline=BASE),
    Row("transformer", "transformer (no memory)", head=True),
    Row("transformer_xl", "Transformer-XL (short-term memory)", head=True),
    Row("spalm_xl", "SPALM (short + long-term memory)", head=True,
        spalm_baseline="transformer_xl"),
    # its options are named after it, from the head's manifest (``label``'s ``deviations``)
    Row("spalm_xl_variant", "SPALM (short + long-term memory)", head=True,
        spalm_baseline="transformer_xl"),
    # one row per config: ``learned_wds``, ``learned_wds[n=…]``; labelled by ``label``
    Row(LEARNED_WDS, "learned W_ds", head=True, fixed=False),
)
BY_NAME = {row.name: row for row in ROWS}

# the pipeline config's fields of trained heads, in table order (each a ``HeadConfig`` but
# ``learned_wds``, a list of configs); ``--rebuild`` names a head by its row
HEAD_FIELDS: tuple[str, ...] = tuple(row.name for row in ROWS if row.head)
HEAD_CONFIGS: tuple[str, ...] = tuple(name for name in HEAD_FIELDS if name != LEARNED_WDS)
# the SPALM rows and the row each is compared with (Yogatama et al. 2021, §5)
SPALM_BASELINES: dict[str, str] = {row.name: row.spalm_baseline for row in ROWS
                                   if row.spalm_baseline is not None}


def knn_row(key: str, primary: str) -> str:
    """The kNN-LM row of ``key``: ``knn`` for the primary key, ``knn[<key>]`` for another."""
    return KNN if key == primary else f"{KNN}[{key}]"


def with_base(head: str) -> str:
    """The row of ``head`` interpolated with the base LM (Xu et al. 2023 §4.1)."""
    return f"{head}+{BASE}"


def learned_wds_row(position: int, embeddings_per_word: int) -> str:
    """The row of the ``position``-th learned W_ds config: the first is ``learned_wds``, the
    others are named by their embeddings per word, ``learned_wds[n=3]``."""
    return LEARNED_WDS if position == 0 else f"{LEARNED_WDS}[n={embeddings_per_word}]"


def model_folder(row: str) -> str:
    """The name of a head row's folder under ``models/`` (no brackets in paths):
    ``learned_wds[n=3]`` → ``learned_wds_n3``."""
    return row.replace("[n=", "_n").rstrip("]")


def head_of(name: str) -> str:
    """The row whose model scored ``name``'s tokens: the row itself, or for an interpolation
    with kNN-LM or the base LM (``gnn+knn``, ``learned_wds+base``) its head."""
    return name.split("+")[0]


def is_interpolation(name: str) -> bool:
    """Whether ``name`` is a mixture fitted on valid: ``knn``, ``knn[<key>]``, ``gnn+knn``,
    ``<head>+base``."""
    row = BY_NAME.get(name)
    return (row.interpolation if row is not None else
            name.startswith(f"{KNN}[") or "+" in name)


def is_spalm(name: str) -> bool:
    """Whether ``name`` is a SPALM row (a gate over retrieved values)."""
    return name in SPALM_BASELINES


def order(names: Iterable[str]) -> list[str]:
    """``names`` in table order: the registry's fixed rows, each ``knn[<key>]`` (sorted) after
    ``knn``, then every other row sorted."""
    names = list(names)
    placed: list[str] = []
    for row in ROWS:
        if not row.fixed:
            continue
        placed.append(row.name)
        if row.name == KNN:
            placed += sorted(n for n in names if n.startswith(f"{KNN}["))
    return ([n for n in placed if n in names] + sorted(n for n in names if n not in placed))


def label(name: str, deviations: Optional[list[str]] = None) -> str:
    """How a row reads in a table; ``deviations`` (the options on that depart from the model's
    paper) are named after it: "SPALM (…) (+memory scale)"."""
    if deviations:
        return f"{label(name)} ({', '.join('+' + d for d in deviations)})"
    if name in BY_NAME and BY_NAME[name].fixed:
        return BY_NAME[name].label
    if name.startswith(f"{KNN}["):
        return f"{BY_NAME[KNN].label}, {name[len(KNN) + 1:-1]} keys"
    if name.startswith(LEARNED_WDS):
        head, _, interpolated = name.partition("+")
        n = head[len(LEARNED_WDS):].strip("[]").replace("n=", "n = ") or None
        text = BY_NAME[LEARNED_WDS].label + (f" ({n})" if n else "")
        return f"{BY_NAME[BASE].label} + {text}" if interpolated else f"{text} alone"
    return name
