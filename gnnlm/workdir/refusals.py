"""Refusals: the error an artifact check raises and what it says to do.

``ArtifactError`` is raised for an artifact that is missing, incomplete, corrupt, or made from
other inputs. Its text names what differs (``differences``: one short line whatever differs) and
how to remake the artifact: the ``--rebuild`` of the stage that builds it (``rebuild_flag``,
``rebuild_hint``). ``changed_inputs`` tells an artifact to build again (only inputs rebuilt since
differ) from one to refuse (other settings: ``refusal``); ``check_inputs`` refuses an input
artifact made from other inputs than a stage pairs it with.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from gnnlm.workdir import rows
from gnnlm.workdir.fingerprints import canonical_json, is_artifact_fingerprint


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, corrupt, or was made from other inputs."""


def rebuild_hint(path: str | os.PathLike, kind: Optional[str]) -> str:
    """How to rebuild the artifact at ``path``: its stage for ``--rebuild``, or its folder."""
    path = Path(path)
    if kind == "output_embedding":  # written by the features stage, but never rebuilt by it
        return f"Delete {path} and rerun: the features stage writes it again."
    return f"Rerun with {rebuild_flag(path, kind)} or delete {path}."


def rebuild_flag(path: str | os.PathLike, kind: Optional[str]) -> str:
    """The ``--rebuild`` of the pipeline stage that builds the artifact at ``path`` (a trained
    part by the row the registry names its folder for, ``rows.of_folder``: ``models/
    learned_wds_n3`` → ``learned_wds[n=3]``; the base LM's by its folder, ``base_lm``); plain
    ``--rebuild`` when no stage names it."""
    if kind is None or kind == "output_embedding":
        return "--rebuild"
    folder = Path(path).name
    stage = (rows.of_folder(folder) or folder) if kind == "trained_model" else kind
    return f"--rebuild=[{stage}]"


def changed_hint(path: str | os.PathLike, kind: Optional[str]) -> str:
    """What to do about a value in a finished artifact that its build would have refused."""
    return (f"the file changed after it was written, or was written before such values were "
            f"refused. {rebuild_hint(path, kind)}")


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): obj}


# A refusal names at most this many fields, each value cut to this many characters, and stops
# naming them past this many characters in all: one short line whatever differs (a list of
# callbacks, a whole file's text).
SHOWN_FIELDS = 5
SHOWN_CHARS = 60
SHOWN_TOTAL = 300
_MISSING = object()


def _changed(found: dict, asked: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(field, found, asked)`` for every differing leaf; lists of the same length are compared
    item by item (``trainer.callbacks.0.init_args.monitor``), so the field is the one that
    differs, not the whole list."""
    a, b = _flatten(found, prefix), _flatten(asked, prefix)

    def order(key: str) -> list[tuple[int, Any]]:  # item 10 after item 9
        return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]

    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(a) | set(b), key=order):
        old, new = a.get(key, _MISSING), b.get(key, _MISSING)
        if canonical_json(old if old is not _MISSING else None) == canonical_json(
                new if new is not _MISSING else None):
            continue
        if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
            out += _changed({str(i): v for i, v in enumerate(old)},
                            {str(i): v for i, v in enumerate(new)}, f"{key}.")
        else:
            out.append((key, old, new))
    return out


def _shown(value: Any) -> str:
    text = "(none)" if value is _MISSING else json.dumps(value, default=str)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


def differences(found: dict, asked: dict) -> list[str]:
    """``"field: found → asked"`` for the leaves that differ between two nested dicts: the first
    of them (at most ``SHOWN_FIELDS``, ``SHOWN_TOTAL`` characters), values cut to
    ``SHOWN_CHARS`` characters, then ``"and N more"``."""
    changed = _changed(found, asked)
    out: list[str] = []
    for key, old, new in changed[:SHOWN_FIELDS]:
        line = f"{key}: {_shown(old)} → {_shown(new)}"
        if out and sum(len(text) + 2 for text in out) + len(line) > SHOWN_TOTAL:
            break
        out.append(line)
    if len(changed) > len(out):
        out.append(f"and {len(changed) - len(out)} more")
    return out


def refusal(path: str | os.PathLike, kind: Any, found: dict, asked: dict) -> ArtifactError:
    """The error for an artifact at ``path`` recorded as ``found`` ({config, inputs}) where this
    run asks for ``asked``: one line naming the fields that differ, and the ``--rebuild`` that
    remakes it with every stage that reads it (``gnnlm.pipeline.dependencies``)."""
    changed = differences(found, asked)
    flag = rebuild_flag(path, kind if isinstance(kind, str) else None)
    return ArtifactError(
        f"{path} holds a {kind} made with other settings than this run asks for: "
        f"{'; '.join(changed) or 'the fingerprints differ'}. Use another work directory, delete "
        f"the folder, or rerun with {flag}, which rebuilds it and every stage that reads it.")


def changed_inputs(found: dict, config: dict, inputs: dict) -> Optional[list[str]]:
    """``"name: found → now"`` for each input of an artifact recorded as ``found`` that differs
    from ``inputs``, when each of them is an artifact of the work directory, since rebuilt (its
    new value is the fingerprint of an artifact this process read or built), and nothing else
    differs: the same config, the same input names. None otherwise: other settings, another
    model given from outside (a base LM's weights), a manifest of other code, or no change."""
    recorded = found.get("inputs") or {}
    if (canonical_json(found.get("config")) != canonical_json(config)
            or set(recorded) != set(inputs)):
        return None
    names = [name for name in sorted(inputs)
             if canonical_json(recorded[name]) != canonical_json(inputs[name])]
    if not names or not all(is_artifact_fingerprint(str(inputs[name])) for name in names):
        return None
    return [f"{name}: {recorded[name]} → {inputs[name]}" for name in names]


def check_inputs(manifest: dict, path: str | os.PathLike, expected: dict[str, Any],
                 fix: str) -> None:
    """Refuse an input artifact whose recorded ``inputs`` differ from ``expected``.

    ``expected`` maps input names to the fingerprints this stage is about to pair the artifact
    with (e.g. the neighbours must have been searched for these very features). ``fix`` says
    what to do about it.
    """
    recorded = manifest.get("inputs") or {}
    wrong = [f"{name}: {recorded.get(name)} → {value}" for name, value in expected.items()
             if recorded.get(name) != value]
    if wrong:
        raise ArtifactError(f"{path} was made from other inputs than this stage pairs it with "
                            f"({'; '.join(wrong)}). {fix}")

