"""LightningModules of the heads: what they train, what they leave frozen, what they predict."""
from __future__ import annotations

import pytest
import torch

from gnnlm.lit.heads import LearnedDatastoreLM, SpalmFinetuneLM, SpalmLM
from tests.fakes import save_lm_checkpoint


@pytest.fixture
def lm_checkpoint(tmp_path):
    """A tiny built-in LM saved as a ``gnnlm fit`` checkpoint (what load_base_lm reads)."""
    path, lm = save_lm_checkpoint(tmp_path / "lm.ckpt")
    return path, lm.model.eval()


def _windows_batch(V=50, B=3, T=16, K=4):
    torch.manual_seed(1)
    stream = torch.randint(0, V, (B, T + 1))
    values = torch.randint(-1, V, (B, T, K))
    return {"input": stream[:, :-1], "target": stream[:, 1:], "nbr_values": values,
            "mask": torch.ones(B, T), "positions": torch.arange(B * T).view(B, T)}


def test_spalm_finetune_with_gate_one_and_no_training_is_the_base_lm(lm_checkpoint):
    path, base = lm_checkpoint
    model = SpalmFinetuneLM(base_lm=path).eval()
    batch = _windows_batch()
    logits, gate = model(batch, force_gate=1.0)
    with torch.no_grad():
        expected = base.logits(base(batch["input"]).final).flatten(0, 1)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.all(gate == 1)


def test_spalm_finetune_trains_only_the_last_block_the_final_norm_and_the_gate(lm_checkpoint):
    path, _ = lm_checkpoint
    model = SpalmFinetuneLM(base_lm=path).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("lm.blocks.2.", "lm.ln_f.", "head.")) for n in trainable)
    assert any(n.startswith("lm.blocks.2.") for n in trainable)
    # the frozen layers keep eval mode (no dropout): the last block reads datastore-time inputs
    assert not model.lm.blocks[0].training and model.lm.blocks[2].training
    nll, mask, positions = model.token_nll(_windows_batch(), "train")
    (nll * mask).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    assert positions.shape == nll.shape == mask.shape


def test_spalm_finetune_refuses_another_base_lm_than_the_datastore_s(lm_checkpoint):
    path, _ = lm_checkpoint
    with pytest.raises(ValueError, match="not the one the datastore was built with"):
        SpalmFinetuneLM(base_lm=path, base_lm_fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match="needs base_lm"):
        SpalmFinetuneLM()
    with pytest.raises(ValueError, match="vocab_size=7"):
        SpalmFinetuneLM(base_lm=path, vocab_size=7)


def _feature_batch(V=20, d=8, B=6, K=3):
    torch.manual_seed(2)
    return {"h": torch.randn(B, d), "target": torch.randint(0, V, (B,)),
            "nbr_values": torch.randint(-1, V, (B, K)), "positions": torch.arange(10, 10 + B)}


def test_spalm_on_frozen_features_with_gate_one_is_the_output_embedding():
    torch.manual_seed(0)
    weight, bias = torch.randn(20, 8), torch.randn(20)
    model = SpalmLM(vocab_size=20, feature_dim=8)
    with pytest.raises(RuntimeError, match="attach_output_embedding"):
        model(_feature_batch())
    with pytest.raises(ValueError, match="4×8 but the model was built for vocab_size=20"):
        model.attach_output_embedding(torch.randn(4, 8), None)
    model.attach_output_embedding(weight, bias)
    batch = _feature_batch()
    logits, gate = model(batch, force_gate=1.0)
    torch.testing.assert_close(logits, batch["h"] @ weight.T + bias, rtol=0, atol=0)
    nll, mask, positions = model.token_nll(batch, "val")
    expected = -torch.log_softmax(model(batch)[0], -1)[torch.arange(6), batch["target"]]
    torch.testing.assert_close(nll, expected)
    assert torch.all(mask == 1) and torch.equal(positions, batch["positions"])
    # the output embedding is not saved with the head: it belongs to the base LM
    assert not any(name.startswith("out_") for name in model.state_dict())


def test_learned_datastore_nll_and_predict_step():
    model = LearnedDatastoreLM(vocab_size=20, feature_dim=8, embeddings_per_word=2)
    batch = _feature_batch()
    nll, mask, positions = model.token_nll(batch, "train")
    expected = -model.head(batch["h"])[torch.arange(6), batch["target"]]
    torch.testing.assert_close(nll, expected)
    out = model.predict_step(batch, 0)
    torch.testing.assert_close(out["logprob"], -nll.detach())
    assert torch.equal(out["positions"], batch["positions"])


def test_spalm_heads_predict_each_token_s_mean_gate(lm_checkpoint):
    """One gate per token, its mean over the d dimensions, as SPALM end to end gives it (the
    runner stores it as <split>_gate); only scored tokens."""
    path, _ = lm_checkpoint
    frozen = SpalmLM(vocab_size=20, feature_dim=8, gate_bias=0.5)
    frozen.attach_output_embedding(torch.randn(20, 8), torch.randn(20))
    batch = _feature_batch()
    finetuned = SpalmFinetuneLM(base_lm=path).eval()
    windows = _windows_batch()
    windows["mask"][0, :5] = 0                                          # unscored positions
    for model, data in ((frozen, batch), (finetuned, windows)):
        with torch.no_grad():
            out = model.predict_step(data, 0)
            logits, gate = model(data)
        keep = data.get("mask", torch.ones(len(gate))).flatten().bool()
        assert set(out) == {"positions", "logprob", "gate"}
        assert out["gate"].dtype == torch.float32 and out["gate"].shape == out["logprob"].shape
        torch.testing.assert_close(out["gate"], gate[keep].mean(-1))
        assert torch.equal(out["positions"], data["positions"].flatten()[keep])
        assert not hasattr(model, "gate_histogram")
    assert frozen.deviations() == ["gate bias"] and finetuned.deviations() == []
