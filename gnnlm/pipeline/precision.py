"""The precision each report row was scored in, and the autocast that serves it the same way.

A trained head's valid and test scores come from ``predict`` under its training run's trainer
precision (``gnnlm.pipeline.scoring``): ``bf16-mixed`` autocast under
``configs/trainer/gpu.yaml``, ``32-true`` under ``configs/trainer/cpu.yaml``. The base LM's
features and log-probabilities are encoded in float32 whatever the preset, so the base LM and
kNN-LM on it are float32 rows; an interpolation with a head (``gnn+knn``, ``<head>+base``) is
its head's. bf16 and float32 scores of one GNN-LM differ by up to 0.06 nats per token, so
``gnnlm.inference`` serves each row under the autocast it was scored in (``served_in``): then
``gnnlm score`` on a split's tokens gives the report's numbers.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from gnnlm.workdir import rows

if TYPE_CHECKING:  # torch is imported where a row is served, not where a report is written
    import torch

FLOAT32 = "32-true"

# Lightning's names of each precision that autocast serves (``Trainer(precision=...)``)
AUTOCAST = {"bf16-mixed": "bfloat16", "bf16": "bfloat16", "16-mixed": "float16", "16": "float16"}
# precisions served in float32: float32 itself, and float64, whose float32 scores differ from
# it only by float32 rounding
NO_AUTOCAST = ("32-true", "32", "64-true", "64")


def scored_precision(manifest: Mapping[str, Any]) -> str:
    """The precision a trained head's ``predict`` scored in: its manifest's ``precision``; for
    a head scored before that was recorded, its recorded config's trainer precision (``predict``
    has always run under it); float32 where neither says."""
    if manifest.get("precision") is not None:
        return str(manifest["precision"])
    config = ((manifest.get("config") or {}).get("values") or {}).get("trainer") or {}
    return FLOAT32 if config.get("precision") is None else str(config["precision"])


def row_precision(name: str, heads: Mapping[str, Mapping[str, Any]]) -> str:
    """The precision report row ``name`` was scored in: its head's (``heads``: trained heads'
    manifests by row), float32 for the base LM and kNN-LM on it."""
    head: Optional[str] = rows.row(name).head
    return scored_precision(heads[head]) if head is not None and head in heads else FLOAT32


def served_in(precision: str, device: str = "cpu") -> torch.autocast:
    """The autocast region that computes as ``precision`` did (float32: autocast off, also
    inside a caller's own autocast)."""
    import torch

    name = str(precision)
    if name in AUTOCAST:
        return torch.autocast(device, dtype=getattr(torch, AUTOCAST[name]))
    if name in NO_AUTOCAST:
        return torch.autocast(device, enabled=False)
    raise ValueError(f"a row scored in precision {name!r} cannot be served the same way: train "
                     f"its head under one of {', '.join([*NO_AUTOCAST, *AUTOCAST])}.")
