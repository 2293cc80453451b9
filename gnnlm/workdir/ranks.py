"""Running one function on N processes ("ranks"), or in this process when N is 1.

Sharded builds (``datastore.build_features``, ``neighbors.build_neighbors``) hand a picklable
job to ``run_on_ranks``. With ``devices=1`` the job runs here, as a plain call; with N > 1 it runs
under Lightning Fabric on N processes: one per GPU on CUDA (NCCL), N CPU processes otherwise
(gloo). The ranks share nothing but the artifact's ``.partial`` folder and a few barriers: each
writes its own rows of the memmaps and its own progress file (``gnnlm.workdir.shards``), so the
process group carries no data.

Strategies: ``ddp_spawn`` (the default) starts fresh processes that run only the job, so a
caller such as the pipeline goes on in this process alone; ``ddp`` re-runs the calling script in
every rank (Lightning's launcher), which suits a script that is itself written for every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

# check_devices and Devices live with the other device settings; importable from here too
from gnnlm.utils.devices import Devices, check_device, check_devices, torch_device

STRATEGIES = ("ddp_spawn", "ddp")
T = TypeVar("T")


def resolve_devices(devices: Devices, device: str = "auto") -> tuple[int, str]:
    """``(number of processes, Lightning accelerator)`` for ``devices`` on ``device``.

    ``"auto"`` means every GPU when ``device`` resolves to CUDA and one process otherwise. Several
    processes on CUDA take GPUs 0..N-1, one each.
    """
    check_devices(devices)
    check_device(device)
    on = torch_device(device)
    if devices == "auto":
        count = torch.cuda.device_count() if on.type == "cuda" and on.index is None else 1
        return max(count, 1), on.type
    n = int(devices)
    if n > 1 and on.type == "cuda":
        if on.index is not None:
            raise ValueError(f"devices={n} runs one process on each of GPUs 0..{n - 1}; set "
                             f"device to 'cuda' or 'auto' (got {device!r}).")
        if n > torch.cuda.device_count():
            raise ValueError(f"devices={n} asks for one GPU per process, but torch sees "
                             f"{torch.cuda.device_count()} (got devices={n}).")
    return n, on.type


@dataclass
class Rank:
    """Where a process stands among the ranks: its index, their number, its torch device."""
    rank: int
    world: int
    device: torch.device
    fabric: Any = None

    def barrier(self) -> None:
        """Wait for every rank (a no-op in-process)."""
        if self.fabric is not None:
            self.fabric.barrier()


def _enter(fabric: Any, job: Callable[[Rank], T]) -> T:
    return job(Rank(fabric.global_rank, fabric.world_size, fabric.device, fabric))


def run_on_ranks(job: Callable[[Rank], T], devices: Devices = 1, device: str = "auto",
                 strategy: str = "ddp_spawn") -> T:
    """Run ``job(rank)`` on every rank and return rank 0's result.

    ``devices=1`` calls ``job`` here on ``device``; N > 1 launches N processes with Lightning
    Fabric (``job`` must then be picklable: a module-level class or function).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES} (got {strategy!r}).")
    n, accelerator = resolve_devices(devices, device)
    if n == 1:
        return job(Rank(0, 1, torch_device(device)))
    import multiprocessing

    from lightning_fabric import Fabric

    fabric = Fabric(accelerator=accelerator, devices=n, strategy=strategy)
    before = set(multiprocessing.active_children())
    try:
        return fabric.launch(partial(_enter, job=job))
    except BaseException:
        # a stop signal or a failure here: the ranks end too (at exit, Python would wait for
        # them to finish their whole share); each chunk they recorded stays done
        _terminate([p for p in multiprocessing.active_children() if p not in before])
        raise


def _terminate(processes: list, grace_seconds: float = 10.0) -> None:
    """SIGTERM each process, then SIGKILL those still running after ``grace_seconds``."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(grace_seconds)
        if process.is_alive():
            process.kill()
            process.join()
