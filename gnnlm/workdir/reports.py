"""Reports that cannot be edited quietly nor outlive what they describe.

``gnnlm pipeline`` ends by writing ``reports/<name>/results.json``, whose numbers ``gnnlm.load``
serves (kNN-LM's k, T and λ, those of every interpolation). ``seal`` adds to it the artifacts it
was computed from (``artifacts``: each one's folder in the work directory, its fingerprint and
the sha256 of its manifest, which changes whenever it is built again, even with the same
settings) and the sha256 of its own content (``report_sha256``, computed as a manifest's
``manifest_sha256`` is). ``check_report`` refuses a report whose content changed after it was
written, one without the checksum (edited and the checksum removed, or written by an older
gnnlm: either way rewritten by rerunning the pipeline, which reuses every finished stage), and
one made from artifacts the work directory no longer holds as they were: rebuilt since, as by a
``--rebuild`` stopped before the report was written again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gnnlm.workdir.fingerprints import canonical_json, seen_artifacts
from gnnlm.workdir.manifests import is_complete, manifest_digest, read_manifest
from gnnlm.workdir.refusals import ArtifactError

REPORT = "results.json"
# the field of a report holding the sha256 of the rest of it, and the one naming its artifacts
REPORT_SHA256 = "report_sha256"
ARTIFACTS = "artifacts"
# what each refusal says to do
REWRITE = ("rerun `gnnlm pipeline` with its config to write it again (the finished stages are "
           "reused).")


def report_digest(report: dict) -> str:
    """sha256 of a report's content without its ``report_sha256``, as JSON reads it back."""
    content = json.loads(json.dumps(report, default=str))
    content.pop(REPORT_SHA256, None)
    return hashlib.sha256(canonical_json(content).encode()).hexdigest()


def artifacts_used(root: str | os.PathLike) -> dict[str, dict[str, str]]:
    """The artifacts of the work directory ``root`` that this process read or built, by folder
    relative to it: each one's fingerprint and manifest sha256."""
    base = os.path.abspath(root)
    used = {}
    for path in sorted(seen_artifacts()):
        if path.startswith(base + os.sep) and is_complete(path):
            manifest = read_manifest(path)
            used[Path(os.path.relpath(path, base)).as_posix()] = {
                "fingerprint": str(manifest.get("fingerprint")),
                "manifest_sha256": manifest_digest(manifest)}
    return used


def seal(report: dict, root: str | os.PathLike) -> dict:
    """The report with the artifacts of ``root`` it was computed from and its own sha256."""
    sealed: dict[str, Any] = {**report, ARTIFACTS: artifacts_used(root)}
    sealed[REPORT_SHA256] = report_digest(sealed)
    return sealed


def changed_artifacts(report: dict, root: Path) -> list[str]:
    """The artifacts a report names that ``root`` no longer holds as they were, one phrase
    each: rebuilt (with other settings, or the same), or gone."""
    changed = []
    for folder, recorded in sorted((report.get(ARTIFACTS) or {}).items()):
        path = root / folder
        if not is_complete(path):
            changed.append(f"{folder}: no complete artifact")
            continue
        try:
            manifest = read_manifest(path)
        except ArtifactError:  # damaged: `gnnlm verify` names the file
            changed.append(f"{folder}: its manifest cannot be read (gnnlm verify says why)")
            continue
        fingerprint = str(manifest.get("fingerprint"))
        if fingerprint != recorded.get("fingerprint"):
            changed.append(f"{folder}: rebuilt with other settings (fingerprint "
                           f"{recorded.get('fingerprint')} → {fingerprint})")
        elif manifest_digest(manifest) != recorded.get("manifest_sha256"):
            changed.append(f"{folder}: rebuilt after the report was written")
    return changed


def check_report(path: str | os.PathLike, root: str | os.PathLike) -> dict:
    """The report at ``path`` of the work directory ``root``, refused in one line (an
    ``ArtifactError``) when it changed after it was written, records no checksum, or was
    computed from artifacts ``root`` no longer holds as they were."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path} is not valid JSON ({err.__class__.__name__}): the file is "
                            f"corrupt; {REWRITE}") from None
    if not isinstance(report, dict) or REPORT_SHA256 not in report:
        raise ArtifactError(f"{path} records no {REPORT_SHA256} (it was edited and its checksum "
                            f"removed, or written by an older gnnlm), so its numbers cannot be "
                            f"trusted: {REWRITE}")
    if report[REPORT_SHA256] != report_digest(report):
        raise ArtifactError(f"{path} was edited after it was written (its content no longer "
                            f"matches its {REPORT_SHA256}): {REWRITE}")
    changed = changed_artifacts(report, Path(root))
    if changed:
        raise ArtifactError(f"{path} was computed from artifacts {root} no longer holds as they "
                            f"were ({'; '.join(changed)}): {REWRITE}")
    return report
