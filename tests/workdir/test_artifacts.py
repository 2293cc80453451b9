"""Artifact folders: skip, refuse, resume, rebuild, and the messages that explain them."""
import json
import re
import shutil

import numpy as np
import pytest

from gnnlm.utils.provenance import code_version
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.manifests import MANIFEST_SHA256, manifest_digest, open_array, read_manifest
from gnnlm.workdir.refusals import ArtifactError, check_inputs, differences
from tests.fakes import error_of


def _build(path, n_chunks=4, stop=None, config=None, inputs=None):
    builder = ArtifactBuilder(path, kind="demo", config=config or {"n": 8},
                              inputs=inputs or {"source": "a"})
    if builder.is_complete():
        return "skipped"
    with builder:
        arr = builder.array("values", np.float32, (n_chunks, 3))
        done = builder.progress.get("chunks_done", 0)
        for chunk in range(done, n_chunks):
            if stop is not None and chunk - done >= stop:
                return "stopped"
            arr[chunk] = np.arange(3) + 10 * chunk
            builder.save_progress(chunks_done=chunk + 1)
        builder.finish(extra={"rows": n_chunks})
    return "built"


def test_complete_artifact_is_skipped_and_readable(tmp_path):
    assert _build(tmp_path / "a") == "built"
    assert _build(tmp_path / "a") == "skipped"
    manifest = read_manifest(tmp_path / "a", kind="demo")
    assert manifest["rows"] == 4 and manifest["complete"]
    np.testing.assert_array_equal(open_array(tmp_path / "a", "values")[2], [20, 21, 22])


def test_killed_build_leaves_no_complete_artifact_and_resumes_to_same_bytes(tmp_path):
    assert _build(tmp_path / "x", stop=2) == "stopped"
    assert not (tmp_path / "x").exists()                      # nothing that looks complete
    with pytest.raises(ArtifactError, match="unfinished build"):
        read_manifest(tmp_path / "x")
    progress = json.loads((tmp_path / "x.partial" / "progress.json").read_text())
    assert progress["progress"]["chunks_done"] == 2
    assert _build(tmp_path / "x") == "built"
    _build(tmp_path / "y")
    assert ((tmp_path / "x" / "values.bin").read_bytes()
            == (tmp_path / "y" / "values.bin").read_bytes())
    assert not (tmp_path / "x.partial").exists()


def test_other_inputs_are_refused_naming_both(tmp_path):
    _build(tmp_path / "a", inputs={"source": "model-A"})
    with pytest.raises(ArtifactError, match="model-A.*model-B"):
        _build(tmp_path / "a", inputs={"source": "model-B"})


def test_truncated_memmap_is_refused(tmp_path):
    _build(tmp_path / "a")
    path = tmp_path / "a" / "values.bin"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ArtifactError, match="truncated"):
        open_array(tmp_path / "a", "values")


def test_refusal_lists_every_changed_field_old_then_new(tmp_path):
    _build(tmp_path / "a", config={"n": 8}, inputs={"source": "a"})
    with pytest.raises(ArtifactError, match=r'config\.n: 8 → 9; inputs\.source: "a" → "b"'):
        _build(tmp_path / "a", config={"n": 9}, inputs={"source": "b"})


def test_differences_names_changed_added_and_removed_leaves():
    found = {"config": {"k": 8, "nested": {"x": 1.5}, "gone": True}, "inputs": {"lm": "a"}}
    asked = {"config": {"k": 8, "nested": {"x": 2.5}, "new": [1, 2]}, "inputs": {"lm": "a"}}
    assert differences(found, asked) == ["config.gone: true → (none)",
                                         "config.nested.x: 1.5 → 2.5",
                                         "config.new: (none) → [1, 2]"]
    assert differences(found, found) == []
    # key order does not matter, values are compared as JSON
    assert differences({"a": {"x": 1, "y": 2}}, {"a": {"y": 2, "x": 1}}) == []


def test_check_inputs_names_the_artifact_the_input_and_both_fingerprints(tmp_path):
    manifest = {"inputs": {"features": "1111aaaa", "train_features": "2222bbbb"}}
    path = tmp_path / "neighbors" / "valid"
    check_inputs(manifest, path, {"features": "1111aaaa"}, "Rebuild it.")  # same: no error
    with pytest.raises(ArtifactError) as err:
        check_inputs(manifest, path, {"features": "1111aaaa", "train_features": "3333cccc"},
                     "Rebuild the neighbours.")
    message = str(err.value)
    assert str(path) in message and "train_features: 2222bbbb → 3333cccc" in message
    assert "features: 1111aaaa" not in message.replace("train_features", "")  # only what differs
    assert message.endswith("Rebuild the neighbours.")
    with pytest.raises(ArtifactError, match="features: None → 1111aaaa"):
        check_inputs({}, path, {"features": "1111aaaa"}, "")  # nothing recorded


def test_corrupt_manifest_names_the_file(tmp_path):
    _build(tmp_path / "a")
    manifest = tmp_path / "a" / "manifest.json"
    manifest.write_text('{"kind": "demo", "complete": tr')
    with pytest.raises(ArtifactError, match=re.escape(str(manifest)) + ".*not valid JSON"):
        read_manifest(tmp_path / "a")
    with pytest.raises(ArtifactError, match=re.escape(str(manifest))):
        _build(tmp_path / "a")  # a build refuses to guess what the folder holds
    manifest.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ArtifactError, match=re.escape(str(manifest))):
        read_manifest(tmp_path / "a")


def test_folder_without_manifest_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "stray.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="exists but has no manifest"):
        _build(tmp_path / "a")


