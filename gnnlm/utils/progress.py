"""Console output of long stages: a progress bar with rate and ETA, and one line per stage.

On a terminal the bar is tqdm's. Redirected to a file (``make demo > log``), tqdm's carriage
returns would make one unreadable line, so the same progress is written as plain lines, at most
one every ``GNNLM_PROGRESS_SECONDS`` (default 30) plus the last. ``GNNLM_QUIET=1`` silences both.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Optional


def quiet() -> bool:
    return os.environ.get("GNNLM_QUIET") == "1"


def say(message: str) -> None:
    """One line on stderr (the stage lines; stdout stays for tables and results)."""
    if not quiet():
        print(message, file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Counts ``total`` units of work; ``update(n)`` after each piece, ``close()`` at the end."""

    def __init__(self, total: int, desc: str, unit: str = "chunk", initial: int = 0):
        self.total, self.desc, self.unit = int(total), desc, unit
        self.done = self.start_done = self.printed = int(initial)
        self.t0 = self.last = time.perf_counter()
        self.every = float(os.environ.get("GNNLM_PROGRESS_SECONDS", 30))
        self.bar = None
        if not quiet() and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=desc, unit=unit,
                            leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if not quiet() and (now - self.last >= self.every):
            self.last, self.printed = now, self.done
            say(f"  {self.line()}")

    def line(self) -> str:
        """``desc: done/total units, rate, elapsed, ETA``; without a total (``total`` < 1, not
        known) or once past it, the count alone and no ETA: never ``5/-1`` or ``7/6``."""
        elapsed = time.perf_counter() - self.t0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        rate_part = f"{rate:.2f} {self.unit}/s, {format_seconds(elapsed)} elapsed"
        if not 0 < self.total or self.done > self.total:
            return f"{self.desc}: {self.done} {self.unit}s, {rate_part}"
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = format_seconds(left) if left == left else "?"
        return f"{self.desc}: {self.done}/{self.total} {self.unit}s, {rate_part}, ETA {eta}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done > self.printed:  # a log always ends with the totals
            say(f"  {self.line()}")


def track(total: int, desc: str, initial: int = 0, unit: str = "chunk",
          stop_after: Optional[int] = None) -> Iterator[int]:
    """Yield ``initial … total - 1`` with progress; stop early after ``stop_after`` items."""
    bar = Progress(total, desc, unit, initial)
    try:
        for i in range(initial, total):
            if stop_after is not None and i - initial >= stop_after:
                return
            yield i
            bar.update(1)
    finally:
        bar.close()
