"""An unknown key in a ``gnnlm fit`` config, said in one line: which section has no such key,
and the keys it does have that look like it.

jsonargparse reports a key a class does not take inside its "Does not validate against any of
the Union subtypes" text (the model and data sections are a union of every LightningModule and
None), as ``Option 'n_layr' is not accepted``, without the section; a trainer key as
``Subcommand 'fit' does not accept option 'trainer.max_stepz'``. ``unknown_key`` rewrites both.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from typing import Any, Optional

# the sections of a `gnnlm fit` config whose keys are one class's arguments
SECTION_CLASSES = {"trainer": "pytorch_lightning.Trainer",
                   "progress_log": "gnnlm.lit.progress_log.ProgressLog"}


def _class(path: str) -> Optional[type]:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _arguments(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments a class takes, following ``**kwargs`` to its bases as jsonargparse
    does."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters
        found.update({name: p for name, p in params.items() if name != "self"
                      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in found})
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return found


def _group_keys(cls: type, group: str) -> list[str]:
    """The fields of a dataclass argument (e.g. a data module's ``tokenizer``)."""
    param = _arguments(cls).get(group)
    default: Any = getattr(param, "default", None)
    return ([f.name for f in dataclasses.fields(default)]
            if dataclasses.is_dataclass(default) else [])


def _suggest(key: str, keys: list[str]) -> str:
    """The keys near ``key``: its close matches, or all of them when none is close."""
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"its keys are {', '.join(sorted(keys))}." if keys else "it takes no keys."


def unknown_key(message: str) -> Optional[str]:
    """The one line for jsonargparse's ``message`` when it says a key is unknown, else None."""
    text = " ".join(message.split())
    given = re.search(r"Parser key \"([^\"]+)\".*?Problem with given class_path '([^']+)': "
                      r"(?:Group '([^']+)' does not accept option '([^']+)'|"
                      r"Option '([^']+)' is not accepted)", text)
    if given:
        section, class_path, group, group_key, key = given.groups()
        cls = _class(class_path)
        if cls is None:
            return None
        name = class_path.rpartition(".")[2]
        if group:
            return (f"{section}.init_args.{group} has no key {group_key!r} ({name}'s {group}): "
                    f"{_suggest(group_key, _group_keys(cls, group))}")
        key = key.split(".")[0]  # a nested value under an unknown key names its whole path
        return (f"{section}.init_args has no key {key!r} ({name}): "
                f"{_suggest(key, list(_arguments(cls)))}")
    given = re.search(r"does not accept option '([^'.]+)\.([^'.]+)'", text)
    if given and given.group(1) in SECTION_CLASSES:
        section, key = given.groups()
        cls = _class(SECTION_CLASSES[section])
        if cls is None:
            return None
        return f"{section} has no key {key!r}: {_suggest(key, list(_arguments(cls)))}"
    return None
