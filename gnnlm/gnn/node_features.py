"""GNN-LM's window-node features, read by train position on the device the GNN runs on.

A window node's feature is the train datastore's feature at its position (§2.2), stored as PQ
codes or float16 (``gnnlm.gnn.pq``). At the paper's shape a train batch is large: 8 blocks of
128 targets, k = 128 windows of 3 nodes each, so 393,216 window nodes, 805 MB of float32 at
d = 512. Decoded in a DataLoader worker, such a batch took about a second of one CPU core
(``benchmarks/bench_gnn_loader.py``), then three copies (into shared memory, into pinned
memory, onto the GPU), which the GPU waits for. So the graphs carry only each window node's
train position (``nbr.train_pos``, 8 bytes) and the model reads the features where it runs:

- on a GPU, from tables resident there: the PQ codes (64 bytes per position, 134 MB for
  WikiText-2's 2.1M) and codebooks, or the float16 features; a decode is one gather;
- on the CPU, or on a GPU whose free memory cannot hold the tables twice over (said once a
  stage), from the host arrays, as the workers did, then copied to the device.

Decoding copies stored values (a centroid per code byte, or float16 widened to float32), so every
route gives the same float32 bits. The one exception is OPQ's inverse rotation, a matrix product
whose rounding depends on the device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from gnnlm.utils.devices import why_not_resident
from gnnlm.utils.progress import say

# train positions [n] -> float32 [n, d]: ``PQFeatures``, ``RawFeatures`` or any such function
HostFeatures = Callable[[np.ndarray], np.ndarray]


class ResidentPQ:
    """PQ codes and codebooks on one device: positions → features by one gather."""

    def __init__(self, codes: np.ndarray, centroids: np.ndarray, rotation: Optional[np.ndarray],
                 bias: Optional[np.ndarray], device: torch.device):
        m, ksub, dsub = centroids.shape
        self.dim = m * dsub
        self.codes = torch.from_numpy(np.array(codes)).to(device)                # [N, m] uint8
        # one codebook row per (sub-quantizer, code): code c of sub-quantizer j is row 256·j + c
        self.centroids = torch.from_numpy(centroids.reshape(m * ksub, dsub)).to(device)
        self.offsets = torch.arange(m, device=device, dtype=torch.int32) * ksub           # [m]
        self.rotation = None if rotation is None else torch.from_numpy(rotation).to(device)
        self.bias = None if bias is None else torch.from_numpy(bias).to(device)

    def __call__(self, positions: Tensor) -> Tensor:
        rows = self.codes.index_select(0, positions).int() + self.offsets          # [n, m]
        x = self.centroids.index_select(0, rows.flatten()).view(len(positions), self.dim)
        if self.rotation is not None:  # y = A x + b with A orthonormal: x = Aᵀ (y − b)
            # in float32 under the trainer's autocast too, as the host decodes it: bf16 here
            # would make the window nodes' whole residual stream bf16
            with torch.autocast(positions.device.type, enabled=False):
                x = (x - self.bias if self.bias is not None else x) @ self.rotation
        return x


class ResidentRows:
    """Float16 features on one device: positions → their rows, widened to float32."""

    def __init__(self, values: np.ndarray, device: torch.device):
        self.values = torch.from_numpy(np.array(values)).to(device)              # [N, d]

    def __call__(self, positions: Tensor) -> Tensor:
        return self.values.index_select(0, positions).float()


@runtime_checkable
class CopiesToDevice(Protocol):
    """Host features that can be placed on a device (``PQFeatures``, ``RawFeatures``)."""

    @property
    def resident_bytes(self) -> int: ...

    def on_device(self, device: torch.device) -> Callable[[Tensor], Tensor]: ...


class NodeFeatureReader:
    """Train positions (a tensor on any device) → their features on that device (float32; a
    host function's own dtype, such as a float64 reference's, is kept).

    Args:
        features: the host features, a function of a position array giving an array [n, d].
            One that also has ``resident_bytes`` and ``on_device(device)`` (``CopiesToDevice``:
            ``gnnlm.gnn.pq.PQFeatures``, ``RawFeatures``) is copied to a GPU the first time the
            GPU reads it, when it fits in half its free memory; any other is read on the host,
            then copied. A device refused is asked again after ``reconsider`` (the model calls
            it as each stage starts: memory a finished stage held may be free by then).
    """

    def __init__(self, features: HostFeatures):
        self.host = features
        self._resident: dict[torch.device, Optional[Callable[[Tensor], Tensor]]] = {}

    def __call__(self, positions: Tensor) -> Tensor:
        if positions.device.type != "cpu":
            resident = self._on(positions.device)
            if resident is not None:
                return resident(positions)
        rows = self.host(positions.cpu().numpy())
        return torch.as_tensor(np.asarray(rows)).to(positions.device)

    def reconsider(self) -> None:
        """Forget the devices the features did not fit on (those they fit on keep them): the
        next read there checks the free memory again."""
        self._resident = {device: resident for device, resident in self._resident.items()
                          if resident is not None}

    def _on(self, device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
        """The features resident on ``device``, copied there on first use (None: read on the
        host instead)."""
        if device not in self._resident:
            self._resident[device] = self._copy_to(device)
        return self._resident[device]

    def _copy_to(self, device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
        if not isinstance(self.host, CopiesToDevice):
            return None
        nbytes = self.host.resident_bytes
        why_not = why_not_resident(device, nbytes)
        if why_not is not None:
            say(f"[gnnlm] GNN-LM node features: the train features ({nbytes / 2**30:.1f} GiB) "
                f"{why_not}: they are decoded on the host and copied for each batch (slower)")
            return None
        return self.host.on_device(device)
