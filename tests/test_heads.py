import pytest
import torch

from gnnlm.heads import MultiEmbeddingSoftmax, SpalmGate
from gnnlm.models.gpt import GPT, GPTConfig


@pytest.fixture
def setup():
    torch.manual_seed(0)
    V, d, B, K = 40, 8, 5, 4
    weight, bias = torch.randn(V, d), torch.randn(V)
    h = torch.randn(B, d)
    values = torch.randint(0, V, (B, K))
    values[0, 2:] = -1           # fewer neighbours
    values[1] = -1               # none at all
    return SpalmGate(d), h, values, weight, bias


def test_spalm_gate_one_is_exactly_the_base_lm(setup):
    gate, h, values, weight, bias = setup
    logits, g = gate(h, values, weight, bias, force_gate=1.0)
    torch.testing.assert_close(logits, h @ weight.T + bias, rtol=0, atol=0)
    assert torch.all(g == 1)


def test_spalm_gate_zero_predicts_from_memory_alone(setup):
    gate, h, values, weight, bias = setup
    logits, _ = gate(h, values, weight, bias, force_gate=0.0)
    for b in range(h.shape[0]):
        ys = weight[values[b][values[b] >= 0]]
        if len(ys) == 0:
            expected = bias                               # m = 0: nothing retrieved
        else:
            attn = torch.softmax(ys @ h[b], dim=0)
            expected = (attn @ ys) @ weight.T + bias
        torch.testing.assert_close(logits[b], expected)


def test_spalm_learned_gate_is_between(setup):
    gate, h, values, weight, bias = setup
    logits, g = gate(h, values, weight, bias)
    assert torch.all((g > 0) & (g < 1))
    assert g.shape == h.shape                                        # one gate per dimension
    z_scalar = [gate(h, values, weight, bias, force_gate=x)[0] for x in (0.0, 1.0)]
    with torch.no_grad():                                            # a constant gate: W z is
        gate.gate.weight.zero_()                                     # linear in g
        logits, g = gate(h, values, weight, bias)
    c = g[:, :1]
    torch.testing.assert_close(logits, (1 - c) * z_scalar[0] + c * z_scalar[1], atol=1e-5,
                               rtol=1e-5)


def test_multi_embedding_with_one_row_per_word_is_a_plain_softmax():
    torch.manual_seed(0)
    head = MultiEmbeddingSoftmax(vocab_size=30, dim=6, n=1)
    h = torch.randn(7, 6)
    torch.testing.assert_close(head(h), torch.log_softmax(h @ head.weight.T, -1))


def test_multi_embedding_sums_probabilities_per_word():
    torch.manual_seed(0)
    head = MultiEmbeddingSoftmax(vocab_size=5, dim=3, n=3)
    h = torch.randn(2, 3)
    probs = torch.softmax(h @ head.weight.T, -1).view(2, 3, 5).sum(1)
    torch.testing.assert_close(head(h).exp(), probs)
    torch.testing.assert_close(head(h).exp().sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="got 0"):
        MultiEmbeddingSoftmax(5, 3, n=0)


def _gpt(memory_length):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, context_length=8, n_layer=2, n_head=2, d_model=16,
                         d_ff=32, dropout=0.0, memory_length=memory_length)).eval()


def test_transformer_xl_memory_carries_the_previous_segment():
    model = _gpt(memory_length=8)
    prev_a, prev_b = torch.randint(0, 50, (2, 1, 8))
    current = torch.randint(0, 50, (1, 8))
    mem_a, mem_b = model(prev_a).memory, model(prev_b).memory
    assert len(mem_a) == 2 and mem_a[0].shape == (1, 8, 16) and not mem_a[0].requires_grad
    out_a, out_b = model(current, memory=mem_a), model(current, memory=mem_b)
    assert not torch.allclose(out_a.final, out_b.final, atol=1e-4)
    # without memory the previous segment has no effect
    no_mem = _gpt(memory_length=0)
    torch.testing.assert_close(no_mem(current).final, no_mem(current).final)
    assert no_mem(prev_a).memory is None


def test_memory_positions_are_relative():
    """With rotary positions, [memory | segment] equals one forward pass over the joined text."""
    model = _gpt(memory_length=8)
    a, b = torch.randint(0, 50, (2, 1, 8))
    with torch.no_grad():
        joined = model(torch.cat([a, b], dim=1)).final[:, 8:]
        # the memory of layer l is that layer's input for segment a: exact Transformer-XL
        stepped = model(b, memory=model(a).memory).final
    torch.testing.assert_close(stepped, joined, atol=1e-5, rtol=1e-5)


@pytest.fixture
def lm_checkpoint(tmp_path):
    """A tiny built-in LM saved as a ``gnnlm fit`` checkpoint (what load_base_lm reads)."""
    import pytorch_lightning as pl

    from gnnlm.lm_module import LanguageModel

    torch.manual_seed(0)
    lm = LanguageModel(vocab_size=50, context_length=16, n_layer=3, n_head=2, d_model=16,
                       d_ff=32, dropout=0.2)
    path = tmp_path / "lm.ckpt"
    torch.save({"state_dict": lm.state_dict(), "hyper_parameters": dict(lm.hparams),
                "pytorch-lightning_version": pl.__version__}, path)
    return str(path), lm.model.eval()


def _windows_batch(V=50, B=3, T=16, K=4):
    torch.manual_seed(1)
    stream = torch.randint(0, V, (B, T + 1))
    values = torch.randint(-1, V, (B, T, K))
    return {"input": stream[:, :-1], "target": stream[:, 1:], "nbr_values": values,
            "mask": torch.ones(B, T), "positions": torch.arange(B * T).view(B, T)}


def test_spalm_finetune_with_gate_one_and_no_training_is_the_base_lm(lm_checkpoint):
    from gnnlm.head_modules import SpalmFinetuneLM

    path, base = lm_checkpoint
    model = SpalmFinetuneLM(base_lm=path).eval()
    batch = _windows_batch()
    logits, gate = model(batch, force_gate=1.0)
    with torch.no_grad():
        expected = base.logits(base(batch["input"]).final).flatten(0, 1)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.all(gate == 1)


def test_spalm_finetune_trains_only_the_last_block_the_final_norm_and_the_gate(lm_checkpoint):
    from gnnlm.head_modules import SpalmFinetuneLM

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
    from gnnlm.head_modules import SpalmFinetuneLM

    path, _ = lm_checkpoint
    with pytest.raises(ValueError, match="not the one the datastore was built with"):
        SpalmFinetuneLM(base_lm=path, base_lm_fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match="needs base_lm"):
        SpalmFinetuneLM()
    with pytest.raises(ValueError, match="vocab_size=7"):
        SpalmFinetuneLM(base_lm=path, vocab_size=7)
