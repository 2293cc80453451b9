"""Training as the pipeline runs it (``training.fit_with_cli``): a killed fit resumes from its last
checkpoint, a fit whose val/ppl turns NaN is recorded as diverged, a fit whose log is not a
terminal writes progress lines, training that hurts keeps the starting weights, and loading a
Hugging Face model draws no bars into a log."""
from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import warnings
import weakref

import pytest
import torch
from pytorch_lightning.callbacks import Callback

from gnnlm.pipeline import training
from gnnlm.workdir.layout import Workdir
from tests.conftest import REPO
from tests.fakes import write_corpus

STEPS = 24
# A one-layer LM on a few hundred words: several epochs of 14 steps, validated every 8 steps
# with the best val/ppl kept, as the base LM configs do.
TINY = """\
# gnnlm fit -c tiny.yaml
seed_everything: 1
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  val_check_interval: 8
  check_val_every_n_epoch: null
  limit_val_batches: 2
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {{monitor: val/ppl, mode: min, save_last: true}}
model:
  class_path: gnnlm.lit.lm.LanguageModel
  init_args:
    context_length: 8
    n_layer: 1
    n_head: 1
    d_model: 8
    d_ff: 16
    optim:
      lr: {lr}
      warmup_steps: 2
data:
  class_path: datamodules.lm.LMDataModule
  init_args:
    corpus: tiny
    corpus_path: {corpus}
    block_size: 8
    eval_context: 8
    eval_stride: 4
    batch_size: 2
    eval_batch_size: 2
"""


class Counter(Callback):
    """Counts the training steps this run took; raises at step ``kill_at`` (a killed job)."""

    def __init__(self, kill_at=None):
        self.kill_at, self.steps = kill_at, 0

    def on_train_batch_end(self, trainer, *args):
        self.steps += 1
        if trainer.global_step == self.kill_at:
            raise RuntimeError("killed")


def tiny_configs(root, lr=0.01, overlay=None) -> list[str]:
    """The tiny config over its corpus in ``root`` (and the YAML text ``overlay``)."""
    yaml_file = root / f"tiny-{lr}.yaml"
    corpus = write_corpus(root / "corpus", train=" ".join(
        f"w{i % 37} the cat sat" for i in range(200)) + "\n")
    yaml_file.write_text(TINY.format(steps=STEPS, lr=lr, corpus=corpus))
    configs = [str(yaml_file)]
    if overlay is not None:
        (root / "overlay.yaml").write_text(overlay)
        configs.append(str(root / "overlay.yaml"))
    return configs


def fit(monkeypatch, root, name="lm", lr=0.01, kill_at=None, overlay=None):
    """``fit_with_cli`` of the tiny config (and the YAML text ``overlay``) into ``root/work``:
    (manifest or None, steps this run took, what it said on stderr)."""
    configs = tiny_configs(root, lr, overlay)
    counter = Counter(kill_at)

    def instantiate(*args, **kwargs):
        cli = instantiate_fit(*args, **kwargs)
        cli.trainer.callbacks.insert(0, counter)
        return cli

    instantiate_fit = training.instantiate_fit
    monkeypatch.setattr(training, "instantiate_fit", instantiate)
    err = io.StringIO()
    manifest = None
    with contextlib.redirect_stderr(err), contextlib.suppress(RuntimeError):
        manifest = training.fit_with_cli(Workdir(root / "work"), name, configs, {}, predict=False)
    monkeypatch.setattr(training, "instantiate_fit", instantiate_fit)
    return manifest, counter.steps, err.getvalue()


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_CHECKPOINT_SECONDS", "0")  # a resume checkpoint after every step
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")    # a progress line after every step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        mp.delenv("GNNLM_QUIET", raising=False)
        mp.setenv("GNNLM_CHECKPOINT_SECONDS", "0")
        mp.setenv("GNNLM_PROGRESS_SECONDS", "0")
        root = tmp_path_factory.mktemp("uninterrupted")
        return (root, *fit(mp, root))


