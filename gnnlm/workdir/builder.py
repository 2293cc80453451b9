"""The artifact builder: skip, refuse, resume or build one artifact folder.

Every pipeline stage writes one folder under the work directory. The folder is built under
``<name>.partial`` and renamed to ``<name>`` only when its ``manifest.json`` says it is complete,
so a folder without the suffix is always whole. A build that is killed leaves the ``.partial``
folder with a ``progress.json``; the next build with the same fingerprint continues from there
and, because chunk boundaries are fixed, ends with the same bytes as an uninterrupted build.
A build sharded over several processes (``gnnlm.workdir.shards``) keeps one progress file per rank
beside it instead; ``attach`` opens the arrays in every rank.

The manifest a build writes says what the artifact was made from and by: ``reads``, the
fingerprint of every other artifact whose manifest was read while it was built (inside ``with
builder``; recorded by ``read_manifest`` itself, so whatever a trained part's data module and
model open is in it), checked again whenever the artifact is reused (one made from artifacts
since rebuilt is built again) and by ``gnnlm verify``; and ``made_by``, the code
(``gnnlm.utils.provenance``). What a stage reads before it builds, to name its inputs, is in its
``inputs`` (part of its fingerprint) instead. A reused artifact has its files checked against
the sizes and sha256 its manifest records (``gnnlm.workdir.integrity``).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.utils.progress import say, track
from gnnlm.utils.provenance import code_version
from gnnlm.workdir.fingerprints import close_read_log, fingerprint, note_artifact, open_read_log
from gnnlm.workdir.integrity import file_problems, sha256_all, stale_reads
from gnnlm.workdir.manifests import (
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SHA256,
    array_nbytes,
    is_complete,
    manifest_digest,
    open_array,
    read_manifest,
    write_json_atomic,
)
from gnnlm.workdir.refusals import ArtifactError, changed_inputs, rebuild_hint, refusal

PROGRESS = "progress.json"
# One progress file per rank of a sharded build (gnnlm.workdir.shards); finish() removes them.
RANK_PROGRESS = "progress.rank{rank}.json"
# A file up to this size is checked against its recorded sha256 every time a run reuses its
# artifact: under a second from the page cache (sha256 reads 1.4 GB/s on one idle core here; the
# demo's largest file is 0.53 GB, its whole work directory 3 GB). A bigger one (the features of
# a WikiText-103-sized datastore: hundreds of GB, minutes to read) has only its size checked
# then, and its checksum by ``gnnlm verify``.
REUSE_CHECK_BYTES = 1 << 30


def _is_bookkeeping(name: str) -> bool:
    """The manifest and progress files: not data, never checksummed."""
    return name in (MANIFEST, PROGRESS) or name.startswith("progress.rank") or name.endswith(
        ".tmp")


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
        open_read_log(self.reads)  # read_manifest records what the build reads
        return self

    def __exit__(self, *exc) -> None:
        for mm in self._memmaps.values():
            if isinstance(mm, np.memmap):
                mm.flush()
        self._memmaps.clear()
        close_read_log(self.reads)

    def array(self, name: str, dtype: Any, shape: Iterable[int], file: str | None = None,
              fill: Any = None) -> np.ndarray:
        """A writable memmap in the partial folder, reopened (not cleared) when resuming."""
        spec = {"file": file or f"{name}.bin", "dtype": np.dtype(dtype).name,
                "shape": [int(s) for s in shape]}
        target = self.partial / spec["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        resuming = (self.arrays.get(name) == spec and target.exists()
                    and target.stat().st_size == array_nbytes(spec))
        self.arrays[name] = spec
        if array_nbytes(spec) == 0:
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
        digests = sha256_all(self.partial, names)
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
        note_artifact(self.path, self.fingerprint)
        (self.partial / PROGRESS).unlink(missing_ok=True)
        for rank_file in self.partial.glob(RANK_PROGRESS.format(rank="*") + "*"):
            rank_file.unlink(missing_ok=True)  # the ranks' own files (and a torn .tmp)
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.partial, self.path)
        say(f"[gnnlm] {self.kind} {self.path}: built in {time.perf_counter() - self.t0:.1f} s")
        return manifest
