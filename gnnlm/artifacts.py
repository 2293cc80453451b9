"""Artifact folders: manifests, fingerprints, atomic completion, resumable chunked builds.

Every pipeline stage writes one folder under the work directory. The folder is built under
``<name>.partial`` and renamed to ``<name>`` only when its ``manifest.json`` says it is complete,
so a folder without the suffix is always whole. A build that is killed leaves the ``.partial``
folder with a ``progress.json``; the next build with the same fingerprint continues from there
and, because chunk boundaries are fixed, ends with the same bytes as an uninterrupted build.

Readers take shapes and dtypes from the manifest, never from flags, and refuse files whose size
does not match it (a truncated memmap).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import numpy as np

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, corrupt, or was made from other inputs."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts (configs, input fingerprints)."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()[:16]


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to a temporary file, fsync it, and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str | os.PathLike, kind: str | None = None) -> dict:
    """Read the manifest of a complete artifact, with a clear error if there is none."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        partial = path.with_name(path.name + ".partial")
        hint = (f" An unfinished build is in {partial}; run the stage again to resume it."
                if partial.exists() else " Run the stage that builds it first.")
        raise ArtifactError(f"No complete {kind or 'artifact'} at {path}.{hint}")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise ArtifactError(f"{path} is marked incomplete; rebuild it.")
    if kind is not None and manifest.get("kind") != kind:
        raise ArtifactError(f"{path} holds a {manifest.get('kind')!r} artifact, expected {kind!r}.")
    return manifest


def _array_nbytes(spec: dict) -> int:
    return int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize


def open_array(path: str | os.PathLike, name: str, manifest: dict | None = None,
               mode: str = "r") -> np.memmap:
    """Open array ``name`` of a complete artifact as a memmap with the manifest's dtype/shape."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    arrays = manifest.get("arrays", {})
    if name not in arrays:
        raise ArtifactError(f"{path} has no array {name!r} (it has {sorted(arrays)}).")
    spec = arrays[name]
    file = path / spec["file"]
    expected = _array_nbytes(spec)
    actual = file.stat().st_size if file.exists() else -1
    if actual != expected:
        raise ArtifactError(
            f"{file} holds {actual} bytes but its manifest says {spec['dtype']} {spec['shape']} "
            f"= {expected} bytes: the file is truncated or was replaced. Rebuild this stage.")
    if expected == 0:
        return np.zeros(spec["shape"], dtype=spec["dtype"])  # np.memmap refuses empty files
    return np.memmap(file, dtype=spec["dtype"], mode=mode, shape=tuple(spec["shape"]))


def describe_inputs(manifest: dict) -> str:
    inputs = manifest.get("inputs") or {}
    return ", ".join(f"{k}={v}" for k, v in sorted(inputs.items())) or "no recorded inputs"


class ArtifactBuilder:
    """Builds one artifact folder: skip if complete, refuse if made from other inputs, resume.

    Usage::

        builder = ArtifactBuilder(path, kind="features", config=cfg, inputs={"base_lm": fp})
        if builder.is_complete():
            return
        with builder:                     # opens <path>.partial, reads progress
            arr = builder.array("final", np.float16, (n, d))
            for chunk in range(builder.progress.get("chunks_done", 0), n_chunks):
                arr[...] = ...
                builder.save_progress(chunks_done=chunk + 1)
            builder.finish(extra={...})
    """

    def __init__(self, path: str | os.PathLike, kind: str, config: dict | None = None,
                 inputs: dict | None = None, rebuild: bool = False):
        self.path = Path(path)
        self.kind = kind
        self.config = config or {}
        self.inputs = inputs or {}
        self.fingerprint = fingerprint(kind, self.config, self.inputs)
        self.rebuild = rebuild
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.arrays: dict[str, dict] = {}
        self._memmaps: dict[str, np.memmap] = {}
        self.progress: dict = {}

    # -- checks -----------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """True if a complete artifact with this fingerprint exists; raise if another does."""
        if not (self.path / MANIFEST).is_file():
            if self.path.exists() and any(self.path.iterdir()):
                raise ArtifactError(f"{self.path} exists but has no manifest; remove it or "
                                    f"choose another work directory.")
            return False
        found = read_manifest(self.path)
        if found.get("fingerprint") == self.fingerprint:
            return True
        if self.rebuild:
            shutil.rmtree(self.path)
            return False
        raise ArtifactError(
            f"{self.path} holds a {found.get('kind')} built from other inputs "
            f"({describe_inputs(found)}; config {canonical_json(found.get('config'))}) than this "
            f"run asks for ({', '.join(f'{k}={v}' for k, v in sorted(self.inputs.items()))}; "
            f"config {canonical_json(self.config)}). Use another work directory, delete the "
            f"folder, or rebuild it (rebuild: true / --rebuild).")

    # -- building ---------------------------------------------------------------------------
    def __enter__(self) -> "ArtifactBuilder":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        progress_file = self.partial / PROGRESS
        if self.partial.exists():
            state = json.loads(progress_file.read_text()) if progress_file.exists() else {}
            if state.get("fingerprint") != self.fingerprint:
                shutil.rmtree(self.partial)  # an unfinished build of something else: start over
            else:
                self.progress = state.get("progress", {})
                self.arrays = state.get("arrays", {})
        self.partial.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self._memmaps.clear()

    def array(self, name: str, dtype: Any, shape: Iterable[int], file: str | None = None,
              fill: Any = None) -> np.ndarray:
        """A writable memmap in the partial folder, reopened (not cleared) when resuming."""
        spec = {"file": file or f"{name}.bin", "dtype": np.dtype(dtype).name,
                "shape": [int(s) for s in shape]}
        target = self.partial / spec["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        resuming = (self.arrays.get(name) == spec and target.exists()
                    and target.stat().st_size == _array_nbytes(spec))
        self.arrays[name] = spec
        if _array_nbytes(spec) == 0:
            target.touch()
            mm = np.zeros(spec["shape"], dtype=spec["dtype"])
        else:
            mm = np.memmap(target, dtype=spec["dtype"], mode="r+" if resuming else "w+",
                           shape=tuple(spec["shape"]))
            if fill is not None and not resuming:
                mm[...] = fill
        self._memmaps[name] = mm
        self._write_progress()
        return mm

    def file(self, name: str) -> Path:
        """Path of a non-array file inside the partial folder."""
        return self.partial / name

    def save_progress(self, **state: Any) -> None:
        """Flush every open array, then record progress atomically (arrays first, then state)."""
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self.progress.update(state)
        self._write_progress()

    def _write_progress(self) -> None:
        write_json_atomic(self.partial / PROGRESS, {
            "fingerprint": self.fingerprint, "progress": self.progress, "arrays": self.arrays})

    def finish(self, extra: dict | None = None) -> dict:
        """Write the complete manifest and rename the partial folder into place."""
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self._memmaps.clear()
        manifest = {
            "kind": self.kind, "format": FORMAT_VERSION, "complete": True,
            "fingerprint": self.fingerprint, "config": self.config, "inputs": self.inputs,
            "arrays": self.arrays,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(extra or {}),
        }
        write_json_atomic(self.partial / MANIFEST, manifest)
        (self.partial / PROGRESS).unlink(missing_ok=True)
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.partial, self.path)
        return manifest
