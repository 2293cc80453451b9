"""Checkpoints are read as plain data: a pickled payload never runs, plain checkpoints load."""
from __future__ import annotations

import builtins
import os
import shlex

import pytest
import torch
from fakes import save_lm_checkpoint

from gnnlm.gnn.graph import GraphConfig
from gnnlm.text.tokens import TokenizerConfig
from gnnlm.workdir.checkpoints import CheckpointError, datamodule_args, load_checkpoint, model_state


class ShellPayload:
    """Unpickling this runs a shell command (the classic malicious checkpoint)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


class ExecPayload:
    """Unpickling this runs Python code that writes a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


@pytest.mark.parametrize("payload", [ShellPayload, ExecPayload])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(2)}, "hyper_parameters": {"lr": 1.0},
                "callbacks": payload(marker)}, path)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=f"Refusing to load {path}"):
        load_checkpoint(path)
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        datamodule_args(path)
    assert not marker.exists()
    # the payload is live: an unrestricted load would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_malicious_payload_in_a_base_lm_checkpoint_is_refused(tmp_path):
    from gnnlm.models import load_base_lm

    path, _ = save_lm_checkpoint(tmp_path / "lm.ckpt", n_layer=1)
    checkpoint = torch.load(path, weights_only=True)
    marker = tmp_path / "pwned"
    checkpoint["hyper_parameters"]["dropout"] = ShellPayload(marker)
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match="Refusing to load"):
        load_base_lm(path)
    assert not marker.exists()


def test_missing_or_foreign_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"No checkpoint at {tmp_path / 'none.ckpt'}"):
        load_checkpoint(tmp_path / "none.ckpt")
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=f"Refusing to load {tmp_path / 'notes.ckpt'}"):
        load_checkpoint(tmp_path / "notes.ckpt")


def test_plain_lightning_style_checkpoint_loads(tmp_path):
    state = {"model.wte.weight": torch.randn(5, 3), "model.ln_f.bias": torch.zeros(3),
             "head.gate.weight": torch.ones(3, 3)}
    tokenizer, graph = TokenizerConfig(kind="char"), GraphConfig(k=4, left=2)
    saved = {"state_dict": state, "epoch": 3, "global_step": 120,
             "pytorch-lightning_version": "2.6.0",
             "hyper_parameters": {"lr": 1e-3, "betas": (0.9, 0.95), "vocab_size": 5},
             "datamodule_hyper_parameters": {"tokenizer": tokenizer, "graph": graph,
                                             "workdir": "runs/x", "_class_path": "x.Y"},
             "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}},
                                   "param_groups": [{"lr": 1e-3, "params": [0]}]}]}
    path = tmp_path / "model.ckpt"
    torch.save(saved, path)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and loaded["hyper_parameters"]["betas"] == (0.9, 0.95)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded["state_dict"][name], tensor)
    args = datamodule_args(path)
    assert args == {"tokenizer": tokenizer, "graph": graph, "workdir": "runs/x"}
    assert isinstance(args["tokenizer"], TokenizerConfig)
    model = model_state(loaded, "model.")
    assert set(model) == {"wte.weight", "ln_f.bias"}
    torch.testing.assert_close(model["wte.weight"], state["model.wte.weight"])


def test_load_base_lm_rebuilds_the_saved_language_model(tmp_path):
    from gnnlm.models import load_base_lm

    path, lm = save_lm_checkpoint(tmp_path / "lm.ckpt")
    reference = lm.model.eval()
    loaded = load_base_lm(path)
    assert loaded.name == "gpt" and loaded.identity()["name"] == "gpt"
    assert loaded.fingerprint() == reference.fingerprint()
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert (loaded.vocab_size, loaded.hidden_size, loaded.context_length) == (50, 16, 16)
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        expected = reference(ids)
        got = loaded(ids)
    torch.testing.assert_close(got.final, expected.final, rtol=0, atol=0)
    torch.testing.assert_close(got.att, expected.att, rtol=0, atol=0)


def test_load_base_lm_refuses_a_checkpoint_of_another_model(tmp_path):
    from gnnlm.models import load_base_lm

    path = tmp_path / "head.ckpt"
    torch.save({"state_dict": {"head.gate.weight": torch.ones(2, 2)},
                "hyper_parameters": {"feature_dim": 2}}, path)
    with pytest.raises(CheckpointError, match="not a checkpoint of the built-in LM"):
        load_base_lm(str(path))
