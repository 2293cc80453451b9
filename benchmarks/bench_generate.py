"""Generation speed of each row against the base LM, and the memory each row's loading takes.

    python benchmarks/bench_generate.py --workdir runs/wikitext2-cpu --json out.json

For each row (default: base, knn, gnn, gnn+knn, those the work directory has) and batch size
(default 1 and 8), ``--repeats`` times: ``--prompt-tokens`` tokens of the test split as prompts
(other positions each time, so GNN-LM's window states meet windows it has not computed), read
into the row's incremental decoder, then ``--new-tokens`` greedy steps. The prompt is
long enough, with the new tokens, to pass the base LM's window (it slides). The time reported is
the median wall time of one step (each step gives one token to each of the batch's sequences)
and its ratio to the base LM's in the same run: the base LM decodes with its key/value cache,
kNN-LM adds one search per step, GNN-LM one context node reading its k windows.

Memory: for each row, a fresh process loads the work directory (``gnnlm.load``) and computes
one next-token distribution; its peak resident set size is reported.

The JSON holds ``records`` (``row``, ``batch``, ``ms_per_token``, ``base_ms_per_token``,
``ratio``, ``tokens_per_s``, ``prefill_ms``) and ``memory`` (``row``, ``peak_rss_mb``).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

import gnnlm
from gnnlm.inference.decoding import Decoder
from gnnlm.workdir.manifests import open_array


def prompts(lm, n: int, length: int, offset: int) -> torch.Tensor:
    """``n`` prompts of ``length`` test tokens, spread over the split from ``offset``."""
    test = np.asarray(open_array(lm.workdir.tokens, "test"), dtype=np.int64)
    starts = offset + np.arange(n) * ((len(test) - offset - length) // n)
    return torch.from_numpy(np.stack([test[s:s + length] for s in starts]))


@torch.no_grad()
def time_decoding(lm, row: str, tokens: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill seconds, median seconds per step) of greedy decoding."""
    served = lm.served.row(row)
    decoder = Decoder(lm, served, lm.settings(served), incremental=True)
    t0 = time.perf_counter()
    logprobs = decoder.start(tokens)
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logprobs = decoder.append(logprobs.argmax(-1)[:, None])
        times.append(time.perf_counter() - t0)
    return prefill, float(np.median(times))


def peak_rss(workdir: str, row: str) -> float:
    """Peak RSS (MB) of a fresh process that loads the work directory and scores one next
    token under ``row``."""
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's
    code = (f"import re, gnnlm; lm = gnnlm.load({workdir!r}); "
            f"lm.next_token_logprobs('the game was released in', {row!r}); "
            f"print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--rows", nargs="+", default=["base", "knn", "gnn", "gnn+knn"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the window slides: said once per load, not news here

    lm = gnnlm.load(args.workdir)
    rows = [r for r in args.rows if r in lm.rows]
    for row in rows:  # load every part before timing (index, heads)
        time_decoding(lm, row, prompts(lm, 1, args.prompt_tokens, 0), 2)
    records = []
    for batch in args.batches:
        per_row: dict[str, list[float]] = {row: [] for row in rows}
        prefill: dict[str, list[float]] = {row: [] for row in rows}
        for repeat in range(args.repeats):
            tokens = prompts(lm, batch, args.prompt_tokens, 1000 * (repeat + 1) + 37 * batch)
            for row in rows:
                first, step = time_decoding(lm, row, tokens, args.new_tokens)
                per_row[row].append(step)
                prefill[row].append(first)
        base = float(np.median(per_row["base"])) if "base" in per_row else float("nan")
        for row in rows:
            step = float(np.median(per_row[row]))
            records.append({"row": row, "batch": batch, "ms_per_token": 1000 * step,
                            "base_ms_per_token": 1000 * base, "ratio": step / base,
                            "tokens_per_s": batch / step,
                            "prefill_ms": 1000 * float(np.median(prefill[row]))})
    memory = [{"row": row, "peak_rss_mb": peak_rss(args.workdir, row)} for row in rows]
    print(f"{args.workdir}: prompts of {args.prompt_tokens} test tokens, {args.new_tokens} "
          f"greedy steps, median of {args.repeats}; torch threads {torch.get_num_threads()}")
    print(f"{'row':<10} {'batch':>5} {'ms/token':>9} {'vs base':>8} {'tok/s':>8} "
          f"{'prefill ms':>10}")
    for r in records:
        print(f"{r['row']:<10} {r['batch']:>5} {r['ms_per_token']:>9.2f} {r['ratio']:>7.2f}x "
              f"{r['tokens_per_s']:>8.0f} {r['prefill_ms']:>10.1f}")
    for m in memory:
        print(f"peak RSS, gnnlm.load + one distribution, {m['row']}: {m['peak_rss_mb']:.0f} MB")
    print(f"(this process, every row loaded: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workdir": args.workdir, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "repeats": args.repeats,
                       "records": records, "memory": memory}, f, indent=2)


if __name__ == "__main__":
    main()