def _chunked(path, stop_after=None, rebuild=False, n_chunks=5):
    """A build through ``ArtifactBuilder.chunks`` that keeps a running total in its progress."""
    builder = ArtifactBuilder(path, kind="demo", config={"n": n_chunks}, rebuild=rebuild)
    if builder.is_complete():
        return builder, [], None
    seen = []
    with builder:
        arr = builder.array("values", np.int64, (n_chunks, 2))
        for chunk in builder.chunks(n_chunks, "demo", stop_after=stop_after):
            seen.append(chunk)
            arr[chunk] = [chunk, chunk * chunk]
            builder.progress["total"] = builder.progress.get("total", 0) + chunk
        if builder.interrupted:
            return builder, seen, None
        return builder, seen, builder.finish(extra={"total": builder.progress["total"]})


def test_chunks_resume_where_they_stopped_and_flag_the_interruption(tmp_path):
    builder, seen, manifest = _chunked(tmp_path / "x", stop_after=2)
    assert seen == [0, 1] and builder.interrupted and manifest is None
    assert not (tmp_path / "x").exists()
    progress = json.loads((tmp_path / "x.partial" / "progress.json").read_text())["progress"]
    assert progress == {"chunks_done": 2, "total": 1}
    builder, seen, manifest = _chunked(tmp_path / "x", stop_after=0)  # stops before any chunk
    assert seen == [] and builder.interrupted
    builder, seen, manifest = _chunked(tmp_path / "x")
    assert seen == [2, 3, 4] and not builder.interrupted
    assert manifest["total"] == 0 + 1 + 2 + 3 + 4                  # the running total survived
    _, whole, _ = _chunked(tmp_path / "y")
    assert whole == [0, 1, 2, 3, 4]
    assert ((tmp_path / "x" / "values.bin").read_bytes()
            == (tmp_path / "y" / "values.bin").read_bytes())
    np.testing.assert_array_equal(open_array(tmp_path / "x", "values")[:, 1], [0, 1, 4, 9, 16])


def test_rebuild_rebuilds_a_complete_artifact_with_the_same_fingerprint(tmp_path):
    _, _, first = _chunked(tmp_path / "x")
    (tmp_path / "x" / "values.bin").write_bytes(b"\0" * 80)        # damaged after completion
    with pytest.raises(ArtifactError, match="does not match the sha256"):  # refused at reuse
        _chunked(tmp_path / "x")
    builder, seen, again = _chunked(tmp_path / "x", rebuild=True)
    assert seen == [0, 1, 2, 3, 4] and again["fingerprint"] == first["fingerprint"]
    np.testing.assert_array_equal(open_array(tmp_path / "x", "values")[:, 0], np.arange(5))


def test_rebuild_restarts_an_unfinished_build(tmp_path):
    _chunked(tmp_path / "x", stop_after=3)
    _, seen, manifest = _chunked(tmp_path / "x", rebuild=True)
    assert seen == [0, 1, 2, 3, 4] and manifest["total"] == 10


def _read_during_build(reader, source):
    """An artifact at ``reader`` whose build opens an array of ``source`` (whose manifest is
    read deep inside ``open_array``, as data modules do)."""
    builder = ArtifactBuilder(reader, kind="reader", config={})
    if builder.is_complete():
        return None
    with builder:
        values = np.asarray(open_array(source, "values"))
        builder.array("sum", np.float32, (1,))[0] = values.sum()
        return builder.finish()


def test_a_build_records_what_it_read_and_is_rebuilt_once_that_is_rebuilt_otherwise(tmp_path,
                                                                                    capsys):
    source, reader = tmp_path / "a", tmp_path / "nested" / "b"
    _build(source)
    before = read_manifest(source)["fingerprint"]
    manifest = _read_during_build(reader, source)
    assert manifest["reads"] == {"../../a": before}  # relative: the folder can move
    assert _read_during_build(reader, source) is None                 # same source: reused
    rebuilt = ArtifactBuilder(source, kind="demo", config={"n": 9}, rebuild=True)
    assert not rebuilt.is_complete()
    with rebuilt:
        rebuilt.array("values", np.float32, (4, 3))[:] = 1
        after = rebuilt.finish()["fingerprint"]
    assert error_of(["verify", str(tmp_path)], capsys) == (
        f"gnnlm verify: error: 1 of 2 artifacts in {tmp_path} are damaged: made from {source}: "
        f"fingerprint {before} → {after}, since rebuilt. Rerun with --rebuild=[reader] or "
        f"delete {reader}.")
    assert _read_during_build(reader, source)["reads"] == {"../../a": after}   # built again
    assert (f"[gnnlm] reader {reader}: rebuilding: it was made from artifacts since rebuilt "
            f"({source}: fingerprint {before} → {after})") in capsys.readouterr().err
    shutil.rmtree(source)
    with pytest.raises(ArtifactError, match=f"No complete artifact at {re.escape(str(source))}"):
        _read_during_build(reader, source)
    assert (f"({source}: fingerprint {after} → no complete artifact)"
            in capsys.readouterr().err)


def test_a_manifest_records_its_code_and_its_own_checksum(tmp_path):
    _build(tmp_path / "a")
    manifest = read_manifest(tmp_path / "a")
    assert manifest["made_by"] == code_version() and manifest["reads"] == {}
    assert manifest[MANIFEST_SHA256] == manifest_digest(manifest)
    file = tmp_path / "a" / "manifest.json"
    file.write_text(file.read_text().replace('"n": 8', '"n": 9'))      # a number edited
    with pytest.raises(ArtifactError) as err:
        read_manifest(tmp_path / "a")
    assert str(err.value) == (
        f"{file} was edited after it was written (its content no longer matches its "
        f"manifest_sha256). Rerun with --rebuild=[demo] or delete {tmp_path / 'a'}.")
    with pytest.raises(ArtifactError, match="was edited after it was written"):
        _build(tmp_path / "a")
