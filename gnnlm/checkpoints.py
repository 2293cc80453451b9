"""Reading ``gnnlm fit`` checkpoints safely: tensors and plain data only.

``torch.load(..., weights_only=False)`` would run any code pickled into a checkpoint file. Every
checkpoint here is read with ``weights_only=True``, which unpickles tensors, containers and
numbers, plus the few configuration classes of this package that the data modules save in their
hyper-parameters. Anything else is refused with a message that names the file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or holds something that is not plain data."""


def _allowed() -> list:
    # the configuration dataclasses that data modules take as arguments (saved as hparams)
    from gnnlm.graph import GraphConfig
    from gnnlm.tokens import TokenizerConfig

    return [TokenizerConfig, GraphConfig]


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint dict at ``path``, unpickled with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No checkpoint at {path}: give a .ckpt written by `gnnlm fit` "
                              f"(or hf:<name-or-folder> for a Hugging Face model).")
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle.UnpicklingError, or a truncated / foreign file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"Refusing to load {path}: it is not a checkpoint of plain "
                              f"tensors and data ({first[:300]}). Only load checkpoints you "
                              f"trust, written by `gnnlm fit`.") from None


def datamodule_args(path: str | os.PathLike) -> dict:
    """The data module's init arguments saved in a Lightning checkpoint (LightningCLI's own
    bookkeeping keys, such as ``_class_path``, left out)."""
    saved = load_checkpoint(path).get("datamodule_hyper_parameters", {})
    return {k: v for k, v in dict(saved).items() if not k.startswith("_")}


def model_state(checkpoint: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The weights under ``prefix`` (e.g. ``"model."``) of a Lightning state dict, unprefixed."""
    return {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items()
            if k.startswith(prefix)}
