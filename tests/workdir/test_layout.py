"""The work directory: one path per artifact, manifests read through it, relative paths."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gnnlm.workdir.layout import EVAL_SPLITS, SPLITS, Workdir, retrieval_tag
from gnnlm.workdir.refusals import ArtifactError
from tests.fakes import write_features


def test_every_artifact_has_its_path(tmp_path):
    wd = Workdir(tmp_path)
    assert wd.root == tmp_path and os.fspath(wd) == str(tmp_path)
    assert repr(wd) == f"Workdir({str(tmp_path)!r})"
    assert retrieval_tag("att", "l2") == "att-l2"
    expected = {
        wd.tokens: "tokens",
        wd.model("gnn"): "models/gnn",
        wd.base_lm_checkpoint: "models/base_lm/model.ckpt",
        wd.features("valid"): "features/valid",
        wd.output_embedding: "features/output_embedding",
        wd.index("att", "l2"): "index/att-l2",
        wd.neighbors("final", "cos", "train"): "neighbors/final-cos/train",
        wd.knn_cache("final", "cos", "exact", "test"): "knn_cache/final-cos-exact/test",
        wd.pq("final"): "pq/final",
        wd.ablations: "ablations",
        wd.logs("spalm"): "logs/spalm",
        wd.report("tests"): "reports/tests",
    }
    for path, relative in expected.items():
        assert path == tmp_path / relative
    assert len(set(expected)) == len(expected)                # no two artifacts share a folder
    # the output embedding sits beside the splits' features, never in one of them
    assert wd.output_embedding not in [wd.features(s) for s in SPLITS]
    assert SPLITS == ("train", "valid", "test") and EVAL_SPLITS == ("valid", "test")


def test_manifest_readers(tmp_path):
    wd = Workdir(tmp_path)
    write_features(wd.features("valid"), np.ones((7, 4), np.float32), split="valid")
    assert wd.n_positions("valid") == 7
    assert wd.features_manifest("valid")["kind"] == "features"
    with pytest.raises(ArtifactError, match="No complete features at .*features/test"):
        wd.n_positions("test")


def test_relative_and_resolve_round_trip(tmp_path):
    wd = Workdir(tmp_path / "work")
    inside = wd.base_lm_checkpoint
    assert wd.relative(inside) == "models/base_lm/model.ckpt"
    assert wd.resolve(wd.relative(inside)) == inside
    outside = tmp_path / "elsewhere" / "lm.ckpt"
    assert wd.relative(outside) == str(outside)                    # kept absolute
    assert wd.resolve(wd.relative(outside)) == outside
    assert wd.resolve("hf-cache/x") == tmp_path / "work" / "hf-cache" / "x"


def test_a_relative_root_resolves_against_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wd = Workdir("runs/x")
    assert wd.relative(tmp_path / "runs" / "x" / "models" / "gnn") == "models/gnn"
    assert wd.relative("runs/x/models/gnn") == "models/gnn"
    assert wd.resolve("models/gnn") == Path("runs/x/models/gnn")


def test_a_moved_work_directory_keeps_its_recorded_paths(tmp_path):
    old = Workdir(tmp_path / "old")
    old.base_lm_checkpoint.parent.mkdir(parents=True)
    old.base_lm_checkpoint.write_bytes(b"weights")
    recorded = old.relative(old.base_lm_checkpoint)                 # what a manifest keeps
    write_features(old.features("train"), np.zeros((3, 2), np.float32))
    shutil.move(tmp_path / "old", tmp_path / "new")
    new = Workdir(tmp_path / "new")
    assert new.resolve(recorded).read_bytes() == b"weights"
    assert new.n_positions("train") == 3
    assert not old.root.exists()


def test_a_work_directory_of_the_earlier_layout_is_refused_before_any_stage(tmp_path):
    """Trained models were in heads/, and the features' manifests point there: the pipeline
    refuses such a directory rather than rebuilding beside what it cannot reuse."""
    wd = Workdir(tmp_path / "old")
    (wd.root / "heads" / "base_lm").mkdir(parents=True)
    with pytest.raises(ArtifactError, match=r"heads/, the layout of an earlier gnnlm \(now "
                                            r"models/\).*give another workdir"):
        wd.check_layout()
    Workdir(tmp_path / "new").check_layout()            # a fresh directory
    (wd.root / "models").mkdir()
    wd.check_layout()                                   # both: the user has moved on
