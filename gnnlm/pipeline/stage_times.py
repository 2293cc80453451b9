"""The wall time of every stage of one ``gnnlm pipeline`` run: ``reports/<name>/stage_times.json``.

``results.json``'s ``timing_s`` holds what each artifact's build took, whenever it was built, and
so stays the same on a rerun; this file is the run itself: every stage it went through, built or
found complete (then it only checks its files), scoring included, and the machine it ran on.

    times = StageTimes()
    with times.running():          # stages timed inside are recorded here
        with timed("features"):    # anywhere below, without passing the clock around
            ...
    times.write(report_folder)
"""
from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Optional

from gnnlm.utils.progress import format_seconds, say
from gnnlm.utils.provenance import code_version
from gnnlm.utils.stopping import Stopped, errors_as_stop
from gnnlm.workdir.manifests import write_json_atomic


class StageTimes:
    """The stages of one run in the order they ended, each with its wall seconds."""

    def __init__(self) -> None:
        self.started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.t0 = time.perf_counter()
        self.stages: list[dict] = []

    @contextmanager
    def running(self) -> Iterator[StageTimes]:
        token = _RUNNING.set(self)
        try:
            with errors_as_stop():
                yield self
        except Stopped as stop:  # between two stages (scoring what one built): after which
            if stop.stage is None and self.stages:
                stop.after = self.stages[-1]["stage"]
            raise
        finally:
            _RUNNING.reset(token)

    def add(self, stage: str, seconds: float) -> None:
        self.stages.append({"stage": stage, "seconds": round(seconds, 2)})
        say(f"[gnnlm] stage {stage}: {format_seconds(seconds)}")

    def as_dict(self, environment: Optional[dict] = None, stopped: Optional[str] = None
                ) -> dict:
        record = {"started": self.started,
                  "total_seconds": round(time.perf_counter() - self.t0, 2),
                  "stages": self.stages, "environment": environment, "made_by": code_version()}
        if stopped is not None:  # the run ended early: the stages it finished, and where
            record["stopped"] = stopped
        return record

    def write(self, folder: Path, environment: Optional[dict] = None,
              stopped: Optional[str] = None) -> dict:
        """``folder/stage_times.json`` (written whole, atomically; ``stopped``: why and where a
        run that did not finish ended); returns what it wrote."""
        record = self.as_dict(environment, stopped)
        Path(folder).mkdir(parents=True, exist_ok=True)  # a run stopped before its report
        write_json_atomic(Path(folder) / "stage_times.json", record)
        return record


# the run being timed, if any: ``timed`` records into it from anywhere below ``running()``
_RUNNING: ContextVar[Optional[StageTimes]] = ContextVar("stage_times", default=None)


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Record the wall time of the block as ``stage`` in the run's ``StageTimes``, if a run is
    being timed (a stage called on its own, by a test or another command, records nothing).
    A block that raises records nothing: the run stops there. A run stopped by a signal
    (``gnnlm.utils.stopping.Stopped``, or an error raised after the signal) learns here the
    stage it stopped at: the innermost."""
    times = _RUNNING.get()
    t0 = time.perf_counter()
    try:
        with errors_as_stop():
            yield
    except Stopped as stop:
        stop.stage = stop.stage or stage
        raise
    if times is not None:
        times.add(stage, time.perf_counter() - t0)
