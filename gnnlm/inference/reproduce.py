"""``gnnlm reproduce``: whether ``gnnlm.load`` on this machine gives a work directory's report,
the test split served through the routes a user takes, against the per-token scores the report
stored.

    gnnlm reproduce runs/wikitext2 [--rows ROW ...] [--decode ROW ...] [--positions N]
                    [--json OUT]

Every row's ``score`` of the test tokens the report scored is compared with the report's
``test_logprobs.npz``; for the ``--decode`` rows, ``next_token_logprobs`` of the first N
prefixes (within the base LM's first window, where a prefix's next-token distribution is the
split's score of that token) is compared with the same stored scores. ``gnnlm.load`` serves on
the CPU: a work directory built on the CPU gives the report's bits through ``score`` and the
float rounding of a prefix read alone through decoding (``tests/inference/test_inference.py``);
one built on a GPU differs by the two devices' sums, which this measures
(``scripts/gpu_check.sh --rehearsal`` runs it on the GPU machine).

It prints one line per row and writes the figures as JSON (``--json``); it writes nothing into
the work directory. Bad input (the work directory, a row, ``--positions``, the JSON's folder) is
refused in one line before any model is loaded.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gnnlm.inference.served import NotServed

DECODE_POSITIONS = 63


def gaps(served: np.ndarray, stored: np.ndarray) -> dict[str, Any]:
    """How far served log-probabilities are from stored ones (float64 differences)."""
    gap = np.abs(np.asarray(served, dtype=np.float64) - np.asarray(stored, dtype=np.float64))
    return {"equal": bool(np.array_equal(served, stored)), "max_abs": float(gap.max()),
            "mean_abs": float(gap.mean())}


def reproduce(workdir: str | Path, report: Optional[str] = None,
              rows: Optional[Sequence[str]] = None, decode: Sequence[str] = (),
              positions: int = DECODE_POSITIONS) -> dict[str, Any]:
    """The figures (see the module docstring): for each row, ``score``'s gap to the report's
    per-token test scores and its perplexity next to the report's; for each ``decode`` row,
    the gap of the first ``positions`` prefixes' next-token scores."""
    from gnnlm.inference.model import TrainedLM
    from gnnlm.workdir.manifests import open_array

    started = time.perf_counter()
    lm = TrainedLM(workdir, report)
    results = lm.served.results
    chosen = list(rows or lm.rows)
    for row in [*chosen, *decode]:
        lm.served.row(row)
    path = lm.served.path.parent / "test_logprobs.npz"
    if not path.is_file():
        raise NotServed(f"{path} is missing: the report's per-token test scores are what is "
                        f"reproduced; run `gnnlm pipeline` on {lm.workdir.root} to the end.")
    n = int(results["tokens"])
    ids = np.asarray(open_array(lm.workdir.tokens, "test")[:n], dtype=np.int64)
    with np.load(path) as stored:
        missing = [row for row in [*chosen, *decode] if row not in stored.files]
        if missing:
            raise NotServed(f"{path} holds no scores of {', '.join(missing)}: choose among "
                            f"{', '.join(stored.files)}.")
        stored_rows = {row: stored[row] for row in {*chosen, *decode}}
    scores = lm.score(ids, chosen)
    figures: dict[str, Any] = {
        "workdir": str(lm.workdir.root), "report": lm.served.name, "tokens": n,
        "built_on": (results.get("environment") or {}).get("device"), "served_on": "cpu",
        "rows": {row: {**gaps(scores[row].logprobs, stored_rows[row]), "ppl": scores[row].ppl,
                       "report_ppl": results["ppl"][row]} for row in chosen},
        "decoding": {}}
    last = min(positions, lm.context - 1, n - 1)
    for row in decode:
        served = [float(lm.next_token_logprobs(ids[:t], row)[ids[t]]) for t in range(1, last + 1)]
        figures["decoding"][row] = {"positions": last,
                                    **gaps(np.asarray(served, dtype=np.float32),
                                           stored_rows[row][1:last + 1])}
    figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def lines(figures: dict[str, Any]) -> list[str]:
    """The figures as the lines ``main`` prints."""
    out = [f"{figures['workdir']} (report {figures['report']}, built on {figures['built_on']}, "
           f"served on {figures['served_on']}): {figures['tokens']:,} test tokens"]
    for row, f in figures["rows"].items():
        out.append(f"  score    {row:<32} {'equal' if f['equal'] else 'differs'}: max |Δ log p| "
                   f"{f['max_abs']:.2e}, mean {f['mean_abs']:.2e}; ppl {f['ppl']:.4f} "
                   f"(report {f['report_ppl']:.4f})")
    for row, f in figures["decoding"].items():
        out.append(f"  decode   {row:<32} {f['positions']} prefixes: max |Δ log p| "
                   f"{f['max_abs']:.2e}, mean {f['mean_abs']:.2e}")
    out.append(f"  {figures['seconds']} s")
    return out


def main(args: Optional[list[str]] = None) -> dict[str, Any]:
    from gnnlm.inference.commands import Parser, check_served

    parser = Parser(prog="gnnlm reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="a work directory `gnnlm pipeline` built")
    parser.add_argument("--report", default=None,
                        help="which of its reports (needed when it holds several)")
    parser.add_argument("--rows", nargs="+", default=None,
                        help="rows to score (default: every row of the report)")
    parser.add_argument("--decode", nargs="+", default=[],
                        help="rows whose first prefixes are decoded (default: none)")
    parser.add_argument("--positions", type=int, default=DECODE_POSITIONS,
                        help=f"prefixes decoded per row (default {DECODE_POSITIONS})")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    namespace = parser.parse_args(args)
    if namespace.positions < 1:
        raise NotServed(f"--positions must be at least 1 (got {namespace.positions}).")
    if namespace.json and not Path(namespace.json).resolve().parent.is_dir():
        raise NotServed(f"--json {namespace.json}: its folder does not exist; create it or "
                        f"name a file in an existing folder.")
    check_served(namespace.workdir, namespace.report, [*(namespace.rows or []),
                                                       *namespace.decode])
    figures = reproduce(namespace.workdir, namespace.report, namespace.rows, namespace.decode,
                        namespace.positions)
    print("\n".join(lines(figures)))
    if namespace.json:
        from gnnlm.workdir.manifests import write_json_atomic

        write_json_atomic(namespace.json, figures)
    return figures
