"""Where work runs: ``"auto"`` means CUDA when torch sees a GPU (faiss: when faiss-gpu does)."""
from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str) -> None:
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be one of {DEVICES} or 'cuda:<n>' (got {device!r}).")


def torch_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device for ``device`` (``"auto"``: the first GPU when there is one)."""
    if isinstance(device, torch.device):
        return device
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
