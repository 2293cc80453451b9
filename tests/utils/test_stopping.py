"""Stopping when told: SIGTERM and SIGINT end any stage within seconds, with one line, status
143 (SIGINT: 130) and the work directory's lock released; a rerun resumes (the training from the
checkpoint saved at the stop, a chunked stage from its recorded chunks, ending with the bytes of
an uninterrupted build)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import pytest
import torch

from gnnlm.cli import stop_line
from gnnlm.pipeline.stage_times import StageTimes, timed
from gnnlm.utils import stopping
from tests.conftest import REPO

# --- the handler, in this process ------------------------------------------------------------


def test_a_signal_raises_stopped_naming_the_innermost_stage_and_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    with pytest.raises(stopping.Stopped) as stop:
        with stopping.handling_stop_signals(), StageTimes().running():
            with timed("features"), timed("neighbors[final]"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)  # the signal ends the sleep at once
    assert stop.value.stage == "neighbors[final]" and stop.value.exit_code == 143
    assert stop_line("pipeline", stop.value) == (
        "gnnlm pipeline: stopped by SIGTERM at neighbors[final]; rerun to resume")
    assert stop_line("score", stop.value) == "gnnlm score: stopped by SIGTERM at neighbors[final]"
    assert {s: signal.getsignal(s) for s in stopping.SIGNALS} == before
    assert stopping.received() is None  # nothing outlives the block


def test_a_signal_between_two_stages_names_the_last_that_ended():
    with pytest.raises(stopping.Stopped) as stop:
        with stopping.handling_stop_signals(), StageTimes().running():
            for stage in ("base_lm", "features"):
                with timed(stage):
                    pass
            os.kill(os.getpid(), signal.SIGTERM)   # scoring what the features stage built
            time.sleep(30)
    assert stop.value.stage is None and stop.value.after == "features"
    assert stop_line("pipeline", stop.value) == (
        "gnnlm pipeline: stopped by SIGTERM after features; rerun to resume")


def test_sigint_exits_130_and_a_deferred_block_ends_before_the_stop():
    steps = []
    with pytest.raises(stopping.Stopped) as stop:
        with stopping.handling_stop_signals():
            for step in range(3):
                stopping.begin_deferring()
                if step == 1:
                    os.kill(os.getpid(), signal.SIGINT)  # held until the step ends
                steps.append(step)
                stopping.end_deferring()
                assert stopping.pending() == (signal.SIGINT if step == 1 else None)
                stopping.check_pending()
    assert steps == [0, 1] and stop.value.exit_code == 130 and stop.value.stage is None


def test_a_second_signal_during_a_deferred_block_stops_at_once():
    with pytest.raises(stopping.Stopped):
        with stopping.handling_stop_signals():
            stopping.begin_deferring()
            os.kill(os.getpid(), signal.SIGTERM)
            assert stopping.pending() == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("the second signal did not stop the block")


class SlowItems(torch.utils.data.Dataset):
    """Items a worker takes a while to make (a training step's batch being built)."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.01)
        return i


def test_a_worker_signalled_by_another_process_than_its_parent_exits_quietly():
    """A signal sent to the whole process group (``timeout``, a terminal, SLURM) reaches the
    workers from another process than their parent: torch's own handler dies by it, and the
    run's loader then raises "worker ... killed by signal" in the step the run is finishing.
    With ``worker_init`` the worker ends as on SIGINT, status 0, and the run stops itself."""
    with stopping.handling_stop_signals():
        loader = torch.utils.data.DataLoader(SlowItems(), batch_size=4, num_workers=1,
                                             worker_init_fn=stopping.worker_init)
        batches = iter(loader)
        next(batches)
        (worker,) = batches._workers
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # not from its parent
        worker.join(30)
        assert worker.exitcode == 0
        del batches
        assert stopping.received() is None                 # the run itself was not signalled


def test_a_worker_is_seeded_as_lightning_seeds_it(monkeypatch):
    """Lightning adds its own ``worker_init_fn`` only to a loader without one: under
    ``seed_everything(workers=True)`` ours seeds the worker the same way."""
    from functools import partial

    import numpy as np
    from lightning_fabric.utilities.seed import pl_worker_init_function

    class Draws(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[int, int]:
            return int(np.random.randint(1 << 30)), int(torch.randint(1 << 30, (1,)))

    monkeypatch.setenv("PL_SEED_WORKERS", "1")

    def draws(init) -> list:
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(Draws(), batch_size=None, num_workers=2,
                                             worker_init_fn=init)
        return list(loader)

    assert draws(stopping.worker_init) == draws(partial(pl_worker_init_function, rank=0))


def test_an_error_after_a_stop_signal_is_the_stop():
    """What fails once a run is told to stop (a loader whose workers the signal ended) stops
    the run as the signal does, at the stage it was in; an error without a signal is the
    run's own."""
    with pytest.raises(stopping.Stopped) as stop:
        with stopping.handling_stop_signals(), StageTimes().running():
            with timed("base_lm"):
                stopping.begin_deferring()              # a training step
                os.kill(os.getpid(), signal.SIGTERM)    # recorded until the step ends
                raise RuntimeError("DataLoader worker (pid 7) is killed by signal: Terminated.")
    assert stop.value.stage == "base_lm" and stop.value.exit_code == 143
    assert isinstance(stop.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="its own"):
        with stopping.handling_stop_signals(), StageTimes().running(), timed("base_lm"):
            raise RuntimeError("its own")


# --- a Lightning fit's training, in this process ----------------------------------------------


class SignalOnLoad(torch.utils.data.Dataset):
    """64 random rows of 4 features; loading row ``row`` sends this process ``signum``."""

    def __init__(self, row: Optional[int] = None, signum: int = signal.SIGTERM) -> None:
        self.rows, self.row, self.signum = torch.randn(64, 4), row, signum

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.row:
            os.kill(os.getpid(), self.signum)
        return self.rows[i]


def regression(train: SignalOnLoad):
    """A tiny regression for Lightning (batches of 4: 16 an epoch), counting its training
    steps and validation batches."""
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.steps, self.validated = 0, 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return self.layer(batch).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.validated += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(train, batch_size=4)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(SignalOnLoad(), batch_size=4)

    return Regression()


def fit(model, resume: Optional[Path], callbacks=(), ckpt_path=None, val_check_interval=None,
        max_steps: int = 12):
    """``model`` fitted to ``max_steps`` with ``stop_between_steps(resume)`` first among its
    callbacks, under the run's signal handling; returns the trainer."""
    import pytorch_lightning as pl

    from gnnlm.pipeline.training import stop_between_steps

    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=val_check_interval,
                         limit_val_batches=None if val_check_interval else 0,
                         num_sanity_val_steps=0, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[stop_between_steps(resume), *callbacks])
    with stopping.handling_stop_signals(), stopping.errors_as_stop():
        trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def signal_at_step_end(step: int, signum: int):
    """A callback sending ``signum`` as training step ``step`` (from 1) ends, after the stop's
    own hook has run: between the step and Lightning's bookkeeping of it."""
    from pytorch_lightning.callbacks import Callback

    class Signal(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == step:
                os.kill(os.getpid(), signum)

    return Signal()


@pytest.mark.parametrize("where, signum, saved", [
    ("bookkeeping", signal.SIGTERM, 4),  # Lightning ends the fit there (SIGTERMException)
    ("bookkeeping", signal.SIGINT, 5),   # (Lightning leaves SIGINT alone): after step 5
    ("loading", signal.SIGTERM, 5),      # step 5's batch, loaded in this process: after it
    ("loading", signal.SIGINT, 5),
    ("epoch end", signal.SIGINT, 17),    # after step 16, the epoch's last: after step 17
    # Lightning's SIGTERM exit after an epoch's last step is not resumable (the epoch would
    # be counted twice): the fit stops at once, without the checkpoint
    ("epoch end", signal.SIGTERM, None),
    ("last step", signal.SIGTERM, 20),   # after step 20 of 20: as training ends
    ("last step", signal.SIGINT, 20),
], ids=["SIGTERM-bookkeeping", "SIGINT-bookkeeping", "SIGTERM-loading", "SIGINT-loading",
        "SIGINT-epoch-end", "SIGTERM-epoch-end", "SIGTERM-last-step", "SIGINT-last-step"])
def test_a_signal_between_two_training_steps_stops_at_a_step_end_with_its_checkpoint(
        tmp_path, where, signum, saved):
    """Told between two steps, the fit stops where a step has ended, with the checkpoint of
    that point; resumed from it, Lightning runs the steps left, each once, and ends in the
    epoch an uninterrupted fit ends in."""
    resume, told = tmp_path / "last.ckpt", {"epoch end": 16, "last step": 20}.get(where, 4)
    model = regression(SignalOnLoad(row=4 * told if where == "loading" else None, signum=signum))
    callbacks = [] if where == "loading" else [signal_at_step_end(told, signum)]
    with pytest.raises(stopping.Stopped) as stop:
        fit(model, resume, callbacks, max_steps=20)
    assert stop.value.signum == signum and model.steps == (saved or told)
    if saved is None:
        assert not resume.exists()
        return
    assert torch.load(resume, map_location="cpu", weights_only=False)["global_step"] == saved

    resumed, whole = regression(SignalOnLoad()), regression(SignalOnLoad())
    trainer = fit(resumed, None, ckpt_path=resume, max_steps=20)
    assert resumed.steps == 20 - saved and trainer.global_step == 20
    assert trainer.current_epoch == fit(whole, None, max_steps=20).current_epoch


def test_a_signal_in_validation_stops_the_fit_at_once(tmp_path):
    """Validation is not held: the fit stops in its first batch, with no further step and no
    checkpoint (the rerun resumes from the last periodic one)."""
    import pytorch_lightning as pl

    class SignalInValidation(pl.Callback):
        def on_validation_batch_start(self, *args, **kwargs) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    resume = tmp_path / "last.ckpt"
    model = regression(SignalOnLoad())
    with pytest.raises(stopping.Stopped):
        fit(model, resume, [SignalInValidation()], val_check_interval=4)
    assert model.steps == 4 and model.validated == 0 and not resume.exists()


# --- real runs of `gnnlm` on a WikiText-2 slice ----------------------------------------------

# The test pipeline (configs/tests/pipeline.yaml) cut down: a 60-step base LM, features of
# 100k train tokens (about a dozen chunks) and 10k valid/test tokens. The runs below stop before
# the index, so the later stages' configs are only parsed.
SHORT_LM = """\
trainer:
  max_steps: 60
  val_check_interval: 60
  limit_val_batches: 4
"""
STOP_PIPELINE = """\
name: stop
workdir: runs/stop
base_lm:
  config: [configs/trainer/cpu.yaml, configs/wikitext2/base_lm.yaml,
           configs/wikitext2/base_lm_cpu.yaml, configs/tests/tiny_lm.yaml, short_lm.yaml]
features:
  max_tokens: {train: 100000, valid: 10000, test: 10000}
"""
PIPELINE = ["pipeline", "-c", "configs/wikitext2/pipeline.yaml", "-c",
            "configs/wikitext2/pipeline_cpu.yaml", "-c", "configs/tests/pipeline.yaml",
            "-c", "stop.yaml"]
ENV = {"PYTHONUNBUFFERED": "1", "GNNLM_PROGRESS_SECONDS": "0", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1",
       # no periodic resume checkpoint in these runs: the one resumed from is the stop's
       "GNNLM_CHECKPOINT_SECONDS": "3600"}
# on a busy 2-core machine a stage can take minutes to reach the point waited for; a stop must
# still end the run within STOP_SECONDS (one training step, or one faiss or torch call)
WAIT_SECONDS, STOP_SECONDS = 900, 60


class Run:
    """``gnnlm ARGS`` started in ``cwd``, its stderr and stdout in files the test reads as they
    grow (``LOG.err``, ``LOG.out``)."""

    def __init__(self, args: list[str], cwd: Path, log: str):
        self.log, self.out = cwd / f"{log}.err", cwd / f"{log}.out"
        self.stderr, self.stdout = open(self.log, "w"), open(self.out, "w")
        # a process group of its own, which ``stop(group=True)`` signals whole
        self.proc = subprocess.Popen([sys.executable, "-m", "gnnlm.cli", *args], cwd=cwd,
                                     env={**os.environ, **ENV}, stdout=self.stdout,
                                     stderr=self.stderr, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def output(self) -> str:
        """What it wrote on stdout (Lightning's progress bar)."""
        return self.out.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"gnnlm ended ({self.proc.returncode}) before {what}:\n"
                                     f"{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {what} after {WAIT_SECONDS} s:\n{self.text()[-4000:]}")
            time.sleep(0.05)

    def stop(self, signum: int = signal.SIGTERM, group: bool = False
             ) -> tuple[int, float, str]:
        """Send ``signum`` to the run (``group``: to every process of its group, its DataLoader
        workers too, as ``timeout`` and a terminal do); (exit status, seconds until the run
        ended, its last line)."""
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        try:
            code = self.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {STOP_SECONDS} s after the signal:\n"
                                 f"{self.text()[-4000:]}") from None
        seconds = time.monotonic() - t0
        self.stderr.close()
        self.stdout.close()
        return code, seconds, self.text().strip().splitlines()[-1]


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def chunks_recorded(partial: Path) -> int:
    """Chunks a sharded build's ranks recorded in ``partial`` so far."""
    done = 0
    for path in partial.glob("progress.rank*.json"):
        try:
            done += len(json.loads(path.read_text()).get("chunks") or {})
        except (OSError, ValueError):
            pass
    return done


def lock_is_free(workdir: Path) -> bool:
    """No holder recorded (a clean release empties the file) and the lock can be taken."""
    import fcntl

    lock = workdir / ".lock"
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises when it is held
        return lock.read_text() == ""


def features_identity(workdir: Path) -> dict:
    out = {}
    for split in ("train", "valid", "test"):
        manifest = json.loads((workdir / "features" / split / "manifest.json").read_text())
        out[split] = {"fingerprint": manifest["fingerprint"],
                      "arrays": {name: spec["sha256"] for name, spec in
                                 manifest["arrays"].items()}}
    return out


@pytest.fixture(scope="module")
def stopped_runs(wikitext_root, tmp_path_factory) -> dict:
    """The cut-down pipeline run four times in one work directory, each stopped by SIGTERM: in
    the base LM's training, in the features (on two processes), after the features (they are
    then complete), and, in a second work directory holding the same tokens and base LM, once
    more after the features, built there without a stop."""
    cwd = tmp_path_factory.mktemp("stop")
    (cwd / "configs").symlink_to(REPO / "configs")
    (cwd / "short_lm.yaml").write_text(SHORT_LM)
    (cwd / "stop.yaml").write_text(STOP_PIPELINE)
    os.environ["GNNLM_DATA"] = str(wikitext_root)
    workdir = cwd / "runs" / "stop"
    runs: dict = {"cwd": cwd, "workdir": workdir}

    training = Run(PIPELINE, cwd, "training")
    training.wait_for(lambda: "fit LanguageModel: step 5/60" in training.text(),
                      "fifth training step")
    runs["training"] = (*training.stop(), training.text())
    # the resume checkpoint as the stop left it (the rerun deletes it once the LM is complete)
    runs["resume_checkpoints"] = {
        str(path): int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
        for path in (workdir / "logs" / "base_lm" / "resume").glob("*/last.ckpt")}

    features = Run([*PIPELINE, "--features.devices=2"], cwd, "features")
    partial = workdir / "features" / "train.partial"
    features.wait_for(lambda: chunks_recorded(partial) >= 1, "recorded chunk of train features")
    ranks = children(features.proc.pid)
    runs["features"] = (*features.stop(), features.text())
    runs["features_chunks"] = chunks_recorded(partial)
    time.sleep(1)
    runs["ranks"], runs["ranks_left"] = ranks, [pid for pid in ranks if alive(pid)]

    after = Run(PIPELINE, cwd, "after")
    after.wait_for(lambda: "stage features:" in after.text(), "end of the features stage")
    runs["after"] = (*after.stop(), after.text())

    reference = cwd / "runs" / "reference"
    for name in ("tokens", "models/base_lm"):
        shutil.copytree(workdir / name, reference / name, symlinks=True)
    whole = Run([*PIPELINE, "--workdir=runs/reference"], cwd, "reference")
    whole.wait_for(lambda: "stage features:" in whole.text(), "end of the features stage")
    runs["reference"] = (*whole.stop(), whole.text())
    return runs


@pytest.mark.integration
def test_sigterm_during_training_saves_the_checkpoint_and_exits_143(stopped_runs):
    code, seconds, last, text = stopped_runs["training"]
    assert code == 143 and seconds < STOP_SECONDS, text[-3000:]
    assert last == "gnnlm pipeline: stopped by SIGTERM at base_lm; rerun to resume"
    assert "Received SIGTERM" not in text              # Lightning's own note of it is silenced
    assert lock_is_free(stopped_runs["workdir"])
    # the checkpoint saved at the stop (no periodic one in these runs), between two steps
    ((resume, step),) = stopped_runs["resume_checkpoints"].items()
    assert 5 <= step < 60 and f"saved the checkpoint to resume from at step {step}" in text
    # the rerun resumed from it, and was not refused the work directory
    _, _, _, rerun = stopped_runs["features"]
    assert f"resuming base_lm from step {step} ({resume})" in rerun
    assert "in use by another run" not in rerun and "took over the lock" not in rerun


@pytest.mark.integration
def test_sigterm_during_a_sharded_chunked_stage_stops_its_ranks(stopped_runs):
    code, seconds, last, text = stopped_runs["features"]
    assert code == 143 and seconds < STOP_SECONDS, text[-3000:]
    assert last == "gnnlm pipeline: stopped by SIGTERM at features; rerun to resume"
    assert stopped_runs["features_chunks"] >= 1      # finished chunks are kept
    assert len(stopped_runs["ranks"]) >= 2           # the ranks ran as processes of the run
    assert stopped_runs["ranks_left"] == []          # and none goes on alone
    assert lock_is_free(stopped_runs["workdir"])


@pytest.mark.integration
def test_a_resumed_chunked_stage_ends_with_the_bytes_of_an_uninterrupted_one(stopped_runs):
    for run in ("after", "reference"):
        code, _, last, text = stopped_runs[run]
        # sent once the features stage ended: in the next stage, or still between the two
        assert code == 143 and last.startswith(("gnnlm pipeline: stopped by SIGTERM at ",
                                                "gnnlm pipeline: stopped by SIGTERM after "
                                                "features;")), text
        assert "took over the lock" not in text
    _, _, _, resumed = stopped_runs["after"]
    assert "features train:" in resumed              # the features were resumed, not found done
    _, _, _, reference = stopped_runs["reference"]
    assert "resuming" not in reference and "base_lm: valid" not in reference  # LM reused
    assert features_identity(stopped_runs["workdir"]) == features_identity(
        stopped_runs["cwd"] / "runs" / "reference")


@pytest.mark.integration
def test_a_stopped_pipeline_records_the_stages_it_finished_and_where_it_stopped(stopped_runs):
    """What a time limit leaves (scripts/gpu_check.sh): stage_times.json of the run so far."""
    times = json.loads((stopped_runs["workdir"] / "reports" / "stop" / "stage_times.json")
                       .read_text())                              # the "after" run's
    _, _, last, _ = stopped_runs["after"]
    assert last == f"gnnlm pipeline: {times['stopped']}; rerun to resume"
    assert [s["stage"] for s in times["stages"]][:2] == ["base_lm", "features"]
    assert times["environment"]["device"] == "cpu"


@pytest.mark.integration
def test_sigterm_during_lightning_scoring_exits_within_seconds(stopped_runs):
    """Lightning's evaluation loop (``gnnlm test`` of the base LM on the whole test split):
    Lightning's own SIGTERM handler only sets a flag there; the run still stops."""
    cwd, workdir = stopped_runs["cwd"], stopped_runs["workdir"]
    args = ["test", "-c", "configs/trainer/cpu.yaml", "-c", "configs/wikitext2/base_lm.yaml",
            "-c", "configs/wikitext2/base_lm_cpu.yaml", "-c", "configs/tests/tiny_lm.yaml",
            f"--ckpt_path={workdir / 'models' / 'base_lm' / 'model.ckpt'}",
            f"--data.init_args.workdir={workdir}", "--data.init_args.eval_tokens=null",
            # tqdm's bar writes as it goes into a file too (Rich's only when it ends)
            "--trainer.enable_progress_bar=true", "--trainer.logger=false",
            "--trainer.callbacks+=pytorch_lightning.callbacks.TQDMProgressBar"]
    scoring = Run(args, cwd, "scoring")
    # the bar on stdout, once a batch is done: "Testing DataLoader 0:   1%|   | 1/120 [00:01<…"
    scoring.wait_for(lambda: re.search(r"Testing DataLoader 0:[^|]*\|[^|]*\| [1-9]\d*/",
                                       scoring.output()) is not None, "scored test batch")
    code, seconds, last = scoring.stop()
    text = scoring.text()
    assert code == 143 and seconds < STOP_SECONDS, text[-3000:]
    assert last == "gnnlm test: stopped by SIGTERM", text[-3000:]


@pytest.mark.integration
def test_sigint_exits_130(stopped_runs):
    """Ctrl-C in the base LM's training (where Lightning would turn a KeyboardInterrupt into
    exit status 1): status 130, and the work directory is released."""
    cwd = stopped_runs["cwd"]
    fresh = Run([*PIPELINE, "--workdir=runs/sigint"], cwd, "sigint")
    fresh.wait_for(lambda: "fit LanguageModel: step 1/60" in fresh.text(), "first step")
    code, seconds, last = fresh.stop(signal.SIGINT)
    text = fresh.text()
    assert code == 130 and seconds < STOP_SECONDS, text[-3000:]
    assert last == "gnnlm pipeline: stopped by SIGINT at base_lm; rerun to resume"
    assert lock_is_free(cwd / "runs" / "sigint")


WORKERS = """\
data:
  init_args:
    num_workers: 2
"""


@pytest.mark.integration
def test_sigterm_to_the_whole_group_ends_the_step_and_exits_143(stopped_runs):
    """The base LM trained with two DataLoader workers, and SIGTERM sent to the run's whole
    process group, workers included: the workers end quietly, the run stops as for a signal
    to it alone (no "DataLoader worker ... killed by signal" error), records where, and is
    released."""
    cwd = stopped_runs["cwd"]
    (cwd / "workers.yaml").write_text(WORKERS)
    (cwd / "group.yaml").write_text(STOP_PIPELINE.replace(
        "short_lm.yaml]", "short_lm.yaml, workers.yaml]").replace("runs/stop", "runs/group"))
    run = Run([*PIPELINE[:-1], "group.yaml"], cwd, "group")
    run.wait_for(lambda: "fit LanguageModel: step 5/60" in run.text(), "fifth training step")
    code, seconds, last = run.stop(group=True)
    text = run.text()
    assert code == 143 and seconds < STOP_SECONDS, text[-3000:]
    assert last == "gnnlm pipeline: stopped by SIGTERM at base_lm; rerun to resume", text[-3000:]
    assert "killed by signal" not in text and "error:" not in text
    times = json.loads((cwd / "runs" / "group" / "reports" / "stop" / "stage_times.json")
                       .read_text())
    assert times["stopped"] == "stopped by SIGTERM at base_lm"
    assert lock_is_free(cwd / "runs" / "group")
