"""Sharded resumable chunk loops: which chunks a rank does, and its own progress file.

A sharded build splits its work into the same fixed chunks as a one-process build (chunk c
always covers the same rows, computed in the same batches), so whoever computes a chunk writes
the same bytes. Rank r of W records every chunk it finished in ``progress.rank<r>.json`` of the
``.partial`` folder, with the chunk's own statistics (counts, seconds), after flushing its
memmaps. A chunk is done when any rank's file records it; the chunks not done are dealt out
round-robin, ``todo[r::W]``. A killed run therefore resumes with any number of processes: a new
rank r keeps the records already in its file and adds its own, and statistics are summed over
chunk records, so totals do not depend on how the chunks were dealt.

``ShardedJob`` is the frame of such a build on one rank (``gnnlm.workdir.ranks.run_on_ranks`` runs
it on every rank): rank 0 sets up the partial folder, every rank writes its chunks, rank 0 merges
the records into the one manifest. With one rank it is the in-process build.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.utils.progress import track
from gnnlm.workdir.builder import RANK_PROGRESS, ArtifactBuilder
from gnnlm.workdir.manifests import is_complete, read_manifest, write_json_atomic
from gnnlm.workdir.ranks import Rank


def rank_file(partial: Path, rank: int) -> Path:
    return partial / RANK_PROGRESS.format(rank=rank)


def _read(path: Path, fingerprint: str) -> dict[str, dict]:
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}  # no file, or one cut short by a full disk: its chunks are done again
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        return {}
    return dict(state.get("chunks") or {})


def done_chunks(partial: Path, fingerprint: str) -> dict[int, dict]:
    """``{chunk: its statistics}`` of every chunk that any rank recorded."""
    done: dict[int, dict] = {}
    for path in sorted(partial.glob(RANK_PROGRESS.format(rank="*"))):
        for chunk, stats in _read(path, fingerprint).items():
            done.setdefault(int(chunk), stats)
    return done


def deal(n_chunks: int, done: dict[int, Any], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s share of the chunks not done yet (round-robin, in order)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}) (got {rank}).")
    todo = [c for c in range(n_chunks) if c not in done]
    return todo[rank::world]


def totals(done: dict[int, dict]) -> dict[str, float]:
    """Every statistic summed over the chunk records (ints stay ints)."""
    out: dict[str, float] = {}
    for stats in done.values():
        for name, value in stats.items():
            out[name] = out.get(name, 0) + value
    return out


class RankProgress:
    """The progress file of one rank: the chunks it finished, with their statistics."""

    def __init__(self, partial: Path, fingerprint: str, rank: int):
        self.path, self.fingerprint = rank_file(partial, rank), fingerprint
        self.chunks = _read(self.path, fingerprint)  # a former run's records under this rank

    def record(self, chunk: int, stats: dict) -> None:
        self.chunks[str(chunk)] = stats
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "chunks": self.chunks})


def rank_chunks(partial: Path, fingerprint: str, mine: list[int], rank: int, world: int,
                desc: str, flush: Callable[[], None], stop_after: Optional[int] = None
                ) -> Iterator[tuple[int, dict]]:
    """Yield ``(chunk, stats)`` for this rank's chunks; after the caller's body returns,
    ``flush()`` runs (arrays reach the files) and the chunk is recorded with ``stats`` (the body
    adds its counts; ``seconds`` is added here). ``stop_after`` stops after that many chunks of
    this rank in this run (used to test resumption)."""
    progress = RankProgress(partial, fingerprint, rank)
    label = desc if world == 1 else f"{desc} [rank {rank}/{world}]"
    for i in track(len(mine), label, stop_after=stop_after):
        t0 = time.perf_counter()
        stats: dict = {}
        yield mine[i], stats
        flush()
        progress.record(mine[i], {**stats, "seconds": round(time.perf_counter() - t0, 4)})


def flush_arrays(arrays: dict[str, np.ndarray]) -> None:
    for array in arrays.values():
        if isinstance(array, np.memmap):
            array.flush()


class ShardedJob:
    """One sharded build, run on every rank (it is pickled to spawned ranks: keep its fields
    plain data and models).

    Subclasses give ``n_chunks``, ``desc`` (the progress label), ``stop_after`` (chunks per
    rank in this run, None: all) and:

    - ``builder()``: the ``ArtifactBuilder`` (the same fingerprint on every rank);
    - ``setup(builder)``: create the arrays (rank 0 only, inside ``with builder``);
    - ``work(rank, chunks, arrays)``: compute each ``(chunk, stats)`` of ``chunks`` into the
      memmaps ``arrays``, adding the chunk's counts to ``stats``;
    - ``extra(rank, done, wall_seconds)``: the manifest's stage-specific facts (rank 0), from
      every chunk's record ``done``.

    Returns the manifest, or ``{}`` when the build stopped before every chunk was done.
    """
    stop_after: Optional[int]

    @property
    def n_chunks(self) -> int:
        raise NotImplementedError

    @property
    def desc(self) -> str:
        raise NotImplementedError

    def builder(self) -> ArtifactBuilder:
        raise NotImplementedError

    def setup(self, builder: ArtifactBuilder) -> None:
        raise NotImplementedError

    def work(self, rank: Rank, chunks: Iterator[tuple[int, dict]],
             arrays: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def extra(self, rank: Rank, done: dict[int, dict], wall_seconds: float) -> dict:
        raise NotImplementedError

    def __call__(self, rank: Rank) -> dict:
        t0 = time.perf_counter()
        builder = self.builder()
        if rank.rank == 0:
            with builder:  # clears a partial build of other settings, reopens one of these
                self.setup(builder)
        rank.barrier()
        arrays = builder.attach()
        done = done_chunks(builder.partial, builder.fingerprint)
        rank.barrier()  # every rank has read the records before any rank adds to them
        mine = deal(self.n_chunks, done, rank.rank, rank.world)
        self.work(rank, rank_chunks(builder.partial, builder.fingerprint, mine, rank.rank,
                                    rank.world, self.desc, lambda: flush_arrays(arrays),
                                    self.stop_after), arrays)
        flush_arrays(arrays)
        arrays.clear()  # rank 0 finishes (renames the folder) with no memmap of it open
        rank.barrier()
        manifest: dict = {}
        if rank.rank == 0:
            done = done_chunks(builder.partial, builder.fingerprint)
            if len(done) == self.n_chunks:
                manifest = builder.finish(
                    extra=self.extra(rank, done, round(time.perf_counter() - t0, 2)))
        rank.barrier()
        if rank.rank != 0 and is_complete(builder.path):
            manifest = read_manifest(builder.path)
        return manifest
