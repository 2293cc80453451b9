"""The GPU's training step: AdamW's fused kernel under bf16 autocast with gradient clipping, as
``configs/trainer/gpu.yaml`` and the WikiText-2 configs train every model. Lightning's
mixed-precision plugin refuses to clip for any fused optimiser, bf16 too, though bf16 scales no
loss; gnnlm clips there itself. Run on the CPU, whose AdamW has a fused kernel too: the fused
path is forced by saying the parameters are on CUDA."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch

import gnnlm.lit.optim as optim_module
from gnnlm.lit.lm import LanguageModel
from gnnlm.lit.optim import takes_fused_step
from gnnlm.lit.settings import OptimConfig

STEPS, ROWS, WINDOW = 4, 4, 32
CLIP = 0.05   # well under this small model's gradient norm on WikiText-2, so every step clips


def wikitext_batches(tokens) -> list[dict]:
    """``STEPS`` batches of ``ROWS`` consecutive WikiText-2 training windows."""
    ids = torch.from_numpy(tokens.split("train")[:STEPS * ROWS * WINDOW + 1].astype("int64"))
    x, y = ids[:-1].view(STEPS, ROWS, WINDOW), ids[1:].view(STEPS, ROWS, WINDOW)
    return [{"input": x[i], "target": y[i], "mask": torch.ones(ROWS, WINDOW)}
            for i in range(STEPS)]


def trained(tokens, fused: bool, monkeypatch) -> tuple[LanguageModel, torch.optim.Optimizer]:
    monkeypatch.setattr(optim_module, "on_cuda", lambda params: fused)
    torch.manual_seed(0)
    model = LanguageModel(vocab_size=tokens.vocab_size, context_length=WINDOW, n_layer=1,
                          n_head=2, d_model=16, d_ff=32, dropout=0.0,
                          optim=OptimConfig(lr=1e-2, warmup_steps=1))
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", gradient_clip_val=CLIP,
                         max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False,
                         limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(wikitext_batches(tokens), batch_size=None))
    assert trainer.global_step == STEPS
    return model, trainer.optimizers[0]


def test_fused_adamw_clips_under_bf16_autocast_as_the_unfused_one_does(wikitext_tokens,
                                                                       monkeypatch):
    fused, fused_opt = trained(wikitext_tokens, True, monkeypatch)
    plain, plain_opt = trained(wikitext_tokens, False, monkeypatch)
    assert fused_opt.defaults["fused"] and not plain_opt.defaults["fused"]
    # the last step's gradients, as the optimiser read them: clipped to CLIP
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in fused.parameters()])
    assert grad_norm == pytest.approx(CLIP, rel=1e-3)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("precision, clip, fused", [
    ("bf16-mixed", 1.0, True),    # no loss scaler: clipped by TokenLevelModule
    ("16-mixed", 0.0, True),      # the fused step unscales inside its kernel
    ("16-mixed", 1.0, False),     # clipping would see the scaled gradients
    ("32-true", 1.0, True)])
def test_adamw_is_fused_on_cuda_unless_clipping_would_see_scaled_gradients(
        precision, clip, fused, monkeypatch):
    scaler = object() if precision == "16-mixed" else None
    trainer = SimpleNamespace(gradient_clip_val=clip,
                              precision_plugin=SimpleNamespace(scaler=scaler))
    params = [torch.nn.Parameter(torch.ones(2))]
    monkeypatch.setattr(optim_module, "on_cuda", lambda params: True)
    assert takes_fused_step(params, trainer) is fused
    monkeypatch.setattr(optim_module, "on_cuda", lambda params: False)
    assert takes_fused_step(params, trainer) is False
