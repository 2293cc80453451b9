"""Manifests: what a finished artifact records of itself, and reading it back.

A build writes ``manifest.json`` last, then renames ``<name>.partial`` to ``<name>``
(``gnnlm.workdir.builder``), so a folder holding a manifest is a finished artifact
(``is_complete``). The manifest records the shapes and dtypes of its arrays, the sha256 of every
file (checked by ``gnnlm.workdir.integrity``), and the sha256 of its own content
(``manifest_sha256``), so that a number kept in it (a chosen k, a metric, a table) cannot be
edited unseen: every read checks it (``read_manifest``). Readers take shapes and dtypes from the
manifest, never from flags, and refuse files whose size does not match it (a truncated memmap:
``open_array``). Every read is noted by ``gnnlm.workdir.fingerprints``, so a build records what
it was made from.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gnnlm.workdir.fingerprints import canonical_json, note_read
from gnnlm.workdir.predates import unsealed_problem
from gnnlm.workdir.refusals import ArtifactError, rebuild_hint

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# the field of a manifest holding the sha256 of the rest of it
MANIFEST_SHA256 = "manifest_sha256"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to a temporary file, fsync it, and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's content without its ``manifest_sha256``, as JSON reads it back
    (so a value JSON writes otherwise than Python holds it, an int key or a tuple, hashes the
    same when written and when read)."""
    content = json.loads(json.dumps(manifest, default=str))
    content.pop(MANIFEST_SHA256, None)
    return hashlib.sha256(canonical_json(content).encode()).hexdigest()


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a finished artifact: its manifest is there (a build writes it
    last, then renames ``<name>.partial`` into place). Nothing is read: ``read_manifest`` checks
    the manifest itself, ``ArtifactBuilder.is_complete`` also that it is the one asked for."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike, kind: str | None = None) -> dict:
    """Read the manifest of a complete artifact, with a clear error if there is none or if its
    content changed after it was written (its ``manifest_sha256``; one without it is read only
    in a work directory none of whose manifests has it: ``gnnlm.workdir.predates``). The read is
    recorded by every build under way."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        partial = path.with_name(path.name + ".partial")
        hint = (f" An unfinished build is in {partial}; run the stage again to resume it."
                if partial.exists() else " Run the stage that builds it first.")
        raise ArtifactError(f"No complete {kind or 'artifact'} at {path}.{hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({err.__class__.__name__} at "
                            f"{getattr(err, 'pos', '?')}): the file is corrupt. Delete {path} "
                            f"and run the stage again, or rerun with --rebuild.") from None
    if not isinstance(manifest, dict) or not manifest.get("complete"):
        raise ArtifactError(f"{path} is marked incomplete; rebuild it.")
    recorded, found = manifest.get(MANIFEST_SHA256), manifest.get("kind")
    if recorded is not None and recorded != manifest_digest(manifest):
        raise ArtifactError(f"{manifest_path} was edited after it was written (its content no "
                            f"longer matches its manifest_sha256). "
                            f"{rebuild_hint(path, found if isinstance(found, str) else None)}")
    unsealed = unsealed_problem(path, MANIFEST, MANIFEST_SHA256) if recorded is None else None
    if unsealed:  # from before checksums, or its checksum removed: its work directory says which
        raise ArtifactError(f"{unsealed} "
                            f"{rebuild_hint(path, found if isinstance(found, str) else None)}")
    if kind is not None and manifest.get("kind") != kind:
        raise ArtifactError(f"{path} holds a {manifest.get('kind')!r} artifact, expected {kind!r}.")
    note_read(path, str(manifest.get("fingerprint")))
    return manifest


def array_nbytes(spec: dict) -> int:
    """The bytes of an array as its manifest records it (its ``dtype`` and ``shape``)."""
    return int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize


def open_array(path: str | os.PathLike, name: str, manifest: dict | None = None,
               mode: Literal["r", "r+", "c"] = "r") -> np.ndarray:
    """Open array ``name`` of a complete artifact as a memmap with the manifest's dtype/shape."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    arrays = manifest.get("arrays", {})
    if name not in arrays:
        raise ArtifactError(f"{path} has no array {name!r} (it has {sorted(arrays)}).")
    spec = arrays[name]
    file = path / spec["file"]
    expected = array_nbytes(spec)
    actual = file.stat().st_size if file.exists() else -1
    if actual != expected:
        raise ArtifactError(
            f"{file} holds {actual} bytes but its manifest says {spec['dtype']} {spec['shape']} "
            f"= {expected} bytes: the file is truncated or was replaced. Rebuild this stage.")
    if expected == 0:
        return np.zeros(spec["shape"], dtype=spec["dtype"])  # np.memmap refuses empty files
    return np.memmap(file, dtype=np.dtype(spec["dtype"]), mode=mode, shape=tuple(spec["shape"]))
