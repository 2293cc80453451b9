"""Where work runs: device names are checked, ``auto`` follows what torch and faiss see."""
from __future__ import annotations

import pytest
import torch

from gnnlm.utils import devices
from gnnlm.utils.devices import check_device, faiss_device, faiss_has_gpu, torch_device


def test_torch_device():
    assert torch_device("cpu") == torch.device("cpu")
    assert torch_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch_device("auto").type == expected
    assert torch_device().type == expected
    assert torch_device("cuda:1") == torch.device("cuda", 1)  # a name, not an allocation


def test_bad_device_names_are_refused():
    for name in ("cpu", "cuda", "auto", "cuda:0"):
        check_device(name)
    with pytest.raises(ValueError, match=r"device must be one of .*\(got 'tpu'\)"):
        torch_device("tpu")
    with pytest.raises(ValueError, match=r"\(got 'gpu'\)"):
        faiss_device("gpu")
    for name in ("cuda:", "cuda:x", "cuda:0 ", "cuda:-1"):
        with pytest.raises(ValueError, match=r"or 'cuda:<n>' \(got"):
            check_device(name)


def test_free_gpu_memory_counts_what_torch_s_allocator_holds_unused(monkeypatch):
    """A table just released stays reserved by torch (the driver counts it as taken), and is
    handed out first: it is free for what is sized next."""
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 << 30)
    assert devices.free_memory(gpu) == (3 + 26) << 30
    assert devices.resident_room(gpu) == (29 << 30) // 2
    assert devices.free_memory(torch.device("cpu")) is None


def test_an_unnumbered_gpu_is_the_current_one(monkeypatch):
    """``cuda`` (what ``torch_device("auto")`` gives) and a tensor's ``cuda:0`` are one device
    while GPU 0 is current: keys already there are not placed (and sized) again."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda, first, second = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert cuda != first                                  # torch's own comparison
    assert devices.same_device(cuda, first) and devices.same_device(first, cuda)
    assert not devices.same_device(cuda, second) and devices.same_device(second, second)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)   # a DDP rank's
    assert devices.same_device(cuda, second) and not devices.same_device(cuda, first)
    cpu = torch.device("cpu")
    assert devices.same_device(cpu, torch.device("cpu")) and not devices.same_device(cpu, cuda)


def test_faiss_device():
    assert faiss_device("cpu") == "cpu"
    if faiss_has_gpu():
        assert faiss_device("auto") == faiss_device("cuda") == "cuda"
    else:
        assert faiss_device("auto") == "cpu"
        with pytest.raises(ValueError, match="faiss-gpu"):
            faiss_device("cuda")


@pytest.mark.parametrize("gpus,trainer,processes", [
    (0, {}, 1),                                              # auto on a CPU: one process
    (0, {"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, 2),
    (0, {"accelerator": "cpu", "devices": "3"}, 3),
    (0, {"accelerator": "cpu", "devices": 1, "num_nodes": 2}, 2),
    (2, {}, 2),                                              # auto: every GPU torch sees
    (2, {"accelerator": "gpu", "devices": 1}, 1),
    (2, {"accelerator": "gpu", "devices": -1}, 2),
    (2, {"accelerator": "cuda", "devices": "0,1"}, 2),
    (2, {"accelerator": "gpu", "devices": [1]}, 1),
    (2, {"accelerator": "cpu", "devices": "auto"}, 1),
    (0, {"accelerator": "mps"}, None),                       # Lightning's to count
])
def test_the_processes_a_trainer_section_trains_on(gpus, trainer, processes, monkeypatch):
    """As Lightning counts them: its parsed devices times the nodes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert devices.trainer_processes(trainer) == processes


@pytest.mark.parametrize("trainer,message", [
    ({"accelerator": "cpu", "devices": 0}, "should be an int > 0"),
    ({"accelerator": "gpu", "devices": 3}, r"only has: \[0, 1\]"),
    ({"accelerator": "gpu", "devices": 0}, "devices=0 selects no gpu device"),
])
def test_devices_lightning_refuses_are_refused(trainer, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=message):
        devices.trainer_processes(trainer)