def state(root, name="lm"):
    return torch.load(root / "work" / "models" / name / "model.ckpt", map_location="cpu",
                      weights_only=False)


def test_a_killed_fit_resumes_from_its_last_checkpoint(monkeypatch, tmp_path, uninterrupted,
                                                       capfd, caplog):
    ref_root, ref, ref_steps, _ = uninterrupted
    assert ref_steps == STEPS
    manifest, steps, said = fit(monkeypatch, tmp_path, kill_at=10)
    assert manifest is None and steps == 10
    partial = tmp_path / "work" / "models" / "lm.partial"
    assert json.loads((partial / "progress.json").read_text())["progress"]["training"]
    resume = next((tmp_path / "work" / "logs" / "lm" / "resume").glob("*/last.ckpt"))
    assert torch.load(resume, weights_only=False)["global_step"] == 9  # saved before the kill

    capfd.readouterr()
    caplog.clear()
    caplog.set_level(logging.INFO)     # Lightning's lines, wherever its logger writes them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest, steps, said = fit(monkeypatch, tmp_path)
    # gnnlm's line says what resuming does, in place of Lightning's restoring lines and its
    # warning about a checkpoint written mid-epoch
    assert said.count(f"[gnnlm] resuming lm from step 9 ({resume}): weights, optimiser and "
                      f"schedule as saved; epoch 1 stopped after 9 batches and goes on with "
                      f"batches drawn from the train loader's start again") == 1
    lightning_said = "\n".join([capfd.readouterr().err, caplog.text,
                                *(str(w.message) for w in caught)])
    assert "Seed set to 1" in lightning_said    # (where Lightning's log lines are caught)
    for alarm in ("resuming from a checkpoint that ended before the epoch ended",
                  "Restoring states from the checkpoint", "Restored all states",
                  "is not empty", "GPU available: ", "TPU available: "):
        assert alarm not in lightning_said + said, alarm
    assert "before training" not in said         # the starting weights were scored already
    assert steps == STEPS - 9                    # only the steps left
    final, expected = state(tmp_path), state(ref_root)
    assert final["global_step"] == expected["global_step"] == STEPS
    # the optimiser and the schedule went on from the checkpoint, not from their start
    adam = [s["step"] for s in final["optimizer_states"][0]["state"].values()]
    assert adam and all(float(s) == STEPS for s in adam)
    assert final["lr_schedulers"] == expected["lr_schedulers"]
    assert manifest["valid_before_training"] == ref["valid_before_training"]
    assert not resume.exists()                   # a complete build keeps no resume checkpoint
    # and the manifest says so, where the uninterrupted one says it was not
    training = dict(manifest["training"])
    curve, kept = training.pop("valid_curve"), training.pop("kept_step")
    assert training == {"steps": STEPS, "max_steps": STEPS, "stopped_by": "max_steps",
                        "resumed_from_steps": [9]}
    assert ref["training"]["resumed_from_steps"] == []
    # the valid curve went on from the checkpoint too: before training, then every 8 steps,
    # the first validation (step 8, before the kill) the uninterrupted run's own
    assert curve["steps"] == ref["training"]["valid_curve"]["steps"] == [0, 8, 16, 24]
    assert curve["scores"][:2] == ref["training"]["valid_curve"]["scores"][:2]
    assert kept == curve["steps"][int(torch.tensor(curve["scores"]).argmin())]
    # After the kill the train loader reshuffles the interrupted epoch with the global RNG from
    # its start (Lightning restores no DataLoader position), so later weights differ a little:
    # measured 0.007% at step 16 and 0.12% at step 24 (37.556 against 37.602).
    assert curve["scores"][2:] == pytest.approx(ref["training"]["valid_curve"]["scores"][2:],
                                                rel=0.005)
    # The weights kept are the best validation's, step 8 (before the kill) in both runs: the
    # very checkpoint, so the very val/ppl.
    assert kept == ref["training"]["kept_step"] == 8
    assert manifest["metrics"]["val/ppl"] == ref["metrics"]["val/ppl"]


