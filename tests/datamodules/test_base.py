"""datamodules.base: what every data module over ``gnnlm pipeline``'s work directory shares — the
one error for artifacts not built yet, the sizes and base LM linked into the model from the train
features' manifest, the token stream and output embedding of the datastore, and the evaluation
loaders (the concrete data modules are in tests/datamodules/test_datamodules.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.base import WorkdirDataModule
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.refusals import ArtifactError
from tests.fakes import write_features, write_output_embedding

D, V = 4, 11


class TargetsData(WorkdirDataModule):
    """The smallest data module over a work directory: the train features' manifest read as
    every subclass reads it, and each split's targets as its evaluation data."""

    def __init__(self, workdir: str):
        super().__init__(workdir, "valid")
        with self.reading_artifacts("features"):
            train = self.workdir.features_manifest("train")
        self.use_features(train)

    def eval_dataloader(self, split: str) -> DataLoader:
        return DataLoader([self.token_stream(split, 5, bos_id=V)], batch_size=None)


@pytest.fixture
def work(tmp_path):
    wd = Workdir(tmp_path / "work")
    rng = np.random.default_rng(0)
    for split, n, first in (("train", 12, 0), ("valid", 7, 3), ("test", 9, 6)):
        targets = (first + np.arange(n, dtype=np.int32)) % V
        write_features(wd.features(split), rng.standard_normal((n, D)).astype(np.float32),
                       targets=targets, split=split, vocab_size=V)
    return wd


def test_artifacts_not_built_yet_are_one_error_saying_what_to_run(tmp_path):
    with pytest.raises(ArtifactError) as err:
        TargetsData(str(tmp_path / "empty"))
    message = str(err.value)
    assert message.endswith(" TargetsData reads the artifacts of `gnnlm pipeline` (features); "
                            "run its retrieval stages first.")
    assert str(tmp_path / "empty") in message              # the artifact's own error first
    assert isinstance(err.value.__cause__, ArtifactError)


def test_the_sizes_linked_into_the_model_are_the_train_features(work):
    data = TargetsData(str(work.root))
    assert (data.vocab_size, data.feature_dim) == (V, D)
    # a base LM without logit scale or soft-capping: its logits as they are
    x = torch.randn(3, V)
    torch.testing.assert_close(data.logit_transform(x), x)


def test_the_base_lm_s_logit_scale_and_soft_cap_come_with_its_features(work):
    data = TargetsData(str(work.root))
    data.use_features({"vocab_size": V, "dim": D,
                       "base_lm": {"name": "x", "fingerprint": "f", "logit_scale": 0.5,
                                   "logit_softcap": 2.0}})
    x = torch.linspace(-20, 20, V)
    out = data.logit_transform(x)
    torch.testing.assert_close(out, 2.0 * torch.tanh(0.5 * x / 2.0))
    assert out.abs().max() < 2.0


def test_the_base_lm_is_the_given_path_or_where_the_features_say(work):
    data = TargetsData(str(work.root))
    identity = {"name": "gpt", "fingerprint": "abc"}
    with pytest.raises(ArtifactError) as err:
        data.use_base_lm({"base_lm": identity}, None)
    assert str(err.value) == (f"The features in {work.features('train')} do not record where "
                              f"their base LM is: pass base_lm_path.")
    data.use_base_lm({"base_lm": identity}, "/models/lm.ckpt")
    assert (data.base_lm, data.base_lm_fingerprint) == ("/models/lm.ckpt", "abc")
    data.use_base_lm({"base_lm": {**identity, "location": "hf:gpt2"}}, None)
    assert data.base_lm == "hf:gpt2"
    # a checkpoint recorded relative to the work directory, so that the directory can move
    data.use_base_lm({"base_lm": {**identity, "location": "models/base_lm/last.ckpt"}}, None)
    assert data.base_lm == str(work.root / "models" / "base_lm" / "last.ckpt")
    data.use_base_lm({"base_lm": {**identity, "location": "models/base_lm/last.ckpt"}},
                     "/elsewhere/lm.ckpt")
    assert data.base_lm == "/elsewhere/lm.ckpt"


def test_the_token_stream_is_bos_and_the_features_targets(work):
    data = TargetsData(str(work.root))
    assert data.token_stream("test", 4, bos_id=V).tolist() == [V, 6, 7, 8, 9]
    assert data.token_stream("train", 12, bos_id=V).tolist() == [V, *range(V), 0]


def test_the_output_embedding_is_the_base_lm_s(work):
    rng = np.random.default_rng(1)
    weight, bias = rng.standard_normal((V, D)), rng.standard_normal(V)
    write_output_embedding(work, weight, bias)
    got_weight, got_bias = TargetsData(str(work.root)).output_embedding()
    np.testing.assert_array_equal(got_weight.numpy(), weight.astype(np.float32))
    np.testing.assert_array_equal(got_bias.numpy(), bias.astype(np.float32))


def test_validation_and_test_score_their_own_split(work):
    data = TargetsData(str(work.root))
    assert [batch.tolist() for batch in data.val_dataloader()] == [[V, 3, 4, 5, 6, 7]]
    assert [batch.tolist() for batch in data.test_dataloader()] == [[V, 6, 7, 8, 9, 10]]
