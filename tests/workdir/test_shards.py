"""Sharded builds: the chunk bookkeeping of gnnlm.workdir.shards, the process counts of
gnnlm.workdir.ranks, and features and neighbours of a WikiText-2 slice built by one process and by
two (gloo on CPU, run by tests/sharded_build.py in its own process): the same bytes in every array
file and the same fingerprints, also when a build stopped on one process count is resumed on the
other."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnlm.models.encode import sliding_windows
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.multi_gpu import shard_over_gpus
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
from gnnlm.retrieval.search import Searcher
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.ranks import Rank, resolve_devices
from gnnlm.workdir.shards import ShardedJob, deal, done_chunks, totals
from tests import sharded_setup as setup

SCRIPT = Path(__file__).resolve().parents[1] / "sharded_build.py"


def script(stage: str, workdir: Path, tokens: Path, devices: int = 2,
           stop_after: int | None = None, max_tokens: int | None = None) -> list[str]:
    """The command line of ``tests/sharded_build.py`` for one build."""
    cmd = [sys.executable, str(SCRIPT), stage, str(workdir), str(tokens),
           "--devices", str(devices)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    if max_tokens is not None:
        cmd += ["--max-tokens", str(max_tokens)]
    return cmd


ENV = {**os.environ, "GNNLM_QUIET": "1", "PYTHONUNBUFFERED": "1"}


def run_script(stage: str, workdir: Path, tokens: Path, devices: int = 2,
               stop_after: int | None = None) -> dict:
    """``tests/sharded_build.py`` in its own Python process; its manifest."""
    cmd = script(stage, workdir, tokens, devices, stop_after)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_same_arrays(a: Path, b: Path) -> None:
    """Every array file of two complete artifacts holds the same bytes; same fingerprints."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["fingerprint"] == mb["fingerprint"] and ma["arrays"] == mb["arrays"]
    for spec in ma["arrays"].values():
        assert (a / spec["file"]).read_bytes() == (b / spec["file"]).read_bytes(), spec["file"]
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


def share(reference: Path, root: Path, *names: str) -> Path:
    """A work directory that links the reference's ``names`` folders (and builds the rest)."""
    root.mkdir(parents=True)
    for name in names:
        (root / name).symlink_to(reference / name)
    return root


# -- the chunk bookkeeping, in this process ----------------------------------------------------
@dataclass
class CountingJob(ShardedJob):
    """Chunk c writes c + 1 into its rows of one array and counts them."""
    out_dir: Path
    chunks_total: int
    rows: int
    stop_after: int | None = None

    @property
    def n_chunks(self) -> int:
        return self.chunks_total

    @property
    def desc(self) -> str:
        return "counting"

    def builder(self) -> ArtifactBuilder:
        return ArtifactBuilder(self.out_dir, kind="counting",
                               config={"chunks": self.chunks_total, "rows": self.rows})

    def setup(self, builder):
        builder.array("values", np.int64, (self.chunks_total * self.rows,))

    def work(self, rank, chunks, arrays):
        for chunk, stats in chunks:
            arrays["values"][chunk * self.rows:(chunk + 1) * self.rows] = chunk + 1
            stats["rows"] = self.rows

    def extra(self, rank, done, wall_seconds):
        return {"rows": totals(done)["rows"], "devices": rank.world}


def test_deal_is_round_robin_over_the_chunks_left():
    done = {1: {}, 4: {}}
    assert deal(7, done, 0, 2) == [0, 3, 6] and deal(7, done, 1, 2) == [2, 5]
    assert deal(7, done, 0, 1) == [0, 2, 3, 5, 6]
    assert totals({0: {"a": 2, "s": 0.5}, 3: {"a": 3, "s": 0.25}}) == {"a": 5, "s": 0.75}
    with pytest.raises(ValueError, match=r"got 2"):
        deal(3, {}, 2, 2)


