"""Which code made an artifact or a report: gnnlm's version and, run from a git checkout, its
commit and whether the checkout had changes then.

Recorded in every manifest (``made_by``) and in ``results.json``; it identifies nothing (a
rebuilt artifact's fingerprint does not depend on it) but says where a number came from.
"""
from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path
from typing import Optional


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """``{"gnnlm": version, "commit": sha or None, "dirty": bool or None}``: the package's
    version, and where the imported package is a git checkout's own (not one installed into a
    virtual environment that lies inside some checkout), its HEAD commit and whether any tracked
    or untracked file differs from it. Read once per process: the code a process runs is what it
    imported."""
    try:
        version = importlib.metadata.version("gnnlm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit, dirty = _checkout(Path(__file__).resolve().parents[2])
    return {"gnnlm": version, "commit": commit, "dirty": dirty}


def _git(folder: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout if done.returncode == 0 else None


def _checkout(root: Path) -> tuple[Optional[str], Optional[bool]]:
    """HEAD and the dirty flag of the checkout whose top folder is ``root``, else (None, None)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root:
        return None, None
    head, status = _git(root, "rev-parse", "HEAD"), _git(root, "status", "--porcelain")
    if head is None or status is None:
        return None, None
    return head.strip(), bool(status.strip())
