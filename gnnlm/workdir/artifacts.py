"""Artifact folders: manifests, fingerprints, atomic completion, resumable chunked builds.

Every pipeline stage writes one folder under the work directory. The folder is built under
``<name>.partial`` and renamed to ``<name>`` only when its ``manifest.json`` says it is complete,
so a folder without the suffix is always whole. A build that is killed leaves the ``.partial``
folder with a ``progress.json``; the next build with the same fingerprint continues from there
and, because chunk boundaries are fixed, ends with the same bytes as an uninterrupted build.
A build sharded over several processes (``gnnlm.workdir.shards``) keeps one progress file per rank
beside it instead; ``attach`` opens the arrays in every rank.

Readers take shapes and dtypes from the manifest, never from flags, and refuse files whose size
does not match it (a truncated memmap). The manifest also records the sha256 of every file, so
that bytes changed after the build (a disk fault, a copy cut short, an edit) are caught when a
run reuses the artifact (files up to ``REUSE_CHECK_BYTES``) and by ``gnnlm verify`` (all), and
the sha256 of its own content (``manifest_sha256``), so that a number kept in it (a chosen k, a
metric, a table) cannot be edited unseen: every read checks it.

A manifest also says what the artifact was made from and by: ``reads``, the fingerprint of every
other artifact whose manifest was read while it was built (inside ``with builder``; recorded by
``read_manifest`` itself, so whatever a trained part's data module and model open is in it),
checked again whenever the artifact is reused (one made from artifacts since rebuilt is built
again) and by ``gnnlm verify``; and ``made_by``, the code
(``gnnlm.utils.provenance``). What a stage reads before it builds, to name its inputs, is in its
``inputs`` (part of its fingerprint) instead.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np

from gnnlm.utils.progress import say, track
from gnnlm.utils.provenance import code_version
from gnnlm.workdir.predates import unsealed_problem

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
# One progress file per rank of a sharded build (gnnlm.workdir.shards); finish() removes them.
RANK_PROGRESS = "progress.rank{rank}.json"
FORMAT_VERSION = 1
# A file up to this size is checked against its recorded sha256 every time a run reuses its
# artifact: under a second from the page cache (sha256 reads 1.4 GB/s on one idle core here; the
# demo's largest file is 0.53 GB, its whole work directory 3 GB). A bigger one (the features of
# a WikiText-103-sized datastore: hundreds of GB, minutes to read) has only its size checked
# then, and its checksum by ``gnnlm verify``.
REUSE_CHECK_BYTES = 1 << 30
# the field of a manifest holding the sha256 of the rest of it
MANIFEST_SHA256 = "manifest_sha256"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, corrupt, or was made from other inputs."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts (configs, input fingerprints)."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()[:16]


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes: measured faster than blake2b here (1.4 against 0.8 GB/s on a
    0.5 GB features file), as CPUs compute it in hardware."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(folder: Path, names: list[str]) -> dict[str, str]:
    """sha256 of several files of ``folder``, on a few threads (hashlib releases the GIL)."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1, 4)) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(folder / name), names)))


def _is_bookkeeping(name: str) -> bool:
    """The manifest and progress files: not data, never checksummed."""
    return name in (MANIFEST, PROGRESS) or name.startswith("progress.rank") or name.endswith(
        ".tmp")


def data_files(manifest: dict) -> dict[str, Optional[str]]:
    """Every data file a manifest records, relative to its folder, with its recorded sha256
    (``None`` in a manifest written before checksums were)."""
    files: dict[str, Optional[str]] = {
        spec["file"]: spec.get("sha256") for spec in manifest.get("arrays", {}).values()}
    files.update(manifest.get("files") or {})
    return files


def rebuild_hint(path: str | os.PathLike, kind: Optional[str]) -> str:
    """How to rebuild the artifact at ``path``: its stage for ``--rebuild``, or its folder."""
    path = Path(path)
    if kind == "output_embedding":  # written by the features stage, but never rebuilt by it
        return f"Delete {path} and rerun: the features stage writes it again."
    return f"Rerun with {rebuild_flag(path, kind)} or delete {path}."


