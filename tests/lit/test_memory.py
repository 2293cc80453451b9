"""gnnlm.lit.memory: the Transformer-XL memory a batch leaves is what the next batch of the same
stage reads; each stage keeps its own, a pass starts without any, a stage that ends lets it go,
a smaller final batch reads none, and a module without memory keeps nothing."""
from __future__ import annotations

import pytest
import torch

from gnnlm.lit.memory import SegmentMemory

STAGES = ("train", "val", "test", "predict")
START = {"train": "on_train_epoch_start", "val": "on_validation_epoch_start",
         "test": "on_test_epoch_start", "predict": "on_predict_epoch_start"}


class Cached(SegmentMemory):
    """The mixin alone, as a LightningModule with ``memory_length`` M uses it."""

    def __init__(self, memory_length: int):
        super().__init__()
        self.memory_length = memory_length


def states(batch: int, fill: float, layers: int = 2) -> list[torch.Tensor]:
    return [torch.full((batch, 3, 4), fill + layer) for layer in range(layers)]


def test_the_next_batch_of_a_stage_reads_what_the_last_one_left():
    module = Cached(memory_length=3)
    assert all(module.memory_for(stage, 2) is None for stage in STAGES)   # a pass starts empty
    first, second = states(2, 1.0), states(2, 10.0)
    module.keep_memory("train", first)
    assert module.memory_for("train", 2) is first
    module.keep_memory("train", second)
    assert module.memory_for("train", 2) is second


def test_each_stage_keeps_its_own_memory():
    module = Cached(memory_length=3)
    kept = {stage: states(2, float(i)) for i, stage in enumerate(STAGES)}
    for stage, memory in kept.items():
        module.keep_memory(stage, memory)
    for stage, memory in kept.items():
        assert module.memory_for(stage, 2) is memory


@pytest.mark.parametrize("stage", STAGES)
def test_a_pass_over_a_split_starts_without_memory_and_leaves_the_others(stage):
    module = Cached(memory_length=3)
    kept = {s: states(2, float(i)) for i, s in enumerate(STAGES)}
    for s, memory in kept.items():
        module.keep_memory(s, memory)
    getattr(module, START[stage])()
    assert module.memory_for(stage, 2) is None
    assert all(module.memory_for(s, 2) is kept[s] for s in STAGES if s != stage)


def test_a_smaller_final_batch_reads_no_memory():
    """Its streams are not those of the batch before it."""
    module = Cached(memory_length=3)
    module.keep_memory("val", states(4, 0.0))
    assert module.memory_for("val", 3) is None
    assert module.memory_for("val", 4) is not None


def test_a_module_without_memory_keeps_none():
    module = Cached(memory_length=0)
    module.keep_memory("train", states(2, 0.0))
    assert module.memory_for("train", 2) is None
    module.memory_length = 2   # nothing was kept while it had none
    assert module.memory_for("train", 2) is None


def test_the_lm_s_second_segment_is_scored_with_the_first_segment_s_memory():
    """Through the base LM's LightningModule: predicting segment 2 after segment 1 scores it as
    the network given segment 1's memory; a new pass scores it as the network without any."""
    from gnnlm.lit.lm import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(vocab_size=17, context_length=8, n_layer=2, n_head=2, d_model=16,
                          d_ff=32, dropout=0.0, memory_length=4).eval()
    stream = torch.randint(0, 17, (2, 13))
    segments = [{"input": stream[:, s:s + 6], "target": stream[:, s + 1:s + 7],
                 "positions": torch.arange(s, s + 6).repeat(2, 1)} for s in (0, 6)]

    def logprob(network_out, target):
        logits = model.model.logits(network_out.final).log_softmax(-1)
        return logits.gather(-1, target[..., None]).flatten()

    with torch.no_grad():
        model.on_predict_epoch_start()
        model.predict_step(segments[0], 0)
        carried = model.predict_step(segments[1], 1)["logprob"]
        first = model.model(segments[0]["input"])
        with_memory = logprob(model.model(segments[1]["input"], memory=first.memory),
                              segments[1]["target"])
        without = logprob(model.model(segments[1]["input"]), segments[1]["target"])
        model.on_predict_epoch_start()
        fresh = model.predict_step(segments[1], 0)["logprob"]
    torch.testing.assert_close(carried, with_memory)
    torch.testing.assert_close(fresh, without)
    assert not torch.allclose(carried, fresh)


END = {"train": "on_train_end", "val": "on_validation_end", "test": "on_test_end",
       "predict": "on_predict_end"}


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_that_ends_lets_its_memory_go_and_leaves_the_others(stage):
    """Otherwise the next stage holds it beside its own (on a GPU, until the module is freed);
    a validation run inside fit ends without touching the training streams' memory."""
    module = Cached(memory_length=3)
    kept = {s: states(2, float(i)) for i, s in enumerate(STAGES)}
    for s, memory in kept.items():
        module.keep_memory(s, memory)
    getattr(module, END[stage])()
    assert module._memory[stage] is None
    assert all(module.memory_for(s, 2) is kept[s] for s in STAGES if s != stage)


def test_fit_ends_with_no_memory_held():
    """Through Lightning: a fit of the base LM with memory (training and validation segments)
    leaves the module holding no memory of either stage."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gnnlm.lit.lm import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(vocab_size=17, context_length=8, n_layer=2, n_head=2, d_model=16,
                          d_ff=32, dropout=0.0, memory_length=4)
    stream = torch.randint(0, 17, (2, 25))
    segments = [{"input": stream[:, s:s + 6], "target": stream[:, s + 1:s + 7],
                 "positions": torch.arange(s, s + 6).repeat(2, 1)} for s in (0, 6, 12)]
    seen: dict[str, bool] = {}

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen["train"] = module._memory.get("train") is not None

        def on_validation_batch_end(self, trainer, module, *args):
            seen["val"] = module._memory.get("val") is not None

    def loader():
        return DataLoader(segments, batch_size=None)

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, callbacks=[Watch()],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, loader(), loader())
    assert seen == {"train": True, "val": True}      # each stage carried memory while it ran
    assert all(memory is None for memory in model._memory.values())
