"""gnnlm.workdir.predates: a manifest without the checksum of its own content is read only in a
work directory none of whose manifests has one (``gnnlm verify`` and a run that reuses the
artifact, on a built work directory, are in tests/workdir/test_integrity.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import MANIFEST_SHA256, read_manifest
from gnnlm.workdir.predates import ARTIFACT_FOLDERS, checksummed_manifest, work_directory_of
from gnnlm.workdir.refusals import ArtifactError


def artifact(path, kind="demo"):
    builder = ArtifactBuilder(path, kind=kind)
    with builder:
        builder.array("values", np.float32, (3,))[...] = 1.0
        builder.finish()
    return path


def unseal(path) -> None:
    """Remove the manifest's checksum of its own content (and nothing else)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop(MANIFEST_SHA256)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_the_work_directory_of_an_artifact_is_the_folder_above_its_layout_folder(tmp_path):
    wd = Workdir(tmp_path / "runs" / "features" / "w")  # a layout name above it is no match
    for path in (wd.tokens, wd.model("gnn"), wd.features("train"), wd.output_embedding,
                 wd.index("final", "cos"), wd.neighbors("final", "cos", "valid"),
                 wd.knn_cache("final", "cos", "faiss", "test"), wd.pq("final"), wd.ablations):
        assert work_directory_of(path) == wd.root.resolve(), path
        assert path.relative_to(wd.root).parts[0] in ARTIFACT_FOLDERS   # the layout's folders
    assert not {"reports", "logs"} & set(ARTIFACT_FOLDERS)
    assert work_directory_of(tmp_path / "a") == (tmp_path / "a").resolve()  # outside a layout


def test_a_manifest_without_its_checksum_is_read_only_where_none_has_one(tmp_path):
    wd = Workdir(tmp_path / "w")
    features, index = artifact(wd.features("train")), artifact(wd.index("final", "cos"))
    unseal(features)
    with pytest.raises(ArtifactError) as err:
        read_manifest(features)
    assert str(err.value) == (
        f"{features / 'manifest.json'} records no manifest_sha256, but the other manifests of "
        f"{wd.root.resolve()} do (e.g. index/final-cos/manifest.json): its checksum was removed, "
        f"so an edit to it cannot be ruled out (only a work directory whose every manifest "
        f"predates checksums is read without them). Rerun with --rebuild=[demo] or delete "
        f"{features}.")
    unseal(index)                                       # now the whole work directory predates
    assert checksummed_manifest(wd.root.resolve(), "manifest.json", MANIFEST_SHA256) is None
    assert read_manifest(features)["kind"] == "demo"
    artifact(wd.pq("final"))                            # a newer build among them: refused again
    with pytest.raises(ArtifactError, match="records no manifest_sha256"):
        read_manifest(features)


def test_artifacts_linked_in_from_another_work_directory_say_nothing_of_its_age(tmp_path):
    """A work directory from before checksums that links the features of a newer one: its own
    manifests are read (the linked ones have their checksums), and the linked ones in turn
    belong to the newer work directory."""
    newer = Workdir(tmp_path / "newer")
    artifact(newer.features("train"))
    older = Workdir(tmp_path / "older")
    own = artifact(older.index("final", "cos"))
    unseal(own)
    older.features("train").parent.mkdir(parents=True)
    older.features("train").symlink_to(newer.features("train"), target_is_directory=True)
    assert read_manifest(own)["kind"] == "demo"
    assert read_manifest(older.features("train"))["kind"] == "demo"
    unseal(newer.features("train"))                     # alone in its work directory: read
    assert read_manifest(older.features("train"))["kind"] == "demo"
