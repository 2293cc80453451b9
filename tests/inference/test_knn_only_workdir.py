"""A work directory the pipeline built for kNN-LM alone (the tiny GPT-2's: no head in its config)
holds valid and test neighbours but searched no train query; a data module that reads the train
neighbours is refused in one line that says how to get them, and one that reads none works."""
from __future__ import annotations

import pytest

from gnnlm.workdir.manifests import is_complete
from gnnlm.workdir.refusals import ArtifactError

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("data_module", ["graph.GraphDataModule", "spalm.SpalmDataModule",
                                         "retrieval_windows.RetrievalWindowsDataModule",
                                         "features.FeatureDataModule"])
def test_a_head_reading_train_neighbours_is_told_to_add_itself_to_the_pipeline(data_module,
                                                                               gpt2_work):
    import importlib

    from gnnlm.workdir.layout import Workdir

    module, name = data_module.split(".")
    cls = getattr(importlib.import_module(f"datamodules.{module}"), name)
    workdir = Workdir(gpt2_work.work)
    assert is_complete(workdir.neighbors("final", "cos", "valid"))
    assert not workdir.neighbors("final", "cos", "train").exists()
    extra = {"retrieved": 4} if name == "FeatureDataModule" else {}
    with pytest.raises(ArtifactError) as refused:
        cls(workdir=str(gpt2_work.work), key="final", metric="cos", **extra)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{name} reads the train neighbours")
    assert "searches train queries only when its config has a head that reads" in message
    assert "only for its primary key (knn.keys[0])" in message
    if name == "FeatureDataModule":  # without retrieved values it reads no neighbour
        assert cls(workdir=str(gpt2_work.work), key="final", metric="cos").feature_dim > 0
