"""gnnlm.pipeline.training and gnnlm.pipeline.scoring: the best monitored weights are kept,
checkpoints load as data, and predict scores each position once."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.mark.parametrize("monitor", ["val/ppl", None])
def test_pipeline_keeps_the_best_monitored_weights(tmp_path, monitor):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from gnnlm.pipeline.kept_weights import restore_best_weights

    best, last = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.save({"state_dict": best.state_dict(), "global_step": 7}, tmp_path / "best.ckpt")
    callback = ModelCheckpoint(dirpath=tmp_path, monitor=monitor)
    callback.best_model_path = str(tmp_path / "best.ckpt")
    before = last.weight.detach().clone()
    step = restore_best_weights(
        SimpleNamespace(trainer=SimpleNamespace(checkpoint_callback=callback), model=last))
    expected = best.weight if monitor else before
    assert torch.equal(last.weight.detach(), expected.detach())
    assert step == (7 if monitor else None)  # the step the kept weights were saved at


class _Windows(torch.utils.data.Dataset):
    def __init__(self, n, T=8, V=30, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.stream = torch.randint(0, V, (n, T + 1), generator=g)

    def __len__(self):
        return len(self.stream)

    def __getitem__(self, i):
        return {"input": self.stream[i, :-1], "target": self.stream[i, 1:]}


def test_a_checkpoint_written_by_the_trainer_restores_the_best_weights(tmp_path):
    """A real Lightning checkpoint (optimizer, scheduler, callback and loop state) is plain data:
    the runner reads it with the safe loader and restores the best validation step."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from gnnlm.lit.lm import LanguageModel
    from gnnlm.lit.settings import OptimConfig
    from gnnlm.pipeline.ablations import load_language_model
    from gnnlm.pipeline.kept_weights import restore_best_weights

    torch.manual_seed(0)
    model = LanguageModel(vocab_size=30, context_length=8, n_layer=1, n_head=2, d_model=16,
                          d_ff=32, dropout=0.0, optim=OptimConfig(lr=3e-2, warmup_steps=1))
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/ppl", save_top_k=1)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(_Windows(8), batch_size=4),
                DataLoader(_Windows(4, seed=1), batch_size=4))
    best = torch.load(callback.best_model_path, weights_only=False)["state_dict"]
    with torch.no_grad():  # whatever the last step left, the restored weights are the best's
        for p in model.parameters():
            p.add_(1.0)
    restore_best_weights(SimpleNamespace(trainer=trainer, model=model))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, best[name], rtol=0, atol=0, msg=name)
    loaded = load_language_model(callback.best_model_path)
    assert not loaded.training and loaded.hparams.vocab_size == 30
    ids = torch.randint(0, 30, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).final, model.eval().model(ids).final)


def test_a_head_records_the_protocol_it_was_scored_with(tmp_path):
    """Segment models say their segments, streams and memory (the data module's own); heads
    that score the datastore's positions read its sliding windows (the features' manifest)."""
    from gnnlm.pipeline.scoring import scoring_protocol
    from gnnlm.workdir.builder import ArtifactBuilder
    from gnnlm.workdir.layout import Workdir

    wd = Workdir(tmp_path)
    builder = ArtifactBuilder(wd.features("test"), kind="features",
                              config={"split": "test", "context": 128, "stride": 64,
                                      "bos_each_window": True})
    with builder:
        builder.finish(extra={"n": 0})
    segments = SimpleNamespace(scoring_protocol=lambda memory: {"kind": "segments",
                                                                "segment": 128, "streams": 16,
                                                                "memory": memory})
    assert scoring_protocol(SimpleNamespace(memory_length=128), segments, wd)["memory"] == 128
    assert scoring_protocol(SimpleNamespace(), segments, wd)["memory"] == 0
    assert scoring_protocol(SimpleNamespace(), SimpleNamespace(), wd) == {
        "kind": "sliding_window", "context": 128, "stride": 64, "bos_each_window": True}


def test_predict_sets_the_split_on_both_and_stores_every_per_token_value():
    """The runner names the split once, on the data module (``connect``); every per-token
    value predict gives (SPALM: the mean gate) comes back in position order, as log p does."""
    import numpy as np
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gnnlm.pipeline.scoring import predict_logprobs, predict_tokens

    class Scores(pl.LightningModule):
        def predict_step(self, batch, batch_idx):
            return {"positions": batch, "logprob": -batch.float() / 10,
                    "gate": batch.float() / 100}

    class Positions(pl.LightningDataModule):
        predict_split = None

        def connect(self, predict_split=None):
            self.predict_split = predict_split or self.predict_split

        def predict_dataloader(self):
            order = {"valid": torch.tensor([3, 0, 4, 1, 2]), "test": torch.arange(5)}
            return DataLoader(order[self.predict_split], batch_size=2)

    model, data = Scores(), Positions()
    arrays = predict_tokens(model, data, "valid", 5)
    assert data.predict_split == "valid"
    assert set(arrays) == {"logprob", "gate"}
    np.testing.assert_allclose(arrays["gate"], np.arange(5) / 100, rtol=1e-6)
    np.testing.assert_allclose(arrays["logprob"], -np.arange(5) / 10, rtol=1e-6)
    assert all(a.dtype == np.float32 for a in arrays.values())
    np.testing.assert_array_equal(predict_logprobs(model, data, "test", 5), arrays["logprob"])
    assert data.predict_split == "test"