def test_any_ranks_of_any_runs_finish_a_build_with_the_bytes_of_one(tmp_path):
    """Ranks of runs with 3 and 2 processes, run one after another, stop with chunks left; a
    one-process run finishes them. Every chunk is written and counted exactly once."""
    cpu = torch.device("cpu")
    job = CountingJob(tmp_path / "a", chunks_total=7, rows=5)
    assert job(Rank(0, 3, cpu)) == {}                        # chunks 0, 3, 6
    assert job(Rank(2, 3, cpu)) == {}                        # of 1, 2, 4, 5: chunk 4
    partial = tmp_path / "a.partial"
    assert sorted(done_chunks(partial, job.builder().fingerprint)) == [0, 3, 4, 6]
    job.stop_after = 1
    assert job(Rank(0, 2, cpu)) == {}                        # of 1, 2, 5: chunk 1
    assert sorted(json.loads((partial / "progress.rank0.json").read_text())["chunks"]) == \
        ["0", "1", "3", "6"]                                 # the former run's records stay
    (partial / "progress.rank1.json.tmp").write_text("{\"torn")  # a write cut short
    job.stop_after = None
    manifest = job(Rank(0, 1, cpu))                          # chunks 2, 5
    assert manifest["rows"] == 35 and manifest["devices"] == 1
    values = np.fromfile(tmp_path / "a" / "values.bin", dtype=np.int64)
    np.testing.assert_array_equal(values, np.repeat(np.arange(1, 8), 5))
    assert not list((tmp_path / "a").glob("progress*"))
    whole = CountingJob(tmp_path / "b", chunks_total=7, rows=5)
    whole(Rank(0, 1, cpu))
    assert_same_arrays(tmp_path / "a", tmp_path / "b")


def test_process_counts():
    assert resolve_devices(1, "cpu") == (1, "cpu")
    assert resolve_devices(3, "cpu") == (3, "cpu")
    if not torch.cuda.is_available():
        assert resolve_devices("auto", "auto") == (1, "cpu")
        with pytest.raises(ValueError, match="torch sees 0"):
            resolve_devices(2, "cuda")
    with pytest.raises(ValueError, match="got 'cuda:1'"):
        resolve_devices(2, "cuda:1")
    for bad in (0, -1, "two", True):
        with pytest.raises(ValueError, match="devices must be"):
            resolve_devices(bad, "cpu")


def test_neighbours_config_keeps_process_counts_out_of_the_fingerprint():
    one, two = NeighborsConfig(K=4), NeighborsConfig(K=4, devices=2)
    assert one.fingerprint_config() == two.fingerprint_config()
    assert "devices" not in one.fingerprint_config()
    with pytest.raises(ValueError, match="got 0"):
        NeighborsConfig(devices=0)
    with pytest.raises(ValueError, match="devices=2"):
        NeighborsConfig(shard_index=True, devices=2)
    with pytest.raises(ValueError, match="backend='exact'"):
        NeighborsConfig(shard_index=True, backend="exact")


