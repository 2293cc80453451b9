"""Integrity: whether an artifact's files and sources are still the ones its manifest records.

A manifest records the sha256 of every data file (``data_files``), so that bytes changed after
the build (a disk fault, a copy cut short, an edit) are caught (``file_problems``) when a run
reuses the artifact (``gnnlm.workdir.builder``) and by ``gnnlm verify``; and the fingerprint of
every artifact it was made from (its ``reads``), so that one made from artifacts since rebuilt
is found (``stale_reads``).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from gnnlm.workdir.fingerprints import file_sha256
from gnnlm.workdir.manifests import array_nbytes, is_complete, read_manifest
from gnnlm.workdir.refusals import ArtifactError


def sha256_all(folder: Path, names: list[str]) -> dict[str, str]:
    """sha256 of several files of ``folder``, on a few threads (hashlib releases the GIL)."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1, 4)) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(folder / name), names)))


def data_files(manifest: dict) -> dict[str, Optional[str]]:
    """Every data file a manifest records, relative to its folder, with its recorded sha256
    (``None`` in a manifest written before checksums were)."""
    files: dict[str, Optional[str]] = {
        spec["file"]: spec.get("sha256") for spec in manifest.get("arrays", {}).values()}
    files.update(manifest.get("files") or {})
    return files


def file_problems(path: str | os.PathLike, manifest: dict,
                  max_bytes: Optional[int] = None) -> list[str]:
    """What is wrong with the data files of the artifact at ``path``, one phrase per file: a
    file missing, an array of another size than its manifest says, or bytes that no longer
    match the recorded sha256 (checked for files up to ``max_bytes``; all when None)."""
    path = Path(path)
    sizes = {spec["file"]: array_nbytes(spec) for spec in manifest.get("arrays", {}).values()}
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
    for name, found in sha256_all(path, to_hash).items():
        if found != recorded[name]:
            problems.append(f"{path / name} does not match the sha256 in its manifest")
    return problems


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
