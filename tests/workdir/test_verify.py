"""gnnlm.workdir.verify, piece by piece: which folders are artifacts, one artifact's status and
the bytes its check reads, and the sizes it prints (``gnnlm verify`` on a built work directory,
with damaged and edited files, is in tests/workdir/test_integrity.py)."""
from __future__ import annotations

import json

import numpy as np

from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.manifests import MANIFEST_SHA256
from gnnlm.workdir.verify import check_artifact, find_artifacts, size


def artifact(path, n: int = 6, with_file: bool = False):
    builder = ArtifactBuilder(path, kind="demo")
    with builder:
        builder.array("values", np.float32, (n,))[...] = np.arange(n)
        if with_file:
            builder.file("notes.txt").write_text("twelve bytes")
            (builder.partial / "sub").mkdir()
            (builder.partial / "sub" / "inner.txt").write_text("four")
        builder.finish()
    return path


def test_artifacts_are_the_folders_with_a_manifest_and_builds_left_unfinished(tmp_path):
    root = tmp_path / "work"
    b = artifact(root / "index" / "b")
    a = artifact(root / "a", with_file=True)
    unfinished = root / "neighbors" / "train.partial"
    (unfinished / "deeper.partial").mkdir(parents=True)   # not listed twice
    (root / "logs" / "empty").mkdir(parents=True)            # neither an artifact nor a build
    complete, partial = find_artifacts(root)
    # an artifact's own subfolders hold its files, not more artifacts
    assert complete == [a, b] and partial == [unfinished]


def test_artifacts_linked_in_from_another_work_directory_are_followed(tmp_path):
    shared = artifact(tmp_path / "elsewhere" / "features")
    root = tmp_path / "work"
    root.mkdir()
    (root / "features").symlink_to(shared, target_is_directory=True)
    assert find_artifacts(root) == ([root / "features"], [])


def test_a_sound_artifact_is_ok_and_every_byte_of_its_files_is_read(tmp_path):
    path = artifact(tmp_path / "a", n=6, with_file=True)
    status, problems, read = check_artifact(path)
    assert (status, problems) == ("ok", [])
    assert read == 6 * 4 + len("twelve bytes") + len("four")


def test_an_artifact_whose_manifest_has_no_checksum_of_its_own_has_its_sizes_checked(tmp_path):
    path = artifact(tmp_path / "a")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop(MANIFEST_SHA256)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert check_artifact(path)[:2] == ("no checksum recorded", [])


def test_a_changed_or_missing_file_is_bad_naming_it(tmp_path):
    path = artifact(tmp_path / "a", with_file=True)
    (path / "notes.txt").write_text("twelve bytez")
    status, problems, read = check_artifact(path)
    assert status == "bad" and read == 0
    assert len(problems) == 1 and str(path / "notes.txt") in problems[0]
    (path / "values.bin").unlink()
    status, problems, _ = check_artifact(path)
    assert status == "bad" and any(str(path / "values.bin") in p for p in problems)


def test_an_unreadable_manifest_is_bad_with_the_reason(tmp_path):
    path = artifact(tmp_path / "a")
    (path / "manifest.json").write_text("{not json")
    status, problems, read = check_artifact(path)
    assert status == "bad" and read == 0 and len(problems) == 1
    assert str(path) in problems[0]


def test_sizes_are_decimal_kilo_mega_or_gigabytes():
    assert [size(n) for n in (0, 999, 1_500, 1_500_000, 2_345_000_000)] == [
        "0.0 kB", "1.0 kB", "1.5 kB", "1.5 MB", "2.35 GB"]
