"""Stopping a run when told: SIGTERM (schedulers: SLURM, Kubernetes, ``timeout``) and SIGINT.

While a command runs (``handling_stop_signals``), either signal raises ``Stopped`` in the main
thread at the next Python bytecode: a Python loop stops at once, a Lightning loop at its next
batch, a faiss or torch call as soon as it returns (the chunked stages call them one chunk at a
time). The exception unwinds like any other: an artifact's chunk loop keeps the chunks it
recorded, ``with`` blocks release the work-directory lock, and the command exits with
``128 + signal`` (143 for SIGTERM, 130 for SIGINT) after one line naming the stage.

``Stopped`` is a ``BaseException`` and not a ``KeyboardInterrupt``: ``except Exception`` blocks
do not swallow it, and Lightning's ``_call_and_handle_interrupt`` re-raises it after its own
clean-up, where it would turn a ``KeyboardInterrupt`` into ``sys.exit(1)``. Lightning's own
SIGTERM handler (``_SignalConnector``) only sets a flag that ends the fit with a ``SystemExit``
of status 0; it calls the handler installed before it, so ours still raises.

A training step is not cut in half: between ``begin_deferring`` and ``end_deferring`` (a fit's
training outside validation, ``gnnlm.pipeline.training.stop_between_steps``) the signal is only
recorded, and the fit stops where a step ends (between two steps: the one just ended, or the
next), after saving the checkpoint it resumes from. A second signal stops at once.

Processes forked from the run inherit the handler; there a signal raises ``KeyboardInterrupt``.
A DataLoader worker exits quietly on it (the run itself stops and shuts the others down), but
torch gives each worker its own SIGTERM handler, which dies by a signal that did not come from
the worker's parent: after a signal sent to the whole process group (``timeout``, a terminal,
SLURM) the run's loader may then raise "DataLoader worker ... killed by signal" while the run
is stopping. The data modules' loaders put ours back (``worker_init``), and an
error raised after a stop signal (a loader whose workers it ended) stops the run as the signal
does (``errors_as_stop``). Processes spawned for sharded builds are terminated by the run
(``gnnlm.workdir.ranks``).
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """The run was told to stop by ``signum``; ``stage`` is where (the innermost timed stage
    it passed through, ``gnnlm.pipeline.stage_times.timed``), None until known; ``after``, for
    a stop between two stages, the last one that ended."""

    def __init__(self, signum: int, stage: Optional[str] = None):
        super().__init__(signum, stage)
        self.signum, self.stage = int(signum), stage
        self.after: Optional[str] = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's status of a process ended by the signal: 143 for SIGTERM, 130 for
        SIGINT."""
        return 128 + self.signum

    def __str__(self) -> str:
        where = (f" at {self.stage}" if self.stage else f" after {self.after}" if self.after
                 else "")
        return f"stopped by {self.signal_name}{where}"


class _State:
    """What the handler knows: the process that installed it, whether a fit's training holds
    the signal (``deferring``), the signal recorded then (``pending``), and the signal that
    stopped the run (``received``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.deferring = 0
        self.pending: Optional[int] = None
        self.received: Optional[int] = None


_state: Optional[_State] = None


def _handler(signum: int, frame: Any) -> None:
    state = _state
    if state is None:  # the run ended (handlers restored) between delivery and here
        return
    if os.getpid() != state.pid:  # a forked DataLoader worker: it exits, the run stops it
        raise KeyboardInterrupt
    if state.received is not None and state.pending is None:
        return  # already stopping: let the clean-up finish
    if state.deferring and state.pending is None:
        state.pending = signum  # end the training step first (``check_pending``)
        return
    state.received, state.pending = signum, None
    raise Stopped(signum)


@contextmanager
def handling_stop_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into ``Stopped`` for the duration of the block (in the main
    thread only: elsewhere Python cannot install handlers, and the block runs as it is); the
    former handlers are restored after it."""
    global _state
    if threading.current_thread() is not threading.main_thread() or _state is not None:
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _state = _State()
    try:
        for signum in SIGNALS:
            signal.signal(signum, _handler)
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _state = None


def worker_init(worker_id: int) -> None:
    """A DataLoader's ``worker_init_fn``: a stop signal ends the worker quietly whoever sent it
    (module docstring). With ``seed_everything(workers=True)`` it seeds the worker as the
    ``worker_init_fn`` Lightning adds to a loader without one would."""
    if _state is not None:  # forked from a run that handles stop signals
        signal.signal(signal.SIGTERM, _handler)
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning_fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id)


@contextmanager
def errors_as_stop() -> Iterator[None]:
    """An error raised in the block after a stop signal, re-raised as that stop (``Stopped``,
    the error its cause); any other error as it is. After the signal the run is ending anyway:
    what fails then (a loader whose workers the signal ended, Lightning's own SIGTERM exit) is
    part of stopping, and the run stops as the signal says: its stage times written, the
    stop's one line, 143."""
    try:
        yield
    except (Exception, SystemExit, KeyboardInterrupt) as err:
        signum = received()
        if signum is None:
            raise
        raise Stopped(signum) from err


def received() -> Optional[int]:
    """The signal that stopped this run, if one did (recorded or pending)."""
    if _state is None:
        return None
    return _state.received if _state.received is not None else _state.pending


def begin_deferring() -> None:
    """Start a block that a signal does not cut short (a fit's training, opened and closed in
    its callbacks): the signal is recorded, and ``check_pending`` after it raises it."""
    if _state is not None:
        _state.deferring += 1


def end_deferring() -> None:
    if _state is not None and _state.deferring > 0:
        _state.deferring -= 1


def pending() -> Optional[int]:
    """The signal recorded during a deferred block and not raised yet, if any."""
    return None if _state is None else _state.pending


def check_pending() -> None:
    """Raise ``Stopped`` for a signal recorded during a deferred block."""
    if _state is not None and _state.pending is not None and not _state.deferring:
        signum = _state.pending
        _state.received, _state.pending = signum, None
        raise Stopped(signum)
