"""The WikiText-103 pipeline's first stages, with its config's shape, on a WikiText-2 slice:
features and neighbours written by 2 processes, the IVF-PQ index its auto rule chooses at that
scale, and the same artifacts a 1-process build would give."""
from __future__ import annotations

import numpy as np
import pytest

from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.stages import stage_base_lm, stage_features, stage_retrieval
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_first_stages_of_the_wikitext103_config_on_a_slice(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    ckpt = workdir / "models" / "base_lm" / "model.ckpt"   # the test pipeline's LM: no training
    # with a GNN-LM head, whose graphs read the train neighbours (only then are they searched);
    # these first stages do not train it
    cfg = load_config(["-c", "configs/wikitext103/pipeline.yaml",
                       "-c", "configs/tests/wikitext103_slice.yaml",
                       "--gnn.config=[configs/trainer/cpu.yaml,configs/wikitext2/gnnlm.yaml]",
                       f"--base_lm.ckpt={ckpt}", f"--workdir={tmp_path / 'w'}"])
    assert cfg.features.devices == 2 and cfg.neighbors.devices == 2
    wd = Workdir(cfg.workdir)
    model, store, _, location = stage_base_lm(cfg, wd)
    features = stage_features(cfg, model, store, wd, location)
    assert features["train"]["n"] == 40000 and features["train"]["devices"] == 2
    retrieval = stage_retrieval(cfg, wd, "final", features["train"]["config"]["context"])
    index = retrieval.index
    assert index["factory"].startswith(("IVF", "OPQ")) and "PQ16" in index["factory"]
    assert index["tuning"] and index["recall"]["10"] > 0
    train = read_manifest(wd.neighbors("final", "cos", "train"))
    assert train["devices"] == 2 and train["n"] == 8000 and train["masked"]
    ids = np.asarray(open_array(wd.neighbors("final", "cos", "train"), "ids")).astype(np.int64)
    t = np.arange(len(ids))[:, None]
    assert not np.any((ids >= 0) & (ids - t >= 0) & (ids - t <= 64))  # none read the target
    assert (wd.knn_cache("final", "cos", "faiss", "test") / "manifest.json").is_file()
