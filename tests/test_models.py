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


@pytest.mark.parametrize("monitor", ["val/ppl", None])
def test_pipeline_keeps_the_best_monitored_weights(tmp_path, monitor):
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import ModelCheckpoint

    from gnnlm.pipeline import restore_best_weights

    best, last = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.save({"state_dict": best.state_dict()}, tmp_path / "best.ckpt")
    callback = ModelCheckpoint(dirpath=tmp_path, monitor=monitor)
    callback.best_model_path = str(tmp_path / "best.ckpt")
    before = last.weight.detach().clone()
    restore_best_weights(SimpleNamespace(trainer=SimpleNamespace(checkpoint_callback=callback),
                                         model=last))
    expected = best.weight if monitor else before
    assert torch.equal(last.weight.detach(), expected.detach())
