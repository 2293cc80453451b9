"""Where work runs: ``"auto"`` means CUDA when torch sees a GPU (faiss: when faiss-gpu does).

The checks of a setting's spelling (``check_device``, ``check_devices``) need neither torch nor
faiss, so a config is checked without them: torch and faiss are imported by the functions that
ask the machine.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
CUDA_ACCELERATORS = ("gpu", "cuda")  # Lightning's two names for a CUDA trainer
Devices = Union[int, str]  # a number of processes, or "auto"


def check_device(device: str) -> None:
    if device not in DEVICES and not re.fullmatch(r"cuda:\d+", str(device)):
        raise ValueError(f"device must be one of {DEVICES} or 'cuda:<n>' (got {device!r}).")


def check_devices(devices: Devices, where: str = "devices") -> None:
    """``devices`` is a process count >= 1 or ``"auto"``."""
    if devices == "auto":
        return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"{where} must be a number of processes >= 1 or 'auto' "
                         f"(got {devices!r}).")


def check_available(device: str, setting: str) -> None:
    """Refuse a CUDA ``device`` that torch cannot use on this machine, naming ``setting``: a
    config is checked when it loads, so the run stops before its first stage rather than with
    torch's own message after hours of work. By availability, not by name: a GPU machine
    accepts the same config."""
    import torch

    check_device(device)
    if not str(device).startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    suffix = str(device).partition(":")[2]
    number = int(suffix) if suffix.isdigit() else 0
    if number < count:
        return
    needs = f"CUDA GPU {number}" if ":" in str(device) else "a CUDA GPU"
    seen = "no GPU" if count == 0 else f"{count} GPU{'s' if count > 1 else ''}"
    raise ValueError(f"{setting} = {device!r} needs {needs}, but torch sees {seen} on this "
                     f"machine: set {setting}: auto (a GPU when there is one) or cpu.")


def check_faiss_available(device: str, setting: str) -> None:
    """Refuse ``device='cuda'`` for faiss when this faiss has no GPU (see ``faiss_device``)
    when the config loads, naming ``setting``."""
    check_device(device)
    if device != "auto" and device != "cpu" and not faiss_has_gpu():
        raise ValueError(f"{setting} = {device!r} needs faiss-gpu and a GPU, but this faiss has "
                         f"no GPU support or sees no GPU: set {setting}: auto (the GPU when "
                         f"faiss has one) or cpu, or install the `gpu` extra (faiss-gpu, after "
                         f"uninstalling faiss-cpu).")


def check_accelerator(accelerator: object, where: str) -> None:
    """Refuse a Lightning trainer that asks for CUDA (``trainer.accelerator: gpu`` or ``cuda``,
    as configs/trainer/gpu.yaml does) on a machine without it; ``where`` names the config."""
    import torch

    if str(accelerator).lower() in CUDA_ACCELERATORS and not torch.cuda.is_available():
        raise ValueError(f"{where} sets trainer.accelerator: {accelerator}, but torch sees no "
                         f"CUDA GPU on this machine: start that chain with "
                         f"configs/trainer/cpu.yaml instead of configs/trainer/gpu.yaml (with "
                         f"the model's *_cpu.yaml overlay, as pipeline_cpu.yaml does), or set "
                         f"trainer.accelerator: auto.")


def trainer_processes(trainer: dict) -> Optional[int]:
    """How many processes Lightning trains on under a ``gnnlm fit`` config's ``trainer``
    section: ``devices`` as Lightning parses them (``"auto"``: every GPU torch sees, or one CPU
    process) times ``num_nodes``; None for an accelerator other than the CPU or CUDA, whose
    devices are Lightning's to count. A ``devices`` value Lightning refuses raises its message
    as a ValueError."""
    import torch
    from pytorch_lightning.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    accelerator = str(trainer.get("accelerator") or "auto").lower()
    if accelerator in CUDA_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available()):
        kind: type[Accelerator] = CUDAAccelerator
    elif accelerator in ("cpu", "auto"):
        kind = CPUAccelerator
    else:
        return None
    devices = trainer.get("devices", "auto")
    try:
        parsed = kind.auto_device_count() if devices == "auto" else kind.parse_devices(devices)
    except (MisconfigurationException, TypeError) as error:  # (the CPU count raises TypeError)
        raise ValueError(str(error)) from None
    count = len(parsed) if isinstance(parsed, list) else int(parsed or 0)
    if count < 1:  # (CUDA's parser reads 0 as no GPU; Lightning's trainer refuses it)
        raise ValueError(f"devices={devices!r} selects no {accelerator} device.")
    return count * int(trainer.get("num_nodes") or 1)


def torch_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device for ``device`` (``"auto"``: the first GPU when there is one)."""
    import torch

    if isinstance(device, torch.device):
        return device
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two torch devices are one: an unnumbered ``cuda`` (``torch_device("auto")``'s) is
    the current GPU, where torch places a tensor sent there (torch compares ``cuda`` and
    ``cuda:0`` as different devices)."""
    import torch

    def numbered(device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    return numbered(a) == numbered(b)


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free on a CUDA device (None elsewhere: no limit is checked): what the driver has
    free, and what torch's caching allocator holds unused, which it hands out first (a window
    table or a score buffer just released stays reserved: the driver counts it as taken)."""
    import torch

    if device.type != "cuda":
        return None
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def release_unreachable() -> None:
    """Free what a finished stage left unreachable now, not when Python's collector next runs:
    a trained part's trainer and modules refer to each other (reference cycles), and on a GPU
    their tensors (GNN-LM's window-state table: 25.7 GB at the paper's shape) hold memory the
    next stage needs. The caching allocator's free blocks go back to the driver too, so the
    next stage's large buffers are not cut out of blocks sized for the last one's."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def resident_room(device: torch.device) -> Optional[int]:
    """Bytes that may stay resident on ``device``: half a GPU's free memory, the other half
    being left to the work that reads them (score blocks, activations); None elsewhere, a host
    keeping its arrays where they are."""
    free = free_memory(device)
    return None if free is None else free // 2


def why_not_resident(device: torch.device, nbytes: int) -> Optional[str]:
    """Why ``nbytes`` may not stay resident on ``device`` ("do not fit in half of cuda:0's free
    memory (3.1 GiB)"), or None when they may (``resident_room``)."""
    room = resident_room(device)
    if room is None or nbytes <= room:
        return None
    return f"do not fit in half of {device}'s free memory ({2 * room / 2**30:.1f} GiB)"


def pin_memory() -> bool:
    """Whether DataLoaders pin their batches: when torch sees a CUDA GPU to copy them to (the
    copies then overlap the step); a CPU run copies nothing."""
    import torch

    return torch.cuda.is_available()


def faiss_has_gpu() -> bool:
    import faiss

    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def faiss_device(device: str = "auto") -> str:
    """``"cuda"`` when faiss-gpu is installed and sees a GPU (for ``auto`` or ``cuda``)."""
    check_device(device)
    if device == "cpu":
        return "cpu"
    if faiss_has_gpu():
        return "cuda"
    if device != "auto":
        raise ValueError(f"device={device!r} asks for faiss-gpu, but this faiss has no GPU "
                         f"support or sees no GPU. Install the `gpu` extra (faiss-gpu, after "
                         f"uninstalling faiss-cpu), use device='auto', or search with the exact "
                         f"torch backend (neighbors.backend: exact), which runs on CUDA.")
    return "cpu"
