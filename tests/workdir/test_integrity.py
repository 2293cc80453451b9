"""Corrupted data is caught and a run has its work directory to itself: checksums in every
manifest, checked when a run reuses an artifact and by ``gnnlm verify``; a log-probability that
is inf or NaN stops the run, naming the file and the position; one run per work directory."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gnnlm.pipeline.scoring import head_logprobs
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.knn_cache import build_knn_cache
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
from gnnlm.utils.metrics import check_finite
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.lock import LOCK_FILE, WorkdirBusy, lock_workdir
from gnnlm.workdir.manifests import MANIFEST_SHA256, read_manifest, write_json_atomic
from gnnlm.workdir.refusals import ArtifactError
from tests.conftest import CPU, REPO
from tests.fakes import error_of, write_features

CHANGED = "changed after it was built (a disk fault, a copy cut short, or an edit)."

pytestmark = pytest.mark.usefixtures("in_repo")


def make_workdir(root, lm_logprob=None):
    """Features, an exact index, neighbours and kNN caches: a small finished work directory."""
    rng = np.random.default_rng(0)
    wd = Workdir(root)
    write_features(wd.features("train"), rng.standard_normal((400, 8)).astype(np.float32),
                   targets=rng.integers(0, 9, 400).astype(np.int32))
    for split in ("valid", "test"):
        values = -rng.uniform(1, 3, 60) if lm_logprob is None else lm_logprob
        write_features(wd.features(split), rng.standard_normal((60, 8)).astype(np.float32),
                       targets=rng.integers(0, 9, 60).astype(np.int32), lm_logprob=values,
                       split=split)
    build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=10))
    for split in ("valid", "test"):
        build_neighbors(wd, split, "final", "cos", NeighborsConfig(K=16))
        build_knn_cache(wd, split, "final", "cos", chunk=16)
    return wd


@pytest.fixture
def wd(tmp_path):
    return make_workdir(tmp_path / "w")


def flip(file, at=16, n=8):
    """Change ``n`` bytes of ``file`` in place (its size stays the same)."""
    data = bytearray(file.read_bytes())
    data[at:at + n] = bytes(255 - b for b in data[at:at + n])
    file.write_bytes(bytes(data))


def sha256(file):
    return hashlib.sha256(file.read_bytes()).hexdigest()


# -- checksums --------------------------------------------------------------------------------
def test_finish_records_the_sha256_of_every_file(tmp_path):
    builder = ArtifactBuilder(tmp_path / "a", kind="demo")
    with builder:
        builder.array("values", np.float32, (5, 3))[...] = 1.5
        builder.file("model.ckpt").write_bytes(b"weights")
        (builder.partial / "tok").mkdir()
        (builder.partial / "tok" / "vocab.json").write_text("{}")
        builder.finish()
    manifest = read_manifest(tmp_path / "a")
    assert manifest["arrays"]["values"]["sha256"] == sha256(tmp_path / "a" / "values.bin")
    assert manifest["files"] == {"model.ckpt": hashlib.sha256(b"weights").hexdigest(),
                                 "tok/vocab.json": hashlib.sha256(b"{}").hexdigest()}


def test_flipped_bytes_are_caught_when_a_run_reuses_the_stage(wd):
    folder = wd.knn_cache("final", "cos", "faiss", "test")
    flip(folder / "sims.bin")
    with pytest.raises(ArtifactError) as caught:
        build_knn_cache(wd, "test", "final", "cos", chunk=16)
    assert str(caught.value) == (
        f"{folder / 'sims.bin'} does not match the sha256 in its manifest: the knn cache "
        f"{CHANGED} Rerun with --rebuild=[knn_cache] or delete {folder}.")
    build_knn_cache(wd, "test", "final", "cos", chunk=16, rebuild=True)  # what it says works
    build_knn_cache(wd, "test", "final", "cos", chunk=16)


def test_a_file_above_the_reuse_limit_has_its_size_checked_and_verify_reads_it(wd, monkeypatch,
                                                                             capsys):
    folder = wd.features("test")
    flip(folder / "final.bin")
    monkeypatch.setattr("gnnlm.workdir.builder.REUSE_CHECK_BYTES", 0)
    assert write_features_again(wd)  # reused: the big file's bytes are not read
    assert error_of(["verify", str(wd.root)], capsys) == (
        f"gnnlm verify: error: 1 of 8 artifacts in {wd.root} are damaged: "
        f"{folder / 'final.bin'} does not match the sha256 in its manifest. Rerun with "
        f"--rebuild=[features] or delete {folder}.")
    (folder / "final.bin").write_bytes(b"")
    with pytest.raises(ArtifactError, match=re.escape(
            f"{folder / 'final.bin'} holds 0 bytes but its manifest says 960: the features")):
        write_features_again(wd)


def write_features_again(wd):
    """The test features' builder as ``write_features`` made it: True when it is reused."""
    manifest = read_manifest(wd.features("test"))
    return ArtifactBuilder(wd.features("test"), kind="features", config=manifest["config"],
                           inputs=manifest["inputs"]).is_complete()


