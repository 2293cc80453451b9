"""What pinning the CPU kernels to AVX2 costs: the demo's work, timed under each pin.

    python benchmarks/bench_cpu_pins.py --json out.json
    python benchmarks/bench_cpu_pins.py --steps 5 --repeats 1       # a quick look

Each library that picks its kernels by the CPU's vector instructions can be held to its AVX2
path by a variable (``gnnlm.utils.cpu_kernels.PINS``), so that a CPU with AVX-512 runs the
kernels an AVX2-only CPU runs; on a CPU with AVX-512 that may cost time. For each pin alone, all
of them, and none, a fresh process (each library reads its variable when it starts) times:

- ``train``: training steps of the demo's base LM (4 layers, width 128, context 128, the
  33,278-word softmax; 32 × 128 tokens, AdamW), the demo's longest stage per token;
- ``encode``: the same model's forward over 64 windows of 128 tokens under ``no_grad``
  (the features stage);
- ``search``: faiss IVF-SQ8 search of 4,096 queries among 200k random 128-wide keys, nprobe 4,
  k = 128 (the neighbours stage's index search; its re-ranking is the ``encode`` kind of work).

Each row gives the median seconds of ``--repeats`` measurements and its ratio to the unpinned
row. On a CPU without AVX-512 every row runs the same kernels: the ratios are 1 within noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from gnnlm.utils.cpu_kernels import PINS

# each library's AVX2 path
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2",
        "FAISS_SIMD_LEVEL": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}
assert set(AVX2) == set(PINS)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel choices
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(steps: int, repeats: int) -> dict:
    """The three timings in this process, with whatever pins its environment holds."""
    import faiss
    import numpy as np
    import torch
    from torch.nn import functional as F

    from gnnlm.models.gpt import GPT, GPTConfig
    from gnnlm.utils.cpu_kernels import describe

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=33278, context_length=128, n_layer=4, n_head=4, d_model=128,
                          d_ff=512, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 33278, (32, 129))

    def train() -> None:
        for _ in range(steps):
            logits = model.logits(model(tokens[:, :-1]).final)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    windows = torch.randint(0, 33278, (64, 128))

    def encode() -> None:
        with torch.no_grad():
            model(windows)

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((200_000, 128), dtype=np.float32)
    index = faiss.index_factory(128, "IVF1024,SQ8")
    index.train(keys[:50_000])
    index.add(keys)
    index.nprobe = 4
    queries = rng.standard_normal((4096, 128), dtype=np.float32)
    return {"train_step_s": median_seconds(train, repeats) / steps,
            "encode_s": median_seconds(encode, repeats),
            "search_s": median_seconds(lambda: index.search(queries, 128), repeats),
            "kernels": describe()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.repeats)))
        return
    unpinned = {k: v for k, v in os.environ.items() if k not in PINS}
    settings = {"none": {}, **{name: {name: AVX2[name]} for name in PINS}, "all": AVX2}
    rows = []
    for label, pins in settings.items():
        ran = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps),
                              "--repeats", str(args.repeats)], env={**unpinned, **pins},
                             capture_output=True, text=True, check=True)
        rows.append({"pins": label, **json.loads(ran.stdout.splitlines()[-1])})
    base = rows[0]
    print(f"CPU kernels unpinned: {base['kernels']['torch_capability']}, "
          f"ISA {' '.join(base['kernels']['isa'])}; {base['kernels']['threads']} threads")
    print(f"{'pins':<22}{'train step':>12}{'ratio':>7}{'encode':>12}{'ratio':>7}"
          f"{'search':>12}{'ratio':>7}")
    for row in rows:
        print(f"{row['pins']:<22}"
              + "".join(f"{row[key]:>11.3f}s{row[key] / base[key]:>7.2f}"
                        for key in ("train_step_s", "encode_s", "search_s")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