def rebuild_flag(path: str | os.PathLike, kind: Optional[str]) -> str:
    """The ``--rebuild`` of the pipeline stage that builds the artifact at ``path`` (a trained
    part by its row: ``models/learned_wds_n3`` → ``learned_wds[n=3]``); plain ``--rebuild``
    when no stage names it."""
    if kind is None or kind == "output_embedding":
        return "--rebuild"
    stage = (re.sub(r"_n(\d+)$", r"[n=\1]", Path(path).name) if kind == "trained_model"
             else kind)
    return f"--rebuild=[{stage}]"


def changed_hint(path: str | os.PathLike, kind: Optional[str]) -> str:
    """What to do about a value in a finished artifact that its build would have refused."""
    return (f"the file changed after it was written, or was written before such values were "
            f"refused. {rebuild_hint(path, kind)}")


def file_problems(path: str | os.PathLike, manifest: dict,
                  max_bytes: Optional[int] = None) -> list[str]:
    """What is wrong with the data files of the artifact at ``path``, one phrase per file: a
    file missing, an array of another size than its manifest says, or bytes that no longer
    match the recorded sha256 (checked for files up to ``max_bytes``; all when None)."""
    path = Path(path)
    sizes = {spec["file"]: _array_nbytes(spec) for spec in manifest.get("arrays", {}).values()}
    recorded = data_files(manifest)
    problems, to_hash = [], []
    for name, digest in recorded.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        size = file.stat().st_size
        if name in sizes and size != sizes[name]:
            problems.append(f"{file} holds {size} bytes but its manifest says {sizes[name]}")
        elif digest is not None and (max_bytes is None or size <= max_bytes):
            to_hash.append(name)
    for name, found in _sha256_all(path, to_hash).items():
        if found != recorded[name]:
            problems.append(f"{path / name} does not match the sha256 in its manifest")
    return problems


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


# What the builds under way record of the manifests they read, one log per build (artifact path
# → fingerprint): ``ArtifactBuilder`` pushes its log when it starts, ``read_manifest`` writes to
# every log.
_READ_LOGS: list[dict[str, str]] = []
# The fingerprints of the artifacts this process has read or built: an input holding one names
# an artifact of the work directory (rebuilt, it rebuilds what reads it: ``changed_inputs``), not
# a setting or a model given from outside (another one is refused).
_ARTIFACTS: set[str] = set()
# ... and where they lie (absolute path → fingerprint): what a report was computed from
# (``gnnlm.workdir.reports``)
_SEEN: dict[str, str] = {}


def seen_artifacts() -> dict[str, str]:
    """Every artifact folder this process read or built, by absolute path: its fingerprint."""
    return dict(_SEEN)


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
    for log in _READ_LOGS:
        log[os.path.abspath(path)] = str(manifest.get("fingerprint"))
    _ARTIFACTS.add(str(manifest.get("fingerprint")))
    _SEEN[os.path.abspath(path)] = str(manifest.get("fingerprint"))
    return manifest


def stale_reads(path: str | os.PathLike, manifest: dict) -> list[str]:
    """The artifacts that the one at ``path`` was made from (its manifest's ``reads``) and that
    the work directory now holds with another fingerprint, or no longer holds: one phrase
    each. One whose manifest cannot be read is left to its own check."""
    stale = []
    for relative, fingerprint in sorted((manifest.get("reads") or {}).items()):
        source = Path(os.path.normpath(Path(path) / relative))
        now: Optional[str] = None
        if is_complete(source):
            try:
                now = str(read_manifest(source).get("fingerprint"))
            except ArtifactError:  # damaged: said of that artifact itself
                continue
        if now != fingerprint:
            stale.append(f"{source}: fingerprint {fingerprint} → "
                         f"{now if now is not None else 'no complete artifact'}")
    return stale


