"""Names importable here as well as from the modules that own them.

``fingerprints`` (fingerprints, file sha256), ``refusals`` (``ArtifactError`` and its text),
``manifests`` (writing and reading a manifest, opening an array), ``builder``
(``ArtifactBuilder``).
"""
from __future__ import annotations

from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.fingerprints import canonical_json, file_sha256, fingerprint
from gnnlm.workdir.manifests import is_complete, open_array, read_manifest, write_json_atomic
from gnnlm.workdir.refusals import ArtifactError, changed_hint, refusal

__all__ = [
    "ArtifactBuilder",
    "ArtifactError",
    "canonical_json",
    "changed_hint",
    "file_sha256",
    "fingerprint",
    "is_complete",
    "open_array",
    "read_manifest",
    "refusal",
    "write_json_atomic",
]
