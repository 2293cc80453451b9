"""What decides which CPU kernels a run ran, and so the last bits of its numbers.

torch (ATen's vectorised kernels, oneDNN, MKL) and faiss (its own SIMD code and OpenBLAS) each
pick their kernels by the CPU's vector instructions: on a CPU with AVX-512 they run AVX-512
kernels, which add floats in another order than the AVX2 ones, so a model trained for hundreds
of steps ends with other weights and a table a few tenths of a percent apart, although the CPU's
name, the core count and every version are the same. ``describe()`` records the facts that decide
it (``results.json`` and ``stage_times.json`` keep it under ``environment.cpu_kernels``), with
any of the variables in ``PINS`` that chose a path by hand. Pinning all of them to AVX2 (as
``make demo`` does on a CPU with AVX2) gave an AVX-512 CPU the WikiText-2 demo's base-LM weights
an AVX2-only CPU had, to the bit, and its printed table; two tables whose records differ here
are a few tenths of a percent apart, not equal.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

# the environment variables that pin each library's kernels, each read when its library starts
PINS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "FAISS_SIMD_LEVEL",
        "OPENBLAS_CORETYPE")
# the vector-instruction flags of /proc/cpuinfo that change which kernels run
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def isa_flags() -> list[str]:
    """Those of ``ISA_FLAGS`` the CPU has (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ISA_FLAGS if flag in flags]


def _library_version(config: str, pattern: str) -> Optional[str]:
    match = re.search(pattern, config)
    return match.group(1) if match else None


def describe() -> dict:
    """The kernel path torch runs (``get_cpu_capability``: DEFAULT, AVX2, AVX512, ...), the ISA
    flags, the BLAS and oneDNN builds, the thread counts, faiss's SIMD level when faiss is
    loaded, and every pinning variable that is set."""
    import torch

    config = torch.__config__.show()
    kernels: dict[str, object] = {
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": isa_flags(),
        "blas": _library_version(config, r"BLAS_INFO=(\w+)"),
        "mkl": _library_version(config, r"Math Kernel Library Version ([\w.]+)"),
        "onednn": _library_version(config, r"MKL-DNN v([\w.]+)"),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }
    faiss = sys.modules.get("faiss")  # only when the run loaded it: importing it costs a second
    if faiss is not None and hasattr(faiss, "SIMDConfig"):
        kernels["faiss_simd"] = faiss.SIMDConfig.get_level_name()
    kernels["pinned"] = {name: os.environ[name] for name in PINS if os.environ.get(name)}
    return kernels


def one_line(kernels: dict) -> str:
    """The kernel path as results.md shows it, e.g. ``AVX2 kernels (pinned), 2 threads``."""
    pinned = " (pinned)" if kernels.get("pinned") else ""
    return (f"{kernels.get('torch_capability', '?')} kernels{pinned}, "
            f"{kernels.get('threads', '?')} threads")
