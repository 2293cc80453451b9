"""Console progress of long stages: plain lines when redirected, silence when asked; the
progress and resume lines of a fit, true to what Lightning does; none of Lightning's banners."""
from __future__ import annotations

import logging

import pytest

from gnnlm.utils.progress import Progress, say, track


def test_track_yields_the_chunks_left_and_stops_when_asked():
    assert list(track(5, "demo")) == [0, 1, 2, 3, 4]
    assert list(track(5, "demo", initial=3)) == [3, 4]
    assert list(track(5, "demo", initial=1, stop_after=2)) == [1, 2]
    assert list(track(5, "demo", stop_after=0)) == []
    assert list(track(2, "demo", initial=2)) == []


def test_redirected_progress_is_plain_lines(monkeypatch, capsys):
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")
    for _ in track(3, "features valid"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines)
    assert lines[-1].strip().startswith("features valid: 3/3 chunks")
    assert [line.split(":")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"]


def test_the_last_line_is_written_even_between_intervals(monkeypatch, capsys):
    """At most one line per interval, plus the last, so a log always ends with the total."""
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "1000")
    for _ in track(4, "index final-cos"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines and "index final-cos: 4/4 chunks" in lines[-1]


def test_quiet_silences_everything(monkeypatch, capsys):
    monkeypatch.setenv("GNNLM_QUIET", "1")
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")
    say("[gnnlm] stage done")
    list(track(3, "demo"))
    assert capsys.readouterr().err == ""


def test_progress_line_counts_rate_and_eta(monkeypatch):
    monkeypatch.setenv("GNNLM_QUIET", "1")
    bar = Progress(10, "neighbours train", initial=4)
    bar.t0 -= 2.0                                                     # two seconds ago
    bar.update(2)
    line = bar.line()
    assert line.startswith("neighbours train: 6/10 chunks, ")
    assert "1.00 chunk/s" in line or "0.99 chunk/s" in line          # 2 chunks in ~2 s
    assert "ETA 4s" in line or "ETA 3s" in line
    bar.close()


def test_a_count_without_a_total_or_past_it_shows_no_total(monkeypatch):
    monkeypatch.setenv("GNNLM_QUIET", "1")
    for total, done in ((-1, 5), (0, 5), (6, 7)):
        bar = Progress(total, "demo", initial=done)
        line = bar.line()
        assert line.startswith(f"demo: {done} chunks, ") and "ETA" not in line, line
        assert f"/{total}" not in line


@pytest.mark.parametrize("current_epoch,max_epochs,max_steps,expected", [
    (0, 2, -1, "epoch 1/2"),
    (1, 2, -1, "epoch 2/2"),
    (2, 2, -1, "epoch 2/2"),        # after the last epoch ended: not "epoch 3/2"
    (0, -1, 200, "epoch 1"),        # max_steps bounds training: not "epoch 1/-1" or "1/-2"
    (3, None, 200, "epoch 4"),
    (0, 5, 200, "epoch 1"),         # both set: the steps may end it first
    (0, 1000, -1, "epoch 1/1000"),  # Lightning's default when neither is set
])
def test_an_epoch_count_is_never_past_or_beside_a_bogus_total(current_epoch, max_epochs,
                                                               max_steps, expected):
    from gnnlm.lit.progress_log import epoch_part

    assert epoch_part(current_epoch, max_epochs, max_steps) == expected


def test_the_progress_line_of_a_fit_bounded_by_steps(monkeypatch):
    """The line of ``ProgressLog`` from the trainer's counters: steps of the total, and the
    epoch alone when max_steps (max_epochs = -1) bounds training."""
    from types import SimpleNamespace

    from gnnlm.lit.progress_log import ProgressLog

    log = ProgressLog(enabled=True)
    trainer = SimpleNamespace(global_step=120, estimated_stepping_batches=200, current_epoch=2,
                              max_epochs=-1, max_steps=200, callbacks=[],
                              callback_metrics={"train/loss": 3.25})
    line = log.line(trainer, SimpleNamespace())
    assert line.startswith("fit SimpleNamespace: step 120/200 (60%), epoch 3, ")
    assert "/-" not in line and line.endswith("train/loss 3.2500")
    trainer.max_epochs, trainer.max_steps, trainer.current_epoch = 3, -1, 3   # training ended
    assert ", epoch 3/3, " in log.line(trainer, SimpleNamespace())


def test_resuming_says_what_happens_to_the_epoch_it_stopped_in():
    from gnnlm.lit.progress_log import resume_line

    def checkpoint(processed, last=False):
        return {"global_step": 9, "epoch": 0, "loops": {"fit_loop": {
            "epoch_loop.batch_progress": {"current": {"processed": processed},
                                          "is_last_batch": last}}}}

    mid = resume_line("lm", "/w/last.ckpt", checkpoint(9))
    assert mid.startswith("resuming lm from step 9 (/w/last.ckpt): weights, optimiser and "
                          "schedule as saved; epoch 1 stopped after 9 batches and goes on with "
                          "batches drawn from the train loader's start again")
    assert "seen twice" in mid
    for start, epoch in ((checkpoint(14, last=True), 2), (checkpoint(0), 1)):
        line = resume_line("lm", "/w/last.ckpt", start)
        assert line == (f"resuming lm from step 9 (/w/last.ckpt), at the start of epoch {epoch}: "
                        f"weights, optimiser and schedule as saved")


def test_lightning_says_no_device_banner_but_keeps_its_warnings(caplog):
    """Every Trainer logs "GPU available: ..., used: ..." when it is made, and the pipeline makes
    one per evaluation; gnnlm's commands drop it, and Lightning's restoring lines inside a
    resumed fit only, while its warnings (e.g. a GPU left unused) still reach the user."""
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from gnnlm.utils.quiet import quiet_lightning, resumed_fit

    quiet_lightning()
    caplog.set_level(logging.INFO)
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False)
    rank_zero_info("Restored all states from the checkpoint at x.ckpt")
    with resumed_fit():
        rank_zero_info("Restoring states from the checkpoint path at y.ckpt")
    with resumed_fit(False):
        rank_zero_info("Restoring states from the checkpoint path at z.ckpt")
    said = caplog.text
    assert "GPU available: " not in said and "TPU available: " not in said
    assert "x.ckpt" in said and "y.ckpt" not in said and "z.ckpt" in said
    with pytest.warns(UserWarning, match="GPU available but not used"):
        rank_zero_warn("GPU available but not used. You can set it by doing "
                       "`Trainer(accelerator='gpu')`.")