# -- a WikiText-2 slice, one process here and two in tests/sharded_build.py -------------------
@pytest.fixture(scope="module")
def tokens_dir(wikitext_root, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sharded") / "tokens"
    setup.tokens(root, str(wikitext_root))
    return root


@pytest.fixture(scope="module")
def reference(tokens_dir, tmp_path_factory) -> Path:
    """One-process features of the slice, an exact index over them, and train neighbours."""
    root = tmp_path_factory.mktemp("one")
    setup.features(root, tokens_dir)
    # a Flat index is exact: no search setting to measure
    build_index(Workdir(root), setup.KEY, setup.METRIC,
                IndexConfig(factory="Flat", recall_queries=0))
    setup.neighbors(root)
    return root


@pytest.mark.multiprocess
def test_features_on_two_processes_are_the_bytes_of_one(reference, tokens_dir, tmp_path):
    manifest = run_script("features", tmp_path, tokens_dir, devices=2)
    assert manifest["devices"] == 2 and manifest["n"] == setup.TRAIN_TOKENS
    assert read_manifest(Workdir(reference).features("train"))["devices"] == 1
    assert_same_arrays(Workdir(reference).features("train"), Workdir(tmp_path).features("train"))


@pytest.mark.multiprocess
def test_neighbours_on_two_processes_are_the_bytes_of_one(reference, tokens_dir, tmp_path):
    root = share(reference, tmp_path / "w", "features", "index")
    manifest = run_script("neighbors", root, tokens_dir, devices=2)
    one = read_manifest(Workdir(reference).neighbors(setup.KEY, setup.METRIC, "train"))
    assert (manifest["devices"], one["devices"]) == (2, 1)
    for name in ("retrieved", "dropped", "retrieved_top_k", "dropped_top_k", "masked_fraction",
                 "masked_fraction_top_k"):
        assert manifest[name] == one[name], name
    assert 0 < manifest["masked_fraction"] < 1 and manifest["search_seconds"] > 0
    assert_same_arrays(Workdir(reference).neighbors(setup.KEY, setup.METRIC, "train"),
                       Workdir(root).neighbors(setup.KEY, setup.METRIC, "train"))


@pytest.mark.multiprocess
def test_features_stopped_on_one_process_resume_on_two(reference, tokens_dir, tmp_path):
    assert setup.features(tmp_path, tokens_dir, devices=1, stop_after=3) == {}
    partial = Workdir(tmp_path).features("train").with_name("train.partial")
    assert sorted(json.loads((partial / "progress.rank0.json").read_text())["chunks"]) == \
        ["0", "1", "2"]
    # Killed while writing chunk 3: its rows hold garbage, and it was never recorded.
    _, score_from = sliding_windows(setup.TRAIN_TOKENS, setup.CONTEXT, setup.STRIDE)
    rows = slice(score_from[3 * setup.CHUNK_WINDOWS], score_from[4 * setup.CHUNK_WINDOWS])
    final = np.memmap(partial / "final.bin", dtype=np.float16, mode="r+",
                      shape=(setup.TRAIN_TOKENS, 64))
    final[rows] = 7.0
    final.flush()
    del final
    manifest = run_script("features", tmp_path, tokens_dir, devices=2)
    assert manifest["devices"] == 2
    assert_same_arrays(Workdir(reference).features("train"), Workdir(tmp_path).features("train"))


@pytest.mark.multiprocess
def test_neighbours_stopped_on_two_processes_resume_on_one(reference, tokens_dir, tmp_path):
    root = share(reference, tmp_path / "w", "features", "index")
    assert run_script("neighbors", root, tokens_dir, devices=2, stop_after=2) == {}
    partial = Workdir(root).neighbors(setup.KEY, setup.METRIC, "train").with_name(
        "train.partial")
    records = {rank: json.loads((partial / f"progress.rank{rank}.json").read_text())["chunks"]
               for rank in (0, 1)}
    assert sorted(records[0]) == ["0", "2"] and sorted(records[1]) == ["1", "3"]
    manifest = setup.neighbors(root, devices=1)
    one = read_manifest(Workdir(reference).neighbors(setup.KEY, setup.METRIC, "train"))
    assert manifest["masked_fraction"] == one["masked_fraction"]
    assert manifest["retrieved"] == one["retrieved"] and manifest["devices"] == 1
    assert_same_arrays(Workdir(reference).neighbors(setup.KEY, setup.METRIC, "train"),
                       Workdir(root).neighbors(setup.KEY, setup.METRIC, "train"))


def test_a_sharded_gpu_index_needs_faiss_gpu(reference, tmp_path):
    from gnnlm.utils.devices import faiss_has_gpu

    if faiss_has_gpu():
        pytest.skip("this faiss has GPU support")
    root = share(reference, tmp_path / "w", "features", "index")
    wd = Workdir(root)
    with pytest.raises(ValueError, match="faiss-gpu"):
        shard_over_gpus(Searcher.for_workdir(wd, setup.KEY, setup.METRIC, device="cpu"),
                        k=setup.K)
    with pytest.raises(ValueError, match="neighbors.shard_index"):
        build_neighbors(wd, "train", setup.KEY, setup.METRIC,
                        NeighborsConfig(K=setup.K, shard_index=True),
                        leakage_window=setup.CONTEXT)
    assert not wd.neighbors(setup.KEY, setup.METRIC, "train").with_name(
        "train.partial").exists()  # refused before any work


@pytest.mark.integration
@pytest.mark.multiprocess
def test_a_killed_two_process_build_resumes_on_one(tokens_dir, tmp_path):
    """SIGKILL to a two-process build once some chunks are recorded (the ranks die mid-chunk);
    one process finishes it with the bytes of an uninterrupted build."""
    tokens = 40 * setup.TRAIN_TOKENS  # 625 chunks: the ranks are still busy when killed
    whole = setup.features(tmp_path / "one", tokens_dir, max_tokens=tokens)
    partial = Workdir(tmp_path / "two").features("train").with_name("train.partial")
    proc = subprocess.Popen(script("features", tmp_path / "two", tokens_dir, 2,
                                   max_tokens=tokens), env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(done_chunks(partial, whole["fingerprint"])) < 20:
            assert proc.poll() is None and time.monotonic() < deadline, "no chunks recorded"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    n_chunks = -(-len(sliding_windows(tokens, setup.CONTEXT, setup.STRIDE)[0])
                 // setup.CHUNK_WINDOWS)
    recorded = done_chunks(partial, whole["fingerprint"])
    assert 20 <= len(recorded) < n_chunks
    assert {int(f.name[len("progress.rank"):-len(".json")])
            for f in partial.glob("progress.rank*.json")} == {0, 1}
    resumed = setup.features(tmp_path / "two", tokens_dir, devices=1, max_tokens=tokens)
    assert resumed["fingerprint"] == whole["fingerprint"]
    assert_same_arrays(Workdir(tmp_path / "one").features("train"),
                       Workdir(tmp_path / "two").features("train"))
