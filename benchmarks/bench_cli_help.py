"""How long ``gnnlm COMMAND --help`` takes, each in a fresh interpreter, against the target of one
second: the help of every command comes from light modules (``gnnlm.pipeline.arguments`` for the
commands that read a pipeline config), never from torch, faiss or transformers.

    python benchmarks/bench_cli_help.py [--repeats 5] [--json out.json] [--repo CHECKOUT]

For each command line, the median over ``--repeats`` runs of the wall time and of the CPU time
(user + system) of ``python -m gnnlm.cli ...``; on a busy machine the wall time exceeds the CPU
time by the time spent waiting for a core, so the CPU time is the one to compare across loads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
COMMAND_LINES = [["--help"], ["pipeline", "--help"], ["pipeline", "--help=knn"],
                 ["sweep", "--help"], ["explain", "--help"], ["score", "--help"],
                 ["generate", "--help"], ["verify", "--help"]]


def timed(args: list[str], repo: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``gnnlm`` run in a fresh interpreter, with ``repo``'s code
    (``python -m`` puts the current directory first on the path)."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gnnlm.cli", *args], cwd=repo, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = os.times()
    return wall, (after.children_user - before.children_user
                  + after.children_system - before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout whose gnnlm is timed (another commit's, to compare)")
    args = parser.parse_args()
    rows = []
    for line in COMMAND_LINES:
        runs = [timed(line, args.repo) for _ in range(args.repeats)]
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rows.append({"command": " ".join(["gnnlm", *line]), "wall_s": wall, "cpu_s": cpu})
        print(f"{rows[-1]['command']:<28} wall {wall:5.2f} s  CPU {cpu:5.2f} s"
              f"{'' if wall < TARGET_S else f'  (over the {TARGET_S:g} s target)'}")
    if args.json:
        args.json.write_text(json.dumps({"target_s": TARGET_S, "repeats": args.repeats,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
