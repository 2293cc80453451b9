"""Base LMs: features, output embedding, causality, fingerprints, Transformer-XL memory."""
import pytest
import torch

from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.models.hf import HFCausalLM


@pytest.fixture
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, context_length=32, n_layer=2, n_head=2, d_model=16,
                         d_ff=32, dropout=0.0)).eval()


@pytest.fixture
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg).eval(), name="tiny-gpt2")


@pytest.mark.parametrize("lm", ["gpt", "tiny_gpt2"])
def test_final_times_output_embedding_gives_the_logits(lm, request):
    model = request.getfixturevalue(lm)
    ids = torch.randint(0, model.vocab_size, (2, 12))
    feats = model(ids)
    assert feats.final.shape == feats.att.shape == (2, 12, model.hidden_size)
    weight, bias = model.output_embedding()
    logits = feats.final @ weight.T + (0 if bias is None else bias)
    reference = (model.model(ids).logits if isinstance(model, HFCausalLM)
                 else model.logits(model(ids).final))
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(feats.att, feats.final, atol=1e-3)  # att is another view


def test_hf_att_is_the_last_mlp_input_and_forward_is_untouched(tiny_gpt2):
    ids = torch.randint(0, 61, (1, 9))
    captured = {}
    block = tiny_gpt2.model.transformer.h[-1]
    handle = block.ln_2.register_forward_hook(lambda m, a, out: captured.setdefault("ln2", out))
    feats = tiny_gpt2(ids)
    handle.remove()
    torch.testing.assert_close(feats.att, captured["ln2"])
    assert type(tiny_gpt2.model).forward is type(tiny_gpt2.model).__dict__.get(
        "forward", type(tiny_gpt2.model).forward)


def test_hf_adapter_loads_a_saved_model_from_a_folder(tiny_gpt2, tmp_path):
    from gnnlm.models import load_base_lm

    tiny_gpt2.model.save_pretrained(tmp_path / "m")
    loaded = load_base_lm(f"hf:{tmp_path / 'm'}")
    ids = torch.randint(0, 61, (1, 7))
    torch.testing.assert_close(loaded(ids).final, tiny_gpt2(ids).final)
    assert loaded.fingerprint() == tiny_gpt2.fingerprint()
    assert not any(p.requires_grad for p in loaded.parameters())


def test_features_are_causal(gpt):
    ids = torch.randint(0, 97, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 97
    a, b = gpt(ids), gpt(changed)
    torch.testing.assert_close(a.final[0, :10], b.final[0, :10])
    assert not torch.allclose(a.final[0, 10:], b.final[0, 10:])


def test_fingerprint_tracks_the_weights(gpt):
    before = gpt.fingerprint()
    gpt._fingerprint = None
    assert gpt.fingerprint() == before
    with torch.no_grad():
        gpt.ln_f.weight.add_(1.0)
    gpt._fingerprint = None
    assert gpt.fingerprint() != before


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(vocab_size=10, d_model=30, n_head=4)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=0)


def test_the_built_in_model_is_named_by_kind_not_by_path(gpt):
    identity = gpt.identity()
    assert identity == {"name": "gpt", "fingerprint": gpt.fingerprint(), "vocab_size": 97,
                        "hidden_size": 16}


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
    # Called without memory, the memory model is the same weights with memory switched off.
    no_mem = _gpt(memory_length=0)
    assert no_mem.fingerprint() == model.fingerprint()
    torch.testing.assert_close(model(current).final, no_mem(current).final, rtol=0, atol=0)
    torch.testing.assert_close(model(current).att, no_mem(current).att, rtol=0, atol=0)
    assert not torch.allclose(out_a.final, no_mem(current).final, atol=1e-4)
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


def test_memory_must_hold_one_tensor_per_layer():
    model = _gpt(memory_length=8)
    memory = model(torch.randint(0, 50, (1, 8))).memory
    with pytest.raises(ValueError, match=r"one tensor per layer \(got 1 for 2 layers\)"):
        model(torch.randint(0, 50, (1, 8)), memory=memory[:1])
