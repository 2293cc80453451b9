"""Checkpoints are read as plain data: a pickled payload never runs, plain checkpoints load."""
from __future__ import annotations

import builtins
import dataclasses
import os
import shlex
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from gnnlm.gnn.graph import GraphConfig
from gnnlm.text.tokens import TokenizerConfig
from gnnlm.workdir.checkpoints import (
    CheckpointError,
    datamodule_args,
    load_checkpoint,
    model_state,
    plain_classes,
)
from tests.fakes import save_lm_checkpoint

REPO = Path(__file__).resolve().parents[2]


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
    with torch.serialization.safe_globals(plain_classes()):  # read whole: it is rewritten
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


def pickled_under(instance, old_module, monkeypatch):
    """A stand-in for ``instance`` that pickles as ``old_module.<its class>`` (where the class
    lived when older checkpoints were written), with the same fields."""
    cls = type(instance)
    module = types.ModuleType(old_module)
    twin = type(cls.__name__, (), {"__module__": old_module, "__qualname__": cls.__qualname__})
    setattr(module, cls.__name__, twin)
    monkeypatch.setitem(sys.modules, old_module, module)
    stand_in = twin.__new__(twin)
    stand_in.__dict__.update(dataclasses.asdict(instance))
    return stand_in


@pytest.mark.parametrize("old_tokens,old_graph", [("gnnlm.tokens", "gnnlm.graph"),
                                                  ("gnnlm.text.tokens", "gnnlm.gnn.graph")])
def test_checkpoints_pickling_the_classes_former_module_paths_load(tmp_path, monkeypatch,
                                                                   old_tokens, old_graph):
    tokenizer, graph = TokenizerConfig(kind="char"), GraphConfig(k=4, left=2)
    path = tmp_path / "old.ckpt"
    with monkeypatch.context() as old:
        torch.save({"state_dict": {}, "datamodule_hyper_parameters": {
            "tokenizer": pickled_under(tokenizer, old_tokens, old),
            "graph": pickled_under(graph, old_graph, old)}}, path)
    assert f"{old_tokens}\nTokenizerConfig".encode() in zipfile.ZipFile(path).read(
        "old/data.pkl")
    args = datamodule_args(path)
    assert args == {"tokenizer": tokenizer, "graph": graph}
    assert type(args["tokenizer"]) is TokenizerConfig and type(args["graph"]) is GraphConfig


def saved_with_settings(path):
    torch.save({"state_dict": {}, "datamodule_hyper_parameters": {
        "tokenizer": TokenizerConfig(kind="char"), "graph": GraphConfig(k=4)}}, path)
    return path


def load_in_a_fresh_process(imports: str, path) -> subprocess.CompletedProcess:
    code = (f"{imports}; from gnnlm.workdir.checkpoints import datamodule_args; import sys; "
            f"print(sorted(type(v).__name__ for v in datamodule_args(sys.argv[1]).values()))")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("imports", ["import gnnlm.pipeline.config", "import gnnlm.models",
                                     "import gnnlm.workdir.checkpoints"])
def test_a_fresh_process_has_the_classes_registered_before_it_loads(tmp_path, imports):
    """Importing the package (any module of it, the checkpoint reader alone included) registers
    every class checkpoints may hold, so no loading path finds the registry empty."""
    done = load_in_a_fresh_process(imports, saved_with_settings(tmp_path / "m.ckpt"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['GraphConfig', 'TokenizerConfig']"


def test_the_checkpoint_reader_imports_nothing_of_the_package():
    import ast

    from gnnlm.workdir import checkpoints

    tree = ast.parse(Path(checkpoints.__file__).read_text())
    names = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    assert not [name for name in names if name and name.startswith("gnnlm")]
