import json

import numpy as np
import pytest

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, open_array, read_manifest


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
