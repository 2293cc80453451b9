"""Builds features or neighbours of a WikiText-2 slice in a work directory, on any number of
processes: the multi-process half of tests/workdir/test_shards.py.

DDP inside pytest would start the ranks from pytest's own entry point, so the tests run this
file as its own Python process (with a timeout)::

    python tests/sharded_build.py features WORKDIR TOKENS --devices 2 [--stop-after 1]
                                  [--max-tokens N]
    python tests/sharded_build.py neighbors WORKDIR TOKENS --devices 2 [--stop-after 1]

It prints the manifest (or ``{}`` when stopped early) as JSON on its last line. The base LM,
the slice and the build settings are those of ``sharded_setup`` (also used by the tests'
one-process builds), so both sides build the very same artifact.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sharded_setup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("features", "neighbors"))
    parser.add_argument("workdir")
    parser.add_argument("tokens")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=sharded_setup.TRAIN_TOKENS)
    args = parser.parse_args()
    if args.stage == "features":
        manifest = sharded_setup.features(Path(args.workdir), Path(args.tokens), args.devices,
                                          args.stop_after, max_tokens=args.max_tokens)
    else:
        manifest = sharded_setup.neighbors(Path(args.workdir), args.devices, args.stop_after)
    print(json.dumps(manifest, default=str))


if __name__ == "__main__":
    main()
