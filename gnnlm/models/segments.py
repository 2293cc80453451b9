"""The segment protocol: a split cut into contiguous streams, read segment by segment.

Transformer-XL (Dai et al. 2019) and SPALM carry the memory of one segment into the next of the
same stream, so they are evaluated on contiguous segments rather than sliding windows
(``gnnlm.models.protocols.segments``). ``StreamSegments`` lays a split out that way for the data
modules and for scoring outside a Trainer (``gnnlm.inference.scoring``).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


class StreamSegments(Dataset):
    """The split cut into ``n_streams`` contiguous streams, served segment by segment.

    Item ``j * n_streams + s`` is segment j of stream s: with ``batch_size = n_streams`` (or
    ``n_streams / world_size`` under a rank-strided sampler) batch j holds segment j of the same
    streams as batch j - 1, which is what Transformer-XL memory needs. Padding is masked out.
    ``positions [T]`` are the split positions the inputs are read at (-1 on padding).
    """

    def __init__(self, stream: torch.Tensor, n_streams: int, segment: int):
        n = len(stream) - 1
        self.length = math.ceil(n / n_streams)                    # positions per stream
        self.n_segments = math.ceil(self.length / segment)
        self.n_streams, self.segment, self.n = n_streams, segment, n
        padded = torch.zeros(n_streams * self.n_segments * segment + 1, dtype=stream.dtype)
        padded[: len(stream)] = stream
        self.padded = padded

    def __len__(self) -> int:
        return self.n_streams * self.n_segments

    def __getitem__(self, i: int) -> dict:
        seg, s = divmod(i, self.n_streams)
        begin = s * self.length + seg * self.segment
        end = min(begin + self.segment, (s + 1) * self.length, self.n)  # stream and split ends
        chunk = self.padded[begin: begin + self.segment + 1]
        mask = torch.zeros(self.segment)
        mask[: max(0, end - begin)] = 1.0
        positions = torch.full((self.segment,), -1, dtype=torch.int64)
        scored = mask.bool()
        positions[scored] = begin + torch.arange(self.segment)[scored]
        return {"input": chunk[:-1], "target": chunk[1:], "mask": mask, "positions": positions}
