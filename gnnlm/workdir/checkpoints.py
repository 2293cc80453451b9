"""Reading ``gnnlm fit`` checkpoints safely: tensors and plain data only.

``torch.load(..., weights_only=False)`` would run any code pickled into a checkpoint file. Every
checkpoint here is read with ``weights_only=True``, which unpickles tensors, containers and
numbers, plus the few configuration classes of this package that the data modules save in their
hyper-parameters. Anything else is refused with a message that names the file.

Those classes mark themselves ``@checkpoint_safe`` where they are defined, in light settings
modules that import nothing heavy (the ``gnnlm`` package imports them first, so the registry is
full before any checkpoint is read); this module knows none of them and imports nothing of the
package. A class that moved keeps loading from older checkpoints, which pickled it under its
former module path, by naming that path too.
"""
from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

if TYPE_CHECKING:
    import torch

C = TypeVar("C", bound=type)
# what torch.serialization.safe_globals takes: a class, or (class, the name a pickle uses)
SafeGlobal = Union[Callable[..., Any], tuple[Callable[..., Any], str]]
_SAFE: list[SafeGlobal] = []


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or holds something that is not plain data."""


def checkpoint_safe(*former_names: str) -> Callable[[C], C]:
    """Class decorator: checkpoints may hold instances of this plain configuration class (a
    data module's argument, saved in its hyper-parameters). ``former_names``: the dotted paths
    (``package.module.Class``) it was pickled under before it moved."""
    def register(cls: C) -> C:
        _SAFE.append(cls)
        _SAFE.extend((cls, name) for name in former_names)
        return cls

    return register


def plain_classes() -> list[SafeGlobal]:
    """The classes besides tensors and plain data that a checkpoint of this package may hold
    (``checkpoint_safe``), as ``torch.serialization.safe_globals`` takes them."""
    return list(_SAFE)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint dict at ``path``, unpickled with ``weights_only=True``. A zip archive (what
    ``torch.save`` writes) is memory-mapped: reading its hyper-parameters, as the checks at load
    do, does not read its weights."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No checkpoint at {path}: give a .ckpt written by `gnnlm fit` "
                              f"(or hf:<name-or-folder> for a Hugging Face model).")
    import torch

    try:
        with torch.serialization.safe_globals(plain_classes()):
            return torch.load(path, map_location="cpu", weights_only=True,
                              mmap=zipfile.is_zipfile(path))
    except Exception as err:  # pickle.UnpicklingError, or a truncated / foreign file
        raise CheckpointError(f"Refusing to load {path}: {_what_it_is_not(path, err)}") from None


def _what_it_is_not(path: Path, err: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in the file's terms. PyTorch's
    own message advises loading again with ``weights_only=False``, which would run whatever
    the file pickles: that advice is left out, and only the reason is kept."""
    with open(path, "rb") as f:
        head = f.read(8)
    fix = "Give a .ckpt written by `gnnlm fit`."
    text = str(err)
    if not head:
        return f"the file is empty. {fix}"
    if head.startswith(b"PK") and re.search(r"zip archive|central directory", text):
        return ("its zip archive is truncated or corrupt (the file was not written to the end, "
                "or was damaged in a copy). Copy it again, or train it again with `gnnlm fit`.")
    if head.startswith(b"version "):  # a Git LFS pointer file in place of the checkpoint
        return "it is a Git LFS pointer, not the checkpoint: fetch the file (git lfs pull)."
    if not head.startswith((b"PK", b"\x80")):  # torch.save writes a zip archive or a pickle
        return (f"it is not a PyTorch checkpoint (neither the zip archive nor the pickle that "
                f"torch.save writes; it begins with {head!r}). {fix}")
    found = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", text)
    if found:
        return (f"it pickles {found.group(1)}, which is neither a tensor nor plain data: "
                f"unpickling it would import and call it. {fix}")
    reason = " ".join(line.strip() for line in text.splitlines() if line.strip() and not (
        line.strip().startswith(("Weights only load failed", "Please file an issue",
                                 "Check the documentation", "(1)", "(2)"))))
    reason = re.sub(r"^WeightsUnpickler error:\s*", "", reason) or type(err).__name__
    return f"it is not a checkpoint of tensors and plain data ({reason[:200]}). {fix}"


def trained_classes(checkpoint: dict) -> tuple[Optional[str], Optional[str]]:
    """The LightningModule and LightningDataModule class paths a checkpoint was trained with,
    as LightningCLI records them (``_class_path`` of its hyper-parameters); None where the
    checkpoint does not say."""
    def class_path(key: str) -> Optional[str]:
        value = dict(checkpoint.get(key) or {}).get("_class_path")
        return str(value) if value else None

    return class_path("hyper_parameters"), class_path("datamodule_hyper_parameters")


def check_trained_as(path: str | os.PathLike, model: Optional[str], data: Optional[str]) -> None:
    """Refuse a checkpoint of another model or data module than a config builds.

    LightningCLI replaces the config's model with the one a ``--ckpt_path`` records, but keeps
    the config's data module: a head's checkpoint evaluated with the base LM's configs fails
    deep inside the run, on an attribute the data module lacks. ``model`` or ``data`` None:
    the config does not name it (LightningCLI then takes the checkpoint's model)."""
    saved_model, saved_data = trained_classes(load_checkpoint(path))
    fix = ("give the -c configs it was trained with (the config.yaml beside its Lightning logs "
           "holds them), or a checkpoint")
    trained = f"trained on {saved_data}" if saved_data else "its data module not recorded"
    if model and saved_model and model != saved_model:
        builds = f"{model} on {data}" if data else model
        raise CheckpointError(f"{path} is a {saved_model} checkpoint ({trained}) but the config "
                              f"builds {builds}: {fix} of {model.rsplit('.', 1)[-1]}.")
    if data and saved_data and data != saved_data:
        raise CheckpointError(f"{path} is a {saved_model or 'model'} checkpoint ({trained}) but "
                              f"the config builds the data module {data}: {fix} trained on "
                              f"{data.rsplit('.', 1)[-1]}.")


def datamodule_args(path: str | os.PathLike) -> dict:
    """The data module's init arguments saved in a Lightning checkpoint (LightningCLI's own
    bookkeeping keys, such as ``_class_path``, left out)."""
    saved = load_checkpoint(path).get("datamodule_hyper_parameters", {})
    return {k: v for k, v in dict(saved).items() if not k.startswith("_")}


def model_state(checkpoint: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The weights under ``prefix`` (e.g. ``"model."``) of a Lightning state dict, unprefixed."""
    return {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items()
            if k.startswith(prefix)}
