"""GNN-LM's graph and layer options compared by validation perplexity, on a pipeline's work
directory (after `make demo`), each variant trained the same way from the same seed.

    python benchmarks/compare_gnn_topology.py --workdir runs/wikitext2-cpu
    python benchmarks/compare_gnn_topology.py --workdir runs/wikitext2-cpu --train-tokens 50000

Variants (GNN-LM §2.2-2.3 against the reference implementation, ShannonAI/GNN-LM):

- the paper: every window node has an inter edge to its token, edge types summed, no norm;
- inter edges from the retrieved token only (the window reaches the context through it);
- edge types averaged instead of summed;
- a LayerNorm after each layer (post-norm);
- the reference: all three.

Each is ``gnnlm fit`` with the demo's GNN-LM configs plus the variant's settings, trained on the
same train prefix and validated on the whole valid split (``--trainer.limit_val_batches=1.0``);
the table gives valid perplexity and its change against the paper's layer.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gnnlm.lit.cli import lightning_main

CHAIN = ["configs/trainer/cpu.yaml", "configs/wikitext2/gnnlm.yaml",
         "configs/wikitext2/gnnlm_cpu.yaml"]
VARIANTS = {
    "paper: window inter edges, sum, no norm": [],
    "inter edges from the retrieved token only": ["--data.init_args.graph.inter=retrieved"],
    "edge types averaged": ["--model.init_args.edge_aggr=mean"],
    "post-norm after each layer": ["--model.init_args.norm=post"],
    "reference: retrieved, mean, post-norm": ["--data.init_args.graph.inter=retrieved",
                                              "--model.init_args.edge_aggr=mean",
                                              "--model.init_args.norm=post"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/wikitext2-cpu")
    parser.add_argument("--train-tokens", type=int, default=None,
                        help="train prefix (default: the config's)")
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            root = Path(tmp) / str(len(rows))
            extra = [f"--data.init_args.train_tokens={args.train_tokens}"] \
                if args.train_tokens else []
            t0 = time.perf_counter()
            cli = lightning_main(["fit", *(a for c in CHAIN for a in ("-c", c)), *flags, *extra,
                                  f"--data.init_args.workdir={args.workdir}",
                                  "--trainer.limit_val_batches=0",  # one validation, below
                                  "--trainer.enable_progress_bar=false",
                                  f"--trainer.default_root_dir={root}"])
            cli.trainer.limit_val_batches = 1.0
            (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule,
                                              verbose=False)
            rows.append((name, float(metrics["val/ppl"]), time.perf_counter() - t0))
            print(f"{name}: valid ppl {rows[-1][1]:.2f} ({rows[-1][2]:.0f} s)", flush=True)
    base = rows[0][1]
    print("\n| variant | valid ppl | vs the paper's layer | train + validation s |\n"
          "|---|---:|---:|---:|")
    for name, ppl, seconds in rows:
        print(f"| {name} | {ppl:.2f} | {100 * (ppl - base) / base:+.1f}% | {seconds:.0f} |")


if __name__ == "__main__":
    main()
