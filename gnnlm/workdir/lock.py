"""One run per work directory: a lock on ``<workdir>/.lock``.

Two runs writing the same artifacts would both do every stage, then trip over each other's
temporary files. ``gnnlm pipeline`` therefore takes the lock exclusively; ``gnnlm sweep`` takes
it exclusively too, except for a point a W&B agent pins (its own folder): agents then share it
and run side by side, and a pipeline (which may rebuild the caches they read) is refused while
any of them runs. A run that cannot have the lock stops at once, naming the holder.

The lock is ``fcntl.flock``: the kernel releases it when its process ends, however it ends, so a
lock is never left held by a dead run. The file records the exclusive holder (process id, host,
start time, command) for the refusal message and is emptied on a clean release: a record found
by the next run means its holder died holding it, which that run says in one line as it takes
over. A process the holder started (a DDP rank that Lightning launches by running the same
command again) works under its parent's lock. Where a filesystem refuses ``flock`` (some
network mounts), the record decides: a process on this host that is still alive
(``os.kill(pid, 0)``) keeps it.
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Optional

from gnnlm.utils.progress import say

LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
    """Another run holds the work directory."""


class WorkdirLock:
    """The lock on one work directory, held until ``release`` or until this object is dropped
    (the end of the run that took it) or the process ends."""

    def __init__(self, path: Path, fd: int, shared: bool):
        self.path, self.fd, self.shared = path, fd, shared
        self.pid = os.getpid()

    def release(self) -> None:
        if self.fd < 0 or os.getpid() != self.pid:
            return  # a forked child shares the parent's lock: only the parent lets it go
        if not self.shared:  # a clean end: no record of a holder left behind
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        _held.pop(str(self.path), None)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter exit: the kernel releases the lock anyway
            pass

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# The locks this process holds, by lock file: a run inside a run (a stage that calls another
# command's code) shares its caller's lock rather than being refused by it.
_held: weakref.WeakValueDictionary[str, WorkdirLock] = weakref.WeakValueDictionary()


def _record(fd: int) -> dict:
    """The holder's record, {} when empty or unreadable (being written, or a clean release)."""
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        record = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _alive(record: dict) -> bool:
    """Whether the recorded holder runs on this host and is alive (False when unknown)."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder(record: dict) -> str:
    if not record:
        return "another process (it has not recorded itself yet)"
    return (f"gnnlm {record.get('command', '?')}, process {record.get('pid', '?')} on "
            f"{record.get('host', '?')}, started {record.get('started', '?')}")


def lock_workdir(root: str | os.PathLike, command: str, shared: bool = False) -> WorkdirLock:
    """Take the lock of the work directory ``root`` for ``command`` (``shared``: alongside other
    shared holders), or raise ``WorkdirBusy`` naming its holder. Keep the returned object for as
    long as the run writes into ``root``."""
    Path(root).mkdir(parents=True, exist_ok=True)
    path = Path(root) / LOCK_FILE
    held = _held.get(str(path))
    if held is not None and held.fd >= 0 and (shared or not held.shared):
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        record = _take(fd, path, shared)
    except BaseException:
        os.close(fd)
        raise
    if record is None:  # a process the holder started: it works under its parent's lock
        return WorkdirLock(path, fd, shared=True)
    if record and not shared:
        say(f"[gnnlm] took over the lock of {Path(root)} left by {_holder(record)}, which ended "
            f"without releasing it")
    if not shared:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}).encode(),
            0)
        os.fsync(fd)
    lock = WorkdirLock(path, fd, shared)
    _held[str(path)] = lock
    return lock


def _take(fd: int, path: Path, shared: bool) -> Optional[dict]:
    """Lock ``fd`` without waiting; the record of a holder that died holding it, if any, or
    None in a process that the holder started (a DDP rank Lightning launches by running the
    same command again)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _record(fd)
        if record.get("pid") == os.getppid() and record.get("host") == socket.gethostname():
            return None
        raise WorkdirBusy(_refusal(fd, path)) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        record = _record(fd)  # no flock on this filesystem: the record decides
        if _alive(record) and record.get("pid") != os.getpid():
            raise WorkdirBusy(_refusal(fd, path)) from None
        return record
    return _record(fd)


def _refusal(fd: int, path: Path) -> str:
    record: dict = {}
    for _ in range(20):  # the holder may have taken the lock a moment ago and be writing
        if _shared_only(path):
            return (f"The work directory {path.parent} is in use by `gnnlm sweep` runs reading "
                    f"it: wait for them to finish, or use another work directory.")
        record = _record(fd)
        if record:
            break
        time.sleep(0.05)
    return (f"The work directory {path.parent} is in use by another run ({_holder(record)}): "
            f"wait for it to finish, or use another work directory.")


def _shared_only(path: Path) -> bool:
    """Whether the holders share the lock (a shared request succeeds): W&B sweep agents."""
    other = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(other)  # closing releases the probe's shared lock
    return True
