"""What a run ran on: the device, the CPU's kernel path and the versions of the stack, recorded
beside every result.

``describe()`` is what ``results.json`` and ``stage_times.json`` record under ``environment``;
``python -m gnnlm.utils.environment --require faiss,jsonargparse`` prints it as one line, or one
line naming the missing packages and exits 1 (the check ``scripts/gpu_table.sh`` starts with, so
a machine without a package stops before its first stage, not an hour in).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
from typing import Optional

from gnnlm.utils import cpu_kernels

# the import name of each package a run reads, and its distribution name (for its version);
# torch is named by its own version string instead (``describe``)
STACK = {"torch_geometric": "torch-geometric",
         "pytorch_lightning": "pytorch-lightning", "faiss": ("faiss-cpu", "faiss-gpu"),
         "transformers": "transformers", "numpy": "numpy", "jsonargparse": "jsonargparse"}


def version(distributions) -> Optional[str]:
    """The installed version of the first of ``distributions`` that is installed, else None."""
    for name in (distributions,) if isinstance(distributions, str) else distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux) and how many cores run here."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({cores} cores)"


def describe() -> dict:
    """The device a run's tensors lived on (the GPU's name, else the CPU's), its GPU count, and
    the Python, CUDA and package versions. Asking torch for the GPU's name starts CUDA: call this
    once the run has used the GPU, or where starting it costs nothing (never before forking
    workers that must not inherit a CUDA context)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {"device": torch.cuda.get_device_name(0) if gpus else "cpu",
           "gpus": gpus, "cpu": cpu_name(),
           "python": platform.python_version(),
           "cuda": torch.version.cuda if gpus else None,
           # torch's own string names its build (2.11.0+cu130, 2.13.0+cpu), where the metadata
           # of a CUDA wheel from PyPI says only 2.11.0: not which CUDA the kernels came from
           "torch": str(torch.__version__)}
    env.update({module: version(dist) for module, dist in STACK.items()})
    # two CPUs of one name run other kernels when their vector instructions differ
    env["cpu_kernels"] = cpu_kernels.describe()
    return env


def one_line(env: dict) -> str:
    """``describe()`` as the line results.md and the logs show."""
    device = (f"CPU {env['cpu']}" if env["device"] == "cpu"
              else f"{env['gpus']} × {env['device']}, CPU {env['cpu']}")
    if env.get("cpu_kernels"):  # absent from records written before it was kept
        device += f", {cpu_kernels.one_line(env['cpu_kernels'])}"
    cuda = f" (CUDA {env['cuda']})" if env.get("cuda") else ""
    packages = ", ".join(f"{name} {env[name]}" for name in
                         ("torch_geometric", "pytorch_lightning", "faiss", "transformers")
                         if env.get(name))
    return (f"{device}; Python {env['python']}, torch {env['torch']}{cuda}, "
            f"{packages}")


def missing(modules: list[str]) -> list[str]:
    """Those of ``modules`` that do not import here."""
    absent = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            absent.append(module)
    return absent


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gnnlm.utils.environment",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--require", default="",
                        help="comma-separated modules that must import, e.g. faiss,jsonargparse")
    args = parser.parse_args(argv)
    absent = missing([m for m in args.require.split(",") if m])
    if absent:
        print(f"missing Python packages: {', '.join(absent)}; install them (offline: put their "
              f"wheels in the wheel folder, see scripts/gpu_table.sh) and run again.",
              file=sys.stderr)
        return 1
    print(one_line(describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