def _array_nbytes(spec: dict) -> int:
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
    expected = _array_nbytes(spec)
    actual = file.stat().st_size if file.exists() else -1
    if actual != expected:
        raise ArtifactError(
            f"{file} holds {actual} bytes but its manifest says {spec['dtype']} {spec['shape']} "
            f"= {expected} bytes: the file is truncated or was replaced. Rebuild this stage.")
    if expected == 0:
        return np.zeros(spec["shape"], dtype=spec["dtype"])  # np.memmap refuses empty files
    return np.memmap(file, dtype=np.dtype(spec["dtype"]), mode=mode, shape=tuple(spec["shape"]))


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
    if not names or any(str(inputs[name]) not in _ARTIFACTS for name in names):
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
        self._memmaps: dict[str, Any] = {}
        self.progress: dict = {}
        self.reads: dict[str, str] = {}  # while building: what read_manifest recorded
        self.interrupted = False
        self.t0 = time.perf_counter()

    # -- checks -----------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """True if a complete artifact with this fingerprint exists, made from what the work
        directory holds now; raise if one with other settings does. One made from inputs since
        rebuilt (``outdated``) is removed to be built again, and a line says why."""
        if not is_complete(self.path):
            if self.path.exists() and any(self.path.iterdir()):
                raise ArtifactError(f"{self.path} exists but has no manifest; remove it or "
                                    f"choose another work directory.")
            return False
        found = read_manifest(self.path)
        if self.rebuild:
            shutil.rmtree(self.path)
            return False
        why = self.outdated(found)
        if why is None:
            self.check_files(found)
            say(f"[gnnlm] {self.kind} {self.path}: skipped (complete)")
            return True
        weights = (", its weights fit to inputs the work directory no longer holds"
                   if self.kind == "trained_model" else "")
        say(f"[gnnlm] {self.kind} {self.path}: rebuilding: it was {why}{weights}")
        shutil.rmtree(self.path)
        return False

    def outdated(self, found: dict) -> Optional[str]:
        """Why the complete artifact recorded as ``found`` must be built again although this
        run asks for its settings: it was made from artifacts since rebuilt (its ``reads``, or
        its ``inputs`` where they name artifacts: ``changed_inputs``); None when it can be
        reused. Raise if its own settings differ, or an input from outside the work directory
        (a base LM given by its weights): those are refused, never discarded, so a trained part
        is retrained only when what it was trained on was rebuilt."""
        if found.get("fingerprint") == self.fingerprint:
            stale = stale_reads(self.path, found)
            return f"made from artifacts since rebuilt ({'; '.join(stale)})" if stale else None
        changed = changed_inputs(found, self.config, self.inputs)
        if changed is None:
            raise refusal(self.path, found.get("kind"),
                          {"config": found.get("config"), "inputs": found.get("inputs")},
                          {"config": self.config, "inputs": self.inputs})
        return f"made from inputs since rebuilt ({'; '.join(changed)})"

    def check_files(self, manifest: dict) -> None:
        """Refuse to reuse an artifact whose files changed after it was built: each file's size,
        and its sha256 up to ``REUSE_CHECK_BYTES`` (a manifest written before checksums were
        recorded has its sizes checked only)."""
        problems = file_problems(self.path, manifest, REUSE_CHECK_BYTES)
        if problems:
            raise ArtifactError(f"{'; '.join(problems)}: the {self.kind.replace('_', ' ')} "
                                f"changed after it was built (a disk fault, a copy cut short, "
                                f"or an edit). "
                                f"{rebuild_hint(self.path, self.kind)}")

    # -- building ---------------------------------------------------------------------------
    def __enter__(self) -> ArtifactBuilder:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        progress_file = self.partial / PROGRESS
        self.t0 = time.perf_counter()
        if self.partial.exists():
            try:
                state = json.loads(progress_file.read_text()) if progress_file.exists() else {}
            except json.JSONDecodeError:
                state = {}  # progress written while the disk filled up: start over
            if state.get("fingerprint") != self.fingerprint or self.rebuild:
                shutil.rmtree(self.partial)  # an unfinished build of something else: start over
            else:
                self.progress = state.get("progress", {})
                self.arrays = state.get("arrays", {})
        self.partial.mkdir(parents=True, exist_ok=True)
        self.reads = {}
        _READ_LOGS.append(self.reads)  # read_manifest records what the build reads
        return self

    def __exit__(self, *exc) -> None:
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self._memmaps.clear()
        _READ_LOGS[:] = [log for log in _READ_LOGS if log is not self.reads]

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

    def attach(self) -> dict[str, np.ndarray]:
        """Writable memmaps of every array of the partial folder that one process set up
        (``with builder`` + ``array``): how every rank of a sharded build writes its rows."""
        progress_file = self.partial / PROGRESS
        try:
            state = json.loads(progress_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError) as err:
            raise ArtifactError(f"{progress_file} cannot be read ({err.__class__.__name__}): "
                                f"the partial build was not set up.") from None
        if state.get("fingerprint") != self.fingerprint:
            raise ArtifactError(f"{self.partial} is being built with other settings "
                                f"(got fingerprint {state.get('fingerprint')}, expected "
                                f"{self.fingerprint}).")
        self.arrays = state.get("arrays", {})
        return {name: open_array(self.partial, name, {"arrays": self.arrays}, mode="r+")
                for name in self.arrays}

    def chunks(self, n_chunks: int, desc: str, stop_after: Optional[int] = None,
               **state: Any) -> Iterator[int]:
        """The resumable chunk loop: yields the chunks not done yet, in order, with progress.

        After the caller's body for chunk c returns, every open array is flushed and
        ``chunks_done = c + 1`` is recorded together with ``builder.progress`` (update it with
        any running totals inside the body). A killed build resumes at the next chunk, and since
        chunk boundaries are fixed, ends with the same bytes. ``stop_after`` stops after that
        many chunks of this run and sets ``interrupted`` (used to test resumption).
        """
        done = int(self.progress.get("chunks_done", 0))
        for chunk in track(n_chunks, desc, initial=done, stop_after=stop_after):
            yield chunk
            self.save_progress(chunks_done=chunk + 1)
        if int(self.progress.get("chunks_done", 0)) < n_chunks:
            self.interrupted = True

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

    def own_reads(self) -> dict[str, str]:
        """What this build read of other artifacts, by path relative to this artifact's folder
        (so that a work directory can be moved)."""
        own = {os.path.abspath(self.path), os.path.abspath(self.partial)}
        return {os.path.relpath(source, os.path.abspath(self.path)): fingerprint
                for source, fingerprint in sorted(self.reads.items()) if source not in own}

    def finish(self, extra: dict | None = None) -> dict:
        """Write the complete manifest, with the sha256 of every file (arrays' in their spec,
        other files', such as ``model.ckpt`` or a tokenizer, under ``files``), what the build
        read (``reads``), the code that made it (``made_by``) and the sha256 of the manifest's
        own content, and rename the partial folder into place."""
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self._memmaps.clear()
        names = sorted(str(f.relative_to(self.partial).as_posix()) for f in self.partial.rglob("*")
                       if f.is_file() and not f.is_symlink() and not _is_bookkeeping(f.name))
        digests = _sha256_all(self.partial, names)
        array_files = {spec["file"] for spec in self.arrays.values()}
        manifest = {
            "kind": self.kind, "format": FORMAT_VERSION, "complete": True,
            "fingerprint": self.fingerprint, "config": self.config, "inputs": self.inputs,
            "arrays": {name: {**spec, "sha256": digests[spec["file"]]}
                       for name, spec in self.arrays.items()},
            "files": {name: digest for name, digest in digests.items()
                      if name not in array_files},
            "reads": self.own_reads(), "made_by": code_version(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(extra or {}),
        }
        manifest[MANIFEST_SHA256] = manifest_digest(manifest)
        write_json_atomic(self.partial / MANIFEST, manifest)
        _ARTIFACTS.add(self.fingerprint)
        _SEEN[os.path.abspath(self.path)] = self.fingerprint
        (self.partial / PROGRESS).unlink(missing_ok=True)
        for rank_file in self.partial.glob(RANK_PROGRESS.format(rank="*") + "*"):
            rank_file.unlink(missing_ok=True)  # the ranks' own files (and a torn .tmp)
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.partial, self.path)
        say(f"[gnnlm] {self.kind} {self.path}: built in {time.perf_counter() - self.t0:.1f} s")
        return manifest