def test_the_manifest_records_the_valid_curve_and_the_kept_step(uninterrupted):
    """The kept weights are the best validation's (ModelCheckpoint monitors val/ppl): the
    manifest says which step that was, beside val/ppl before training and at each
    validation."""
    root, ref, _, _ = uninterrupted
    curve = ref["training"]["valid_curve"]
    assert curve["metric"] == "val/ppl" and curve["steps"] == [0, 8, 16, 24]
    assert curve["scores"][0] == ref["valid_before_training"]["val/ppl"]
    best = int(torch.tensor(curve["scores"][1:]).argmin()) + 1
    assert ref["training"]["kept_step"] == curve["steps"][best]
    assert ref["metrics"]["val/ppl"] == pytest.approx(curve["scores"][best])


def test_a_fit_cut_short_by_max_time_records_the_step_it_reached(monkeypatch, tmp_path):
    manifest, steps, _ = fit(monkeypatch, tmp_path, overlay="trainer:\n  max_steps: 100000\n"
                                                            "  max_time: '00:00:00:01'\n")
    assert {k: manifest["training"][k] for k in ("steps", "max_steps", "stopped_by",
                                                 "resumed_from_steps")} == {
        "steps": steps, "max_steps": 100000, "stopped_by": "max_time", "resumed_from_steps": []}
    assert 0 < steps < 100000 and state(tmp_path)["global_step"] == steps


EARLY_STOPPING = """\
trainer:
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {{monitor: val/ppl, mode: min, save_last: true}}
    - class_path: pytorch_lightning.callbacks.EarlyStopping
      init_args: {{monitor: val/ppl, mode: min, {args}}}
"""


@pytest.mark.parametrize("lr, args, stopped_by, steps", [
    (1e30, "patience: 100", "diverged", 8),           # NaN at the first validation
    (0.01, "patience: 0, min_delta: 1000.0", "early stopping", 16)])  # no gain of 1000
def test_a_fit_stopped_by_early_stopping_says_whether_it_diverged(monkeypatch, tmp_path, lr,
                                                                  args, stopped_by, steps):
    """EarlyStopping's check that the monitored metric is finite ends a fit whose val/ppl became
    NaN: that is a fit that diverged, recorded as such (and its starting weights kept), not as
    one that stopped improving."""
    manifest, taken, _ = fit(monkeypatch, tmp_path, lr=lr,
                             overlay=EARLY_STOPPING.format(args=args))
    training = manifest["training"]
    assert (training["stopped_by"], training["steps"], taken) == (stopped_by, steps, steps)
    curve = training["valid_curve"]["scores"]
    assert (curve[-1] != curve[-1]) is (stopped_by == "diverged")   # NaN only when diverged
    if stopped_by == "diverged":
        assert manifest["kept_initial_weights"] is True and training["kept_step"] == 0


def test_another_config_never_resumes_a_foreign_checkpoint(monkeypatch, tmp_path):
    fit(monkeypatch, tmp_path, kill_at=5)
    assert list((tmp_path / "work" / "logs" / "lm" / "resume").glob("*/last.ckpt"))
    manifest, steps, said = fit(monkeypatch, tmp_path, lr=0.02)    # another fingerprint
    assert "resuming" not in said and steps == STEPS
    assert manifest["config"]["values"]["model"]["init_args"]["optim"]["lr"] == 0.02


def test_a_redirected_fit_writes_progress_lines(uninterrupted):
    _, _, _, said = uninterrupted
    lines = [line.strip() for line in said.splitlines() if "fit LanguageModel: step" in line]
    assert "\r" not in said
    assert lines[0].startswith(f"fit LanguageModel: step 1/{STEPS} (4%), epoch 1, ")
    assert lines[-1].startswith(f"fit LanguageModel: step {STEPS}/{STEPS} (100%)")
    assert all("steps/s" in line and "ETA " in line and "train/loss " in line
               for line in lines)
    assert "ETA ?" not in lines[-2] and lines[-1].split("ETA ")[1].startswith("0s")
    assert "fit LanguageModel: validation at step 8: " in said and "val/ppl " in said