@pytest.mark.parametrize("max_epochs,max_steps,expected", [
    (-1, 80, "Epoch 0"),            # max_steps bounds training: Lightning's bar said "Epoch 0/-2"
    (5, 80, "Epoch 0"),             # both set: the steps may end it first
    (2, -1, "Epoch 0/1"),           # Lightning's own, counted from 0
])
def test_the_progress_bar_shows_an_epoch_total_only_where_epochs_bound_training(
        max_epochs, max_steps, expected):
    from types import SimpleNamespace

    from gnnlm.lit.progress_log import EpochBar

    bar = EpochBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps)
    assert bar._get_train_description(0) == f"{expected:{len('Validation')}}"


def test_a_fit_bounded_by_steps_prints_no_epoch_total(tmp_path):
    """``gnnlm fit`` with max_steps, its output redirected: the rich bar's last frame (kept in
    the log when the run ends) reads "Epoch 0", not "Epoch 0/-2"."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.fakes import write_corpus

    words = [f"w{i % 37}" for i in range(3000)]
    corpus = write_corpus(tmp_path / "corpus", train=" ".join(words) + "\n")
    args = ["fit", "-c", "configs/trainer/cpu.yaml",
            "-c", "configs/examples/own_corpus/base_lm.yaml", "--data.init_args.corpus=tiny",
            f"--data.init_args.corpus_path={corpus}",
            f"--data.init_args.workdir={tmp_path / 'work'}", "--trainer.max_steps=2",
            "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1"]
    out = subprocess.run([sys.executable, "-m", "gnnlm.cli", *args], cwd=REPO, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    frames = [line for line in out.stdout.splitlines() if line.startswith("Epoch ")]
    assert frames and all(line.startswith("Epoch 0 ") for line in frames), frames