def strip_checksums(folder):
    manifest = read_manifest(folder)
    manifest.pop("files")
    manifest.pop(MANIFEST_SHA256)
    for spec in manifest["arrays"].values():
        spec.pop("sha256")
    write_json_atomic(folder / "manifest.json", manifest)


def test_a_work_directory_from_before_checksums_is_reused_and_verify_says_so(wd, capsys):
    """Every manifest written before checksums: the sizes are all that can be checked."""
    for folder in sorted(p.parent for p in wd.root.rglob("manifest.json")):
        strip_checksums(folder)
    folder = wd.features("test")
    flip(folder / "final.bin")
    assert write_features_again(wd)
    from gnnlm.cli import main

    main(["verify", str(wd.root)])
    lines = capsys.readouterr().out.splitlines()
    assert f"{'features/test':<31}  no checksum recorded: the manifest predates checksums; " \
           f"sizes match" in lines
    assert lines[-1].startswith("8 artifacts: 0 ok, 8 with no checksum recorded, 0 bad; "
                                "0 unfinished; ")


def test_a_manifest_whose_checksum_was_removed_is_refused(wd):
    """An edited manifest whose ``manifest_sha256`` was deleted to hide the edit, among
    manifests that have theirs: the run that would reuse it and ``gnnlm verify`` (a process of
    its own, exiting 2) refuse it in one line naming the file and the ``--rebuild`` that
    remakes it."""
    folder = wd.features("test")
    manifest = read_manifest(folder)
    manifest["n"] = 59
    manifest.pop(MANIFEST_SHA256)
    write_json_atomic(folder / "manifest.json", manifest)
    said = (f"{folder / 'manifest.json'} records no manifest_sha256, but the other manifests of "
            f"{wd.root} do (e.g. features/train/manifest.json): its checksum was removed, so an "
            f"edit to it cannot be ruled out (only a work directory whose every manifest predates "
            f"checksums is read without them). Rerun with --rebuild=[features] or delete "
            f"{folder}.")
    with pytest.raises(ArtifactError) as err:
        write_features_again(wd)
    assert str(err.value) == said
    done = subprocess.run([sys.executable, "-m", "gnnlm.cli", "verify", str(wd.root)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{'features/test':<31}  bad: {said}" in done.stdout.splitlines()
    errors = [line for line in done.stderr.splitlines() if line.startswith("gnnlm ")]
    assert errors == [f"gnnlm verify: error: 1 of 8 artifacts in {wd.root} are damaged: {said}"]


# -- gnnlm verify -----------------------------------------------------------------------------
def test_verify_a_sound_work_directory(wd, capsys):
    from gnnlm.cli import main

    (wd.root / "pq" / "final.partial").mkdir(parents=True)
    main(["verify", str(wd.root)])
    lines = capsys.readouterr().out.splitlines()
    names = ["features/test", "features/train", "features/valid", "index/final-cos",
             "knn_cache/final-cos-faiss/test", "knn_cache/final-cos-faiss/valid",
             "neighbors/final-cos/test", "neighbors/final-cos/valid"]
    width = len("knn_cache/final-cos-faiss/valid")
    sizes = [sum(f.stat().st_size for f in (wd.root / n).iterdir() if f.name != "manifest.json")
             for n in names]
    assert lines[:-1] == [f"{n:<{width}}  ok: {s / 1e3:.1f} kB, sha256 matches"
                          for n, s in zip(names, sizes)] + [
        f"{'pq/final.partial':<{width}}  unfinished: the next run of its stage resumes it"]
    assert re.fullmatch(r"8 artifacts: 8 ok, 0 with no checksum recorded, 0 bad; 1 unfinished; "
                        rf"{sum(sizes) / 1e3:.1f} kB checked in \d+\.\d s", lines[-1])


def test_verify_names_every_bad_file_and_how_to_rebuild_it(wd, capsys):
    features = wd.features("test")
    flip(features / "lm_logprob.bin")
    neighbors = wd.neighbors("final", "cos", "valid")
    (neighbors / "sims.bin").write_bytes(b"\0" * 8)
    index = wd.index("final", "cos")
    (index / "index.faiss").unlink()
    assert error_of(["verify", str(wd.root)], capsys) == (
        f"gnnlm verify: error: 3 of 8 artifacts in {wd.root} are damaged: "
        f"{features / 'lm_logprob.bin'} does not match the sha256 in its manifest. Rerun with "
        f"--rebuild=[features] or delete {features}. "
        f"{index / 'index.faiss'} is missing. Rerun with --rebuild=[index] or delete {index}. "
        f"{neighbors / 'sims.bin'} holds 8 bytes but its manifest says 3840. Rerun with "
        f"--rebuild=[neighbors] or delete {neighbors}.")
    from gnnlm.cli import main

    with pytest.raises(SystemExit):
        main(["verify", str(wd.root)])
    lines = capsys.readouterr().out.splitlines()
    assert f"{'features/test':<31}  bad: {features / 'lm_logprob.bin'} does not match the " \
           f"sha256 in its manifest" in lines
    assert lines[-1].startswith("8 artifacts: 5 ok, 0 with no checksum recorded, 3 bad; "
                                "0 unfinished; ")


def test_an_edited_manifest_is_caught_like_a_flipped_byte(wd, capsys):
    """A number kept in a manifest, edited after the build (the neighbours' depth K), is refused
    by the run that would reuse the stage and by verify: one line naming the file and the
    ``--rebuild`` that remakes it. The caches made from those neighbours are not blamed."""
    neighbors = wd.neighbors("final", "cos", "valid")
    file = neighbors / "manifest.json"
    manifest = json.loads(file.read_text())
    manifest["K"] = 8
    write_json_atomic(file, manifest)
    said = (f"{file} was edited after it was written (its content no longer matches its "
            f"manifest_sha256). Rerun with --rebuild=[neighbors] or delete {neighbors}.")
    with pytest.raises(ArtifactError) as err:
        build_neighbors(wd, "valid", "final", "cos", NeighborsConfig(K=16))
    assert str(err.value) == said
    assert error_of(["verify", str(wd.root)], capsys) == (
        f"gnnlm verify: error: 1 of 8 artifacts in {wd.root} are damaged: {said}")


def test_verify_follows_artifacts_linked_in_from_another_work_directory(wd, tmp_path, capsys):
    """A work directory that links the features of another (shared to save disk) is verified
    through the links."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "features").symlink_to(wd.root / "features")
    flip(wd.features("valid") / "lm_logprob.bin")
    line = error_of(["verify", str(other)], capsys)
    assert line.startswith(f"gnnlm verify: error: 1 of 3 artifacts in {other} are damaged: "
                           f"{other / 'features' / 'valid' / 'lm_logprob.bin'} does not match")


def test_verify_of_a_folder_that_is_no_work_directory(tmp_path, capsys):
    assert error_of(["verify", str(tmp_path)], capsys) == (
        f"gnnlm verify: error: {tmp_path} holds no artifacts (no manifest.json under it): give "
        f"the folder a pipeline config's `workdir:` names.")


# -- log-probabilities that are inf or NaN ----------------------------------------------------
def test_check_finite_names_the_first_bad_position():
    values = np.zeros(10, dtype=np.float32)
    values[[7, 9]] = [-np.inf, np.nan]
    with pytest.raises(ValueError) as caught:
        check_finite(values, "x.bin", "fix it.", start=100, block=4)
    assert str(caught.value) == "x.bin is not finite at position 107 (-inf): fix it."
    check_finite(values[:7], "x.bin", "fix it.")


def test_an_inf_in_a_cache_stops_the_sweep_naming_file_and_position(wd, capsys):
    folder = wd.knn_cache("final", "cos", "faiss", "valid")
    np.memmap(folder / "lm_logprob.bin", np.float32, "r+", shape=(60,))[17] = -np.inf
    assert error_of(["sweep", *CPU, f"--workdir={wd.root}", "--knn.keys=[final]"], capsys) == (
        f"gnnlm sweep: error: {folder / 'lm_logprob.bin'} is not finite at position 17 (-inf): "
        f"the file changed after it was written, or was written before such values were "
        f"refused. Rerun with --rebuild=[knn_cache] or delete {folder}.")


def test_features_with_an_inf_stop_the_cache_build(tmp_path):
    values = np.full(60, -2.0)
    values[41] = np.inf
    with pytest.raises(ValueError) as caught:
        make_workdir(tmp_path / "w", lm_logprob=values)
    features = Workdir(tmp_path / "w").features("valid")
    assert str(caught.value) == (
        f"{features / 'lm_logprob.bin'} is not finite at position 41 (inf): the file changed "
        f"after it was written, or was written before such values were refused. Rerun with "
        f"--rebuild=[features] or delete {features}.")


def test_a_head_s_nan_score_is_refused(tmp_path):
    wd = Workdir(tmp_path / "w")
    builder = ArtifactBuilder(wd.model("gnn"), kind="trained_model")
    with builder:
        builder.array("test_logprob", np.float32, (5,))[...] = [-1, -2, np.nan, -1, -1]
        builder.finish()
    with pytest.raises(ValueError) as caught:
        head_logprobs(wd, "gnn", "test")
    file = wd.model("gnn") / "test_logprob.bin"
    assert str(caught.value) == (
        f"{file} is not finite at position 2 (nan): the file changed after it was written, or "
        f"was written before such values were refused. Rerun with --rebuild=[gnn] or delete "
        f"{wd.model('gnn')}.")


@pytest.mark.filterwarnings("ignore:.*LeafSpec")  # Lightning's, silenced by `gnnlm` itself
def test_a_head_that_predicts_nan_is_refused():
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gnnlm.pipeline.scoring import predict_logprobs

    class Scores(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.values = torch.tensor([-1.0, -2.0, -1.0, float("nan"), -3.0])

        def predict_step(self, batch, batch_idx):
            return {"positions": batch, "logprob": self.values[batch]}

    class Positions(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"predict_split": None})

        def connect(self, predict_split=None):
            pass

        def predict_dataloader(self):
            return DataLoader(torch.arange(5), batch_size=2)

    with pytest.raises(ValueError) as caught:
        predict_logprobs(Scores(), Positions(), "test", 5)
    assert str(caught.value) == (
        "Scores's predicted test log p(target) is not finite at position 3 (nan): the model "
        "gives that target probability 0 or NaN (weights with inf/NaN, or an overflow at this "
        "precision): check its training run, or train in 32-bit.")


def test_a_base_lm_that_gives_nan_stops_the_features_build(tmp_path):
    from gnnlm.models.gpt import GPT, GPTConfig
    from gnnlm.retrieval.features import build_features
    from gnnlm.text.tokens import build_tokens

    corpus = tmp_path / "tiny"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text("a b c a b\nc a b c\n")
    store = build_tokens(tmp_path / "tokens", "tiny", corpus_path=str(corpus))
    model = GPT(GPTConfig(vocab_size=store.vocab_size, context_length=8, n_layer=1, n_head=1,
                          d_model=8, d_ff=16, dropout=0.0)).eval()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    wd = Workdir(tmp_path / "w")
    with pytest.raises(ValueError) as caught:
        build_features(model, store, wd, "valid", 8, 4, device="cpu")
    assert str(caught.value) == (
        f"{wd.features('valid') / 'lm_logprob.bin'} is not finite at position 0 (nan): the base "
        f"LM gives that target probability 0 or NaN (weights with inf/NaN, or an overflow at "
        f"this precision): check the checkpoint.")
    assert not wd.features("valid").exists()


# -- one run per work directory ---------------------------------------------------------------
HOLD = textwrap.dedent("""
    import sys, time
    from gnnlm.workdir.lock import lock_workdir
    lock = lock_workdir(sys.argv[1], sys.argv[2], shared=sys.argv[3] == "shared")
    print("held", flush=True)
    time.sleep(120)
""")


def holder(root, command="pipeline", mode="exclusive"):
    """Another process holding the lock of ``root``, once it says so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), command, mode],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_second_run_is_refused_naming_the_first(tmp_path, capsys):
    root = tmp_path / "w"
    first = holder(root)
    try:
        record = json.loads((root / LOCK_FILE).read_text())
        line = error_of(["pipeline", *CPU, f"--workdir={root}"], capsys)
    finally:
        first.kill()
        first.wait()
    assert record["pid"] == first.pid and record["host"] == socket.gethostname()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", record["started"])
    assert line == (
        f"gnnlm pipeline: error: The work directory {root} is in use by another run (gnnlm "
        f"pipeline, process {first.pid} on {record['host']}, started {record['started']}): "
        f"wait for it to finish, or use another work directory.")


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, capsys):
    root = tmp_path / "w"
    first = holder(root)
    record = json.loads((root / LOCK_FILE).read_text())
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    with lock_workdir(root, "pipeline"):
        assert json.loads((root / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err.splitlines() == [
        f"[gnnlm] took over the lock of {root} left by gnnlm pipeline, process {first.pid} on "
        f"{record['host']}, started {record['started']}, which ended without releasing it"]
    assert (root / LOCK_FILE).read_text() == ""  # released cleanly: the next run says nothing
    with lock_workdir(root, "pipeline"):
        pass
    assert capsys.readouterr().err == ""


def test_a_process_the_holder_starts_works_under_its_lock(tmp_path):
    """Lightning's DDP launcher runs the same command again for ranks 1..N-1."""
    root = tmp_path / "w"
    child = ("import sys; from gnnlm.workdir.lock import lock_workdir; "
             "lock_workdir(sys.argv[1], 'pipeline'); print('rank 1 runs')")
    parent = textwrap.dedent(f"""
        import subprocess, sys
        from gnnlm.workdir.lock import lock_workdir
        lock = lock_workdir(sys.argv[1], "pipeline")
        out = subprocess.run([sys.executable, "-c", {child!r}, sys.argv[1]],
                             capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])
    """)
    out = subprocess.run([sys.executable, "-c", parent, str(root)], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    assert out == "rank 1 runs\n"
    assert (root / LOCK_FILE).read_text() == ""


def test_sweep_agents_share_the_lock_and_a_pipeline_is_refused_while_they_run(tmp_path):
    root = tmp_path / "w"
    agent = holder(root, "sweep", "shared")
    try:
        with lock_workdir(root, "sweep", shared=True):
            pass
        with pytest.raises(WorkdirBusy) as refused:
            lock_workdir(root, "pipeline")
    finally:
        agent.kill()
        agent.wait()
    assert str(refused.value) == (
        f"The work directory {root} is in use by `gnnlm sweep` runs reading it: wait for them "
        f"to finish, or use another work directory.")