def test_training_that_hurts_keeps_the_initial_weights(monkeypatch, tmp_path, uninterrupted):
    _, ref, _, _ = uninterrupted
    assert ref["kept_initial_weights"] is False  # a useful run keeps its trained weights
    initial = {}

    def snapshot(trainer, model, datamodule, weights_file):
        initial.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return validate_before_training(trainer, model, datamodule, weights_file)

    validate_before_training = training.validate_before_training
    monkeypatch.setattr(training, "validate_before_training", snapshot)
    manifest, steps, said = fit(monkeypatch, tmp_path, lr=300.0)   # a learning rate that hurts
    assert steps == STEPS and "keeping the initial weights" in said
    assert manifest["kept_initial_weights"] is True and manifest["training"]["kept_step"] == 0
    before = manifest["valid_before_training"]["val/ppl"]
    assert manifest["metrics"]["val/ppl"] == before
    kept = state(tmp_path)["state_dict"]
    assert initial and kept.keys() == initial.keys()
    for key, value in initial.items():
        assert torch.equal(kept[key], value), key
    assert not (tmp_path / "work" / "models" / "lm" / training.INITIAL_WEIGHTS).exists()


def test_validating_before_training_changes_nothing_the_fit_does(monkeypatch, tmp_path,
                                                                uninterrupted):
    """The extra validation draws loader seeds from the global random streams; they are put
    back, so a seeded config trains to the very weights it gives without that validation."""
    ref_root, _, _, _ = uninterrupted
    monkeypatch.setattr(training, "validate_before_training", lambda *args: None)
    manifest, steps, _ = fit(monkeypatch, tmp_path)
    assert steps == STEPS and "valid_before_training" not in manifest
    final, expected = state(tmp_path)["state_dict"], state(ref_root)["state_dict"]
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_loading_a_hugging_face_model_draws_no_bars(tmp_path, capfd):
    """Transformers draws a bar per loading step with carriage returns, on stderr whatever it
    is; the adapter turns them off."""
    from transformers.utils import logging as hf_logging

    from gnnlm.models.hf import HFCausalLM
    from tests.families import FAMILIES, save_family, train_bpe

    folder = save_family(FAMILIES["llama"], train_bpe("the cat sat on the mat\n" * 20, 300),
                         tmp_path / "llama")
    hf_logging.enable_progress_bar()  # as in a new process
    capfd.readouterr()
    HFCausalLM.from_pretrained(str(folder))
    out, err = capfd.readouterr()
    assert "\r" not in out + err


def test_a_finished_fit_frees_its_trainer_and_model(monkeypatch, tmp_path):
    """Nothing of a trained part outlives ``fit_with_cli``: in a pipeline its tensors on a GPU
    (GNN-LM's window-state table) would hold memory through every later stage. Python's
    collector is off during the fit, so only what the fit itself frees is freed (jsonargparse
    kept the last CLI's parser, and through it the trainer and the model, until the next)."""
    built = []
    instantiate_fit = training.instantiate_fit

    def instantiate(*args, **kwargs):
        cli = instantiate_fit(*args, **kwargs)
        built.append((weakref.ref(cli.trainer), weakref.ref(cli.model)))
        return cli

    monkeypatch.setattr(training, "instantiate_fit", instantiate)
    configs = tiny_configs(tmp_path)
    gc.disable()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            manifest = training.fit_with_cli(Workdir(tmp_path / "work"), "lm", configs, {},
                                             predict=False)
    finally:
        gc.enable()
    assert manifest["training"]["steps"] == STEPS
    assert len(built) == 1
    assert [ref() for ref in built[0]] == [None, None]
