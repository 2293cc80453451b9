"""Manifests without the checksum of their own content: trusted only where nothing has one.

Every manifest a build writes carries ``manifest_sha256``, so an edit to it is refused. A
manifest without one was either written before checksums were, or edited and its checksum
removed to hide the edit: the two cannot be told apart from the manifest alone. They can from its
work directory: one written before checksums lies among others written before them, and an
edited one among manifests that have theirs. So a manifest without its checksum is trusted only
when no manifest of its work directory has one (its own folders, not artifacts linked in from
another work directory, which say nothing of this one's age).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

# the folders directly under a work directory that hold its artifacts (``gnnlm.workdir.layout``;
# reports and logs hold none)
ARTIFACT_FOLDERS = ("tokens", "models", "features", "index", "neighbors", "knn_cache", "pq",
                    "ablations")
# work directory → (its manifests' paths, sizes and modification times; the first one found with
# a checksum): reading every manifest of an old work directory once per manifest read would
# read each of them as many times as there are artifacts
_CHECKED: dict[Path, tuple[tuple, Optional[Path]]] = {}


def work_directory_of(path: str | os.PathLike) -> Path:
    """The work directory an artifact folder lies in, after following links: the folder above
    the first of ``ARTIFACT_FOLDERS`` on its way up (``<root>/neighbors/final-cos/valid`` →
    ``<root>``); the folder itself for one outside any work directory's layout."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        if folder.name in ARTIFACT_FOLDERS:
            return folder.parent
    return real


def own_manifests(root: Path, name: str = "manifest.json") -> list[tuple[Path, int, int]]:
    """Every finished artifact's manifest (``name``) in the work directory's own folders:
    (path, size, modification time), in path order."""
    found = []
    for folder, subfolders, files in os.walk(root):  # links not followed
        here = Path(folder)
        if here.name.endswith(".partial"):
            subfolders.clear()
        elif name in files:
            stat = (here / name).stat()
            found.append((here / name, stat.st_size, stat.st_mtime_ns))
            subfolders.clear()  # an artifact's own subfolders hold its files
        else:
            subfolders.sort()
    return sorted(found)


def checksummed_manifest(root: Path, name: str, field: str) -> Optional[Path]:
    """A manifest (``name``) of the work directory ``root`` that records its own checksum
    (``field``), or None when none does: the work directory predates checksums."""
    listing = tuple(own_manifests(root, name))
    cached = _CHECKED.get(root)
    if cached is not None and cached[0] == listing:
        return cached[1]
    found = None
    for manifest, _, _ in listing:
        try:
            content = json.loads(manifest.read_text())
        except (OSError, ValueError):  # unreadable: said when that artifact is read
            continue
        if isinstance(content, dict) and field in content:
            found = manifest
            break
    _CHECKED[root] = (listing, found)
    return found


def unsealed_problem(path: str | os.PathLike, name: str, field: str) -> Optional[str]:
    """Why the manifest (``name``) of the artifact at ``path``, which records no checksum of its
    own (``field``), cannot be trusted: another manifest of its work directory records one.
    None when none does."""
    root = work_directory_of(path)
    other = checksummed_manifest(root, name, field)
    if other is None:
        return None
    return (f"{Path(path) / name} records no {field}, but the other manifests of {root} do "
            f"(e.g. {other.relative_to(root)}): its checksum was removed, so an edit to it "
            f"cannot be ruled out (only a work directory whose every manifest predates "
            f"checksums is read without them).")
