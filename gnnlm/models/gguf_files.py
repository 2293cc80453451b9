"""GGUF files (llama.cpp's one-file format: config, tokenizer and quantized weights) as base LMs:
their header read without the tensors, and what transformers would report obscurely said in one
line (a missing ``gguf`` package, a truncated file, an architecture it cannot read).

A GGUF file is a header (magic, version, tensor and key counts), key/value metadata
(``general.architecture``, ``<arch>.context_length``, ``<arch>.embedding_length``, the
tokenizer's vocabulary and merges as arrays, ...), one record per tensor (name, shape, type,
offset into the data section), then the aligned tensor data. ``gguf.GGUFReader`` builds numpy
views of every array element, several seconds for a 49k-token vocabulary on two cores; the
config checks read only a few numbers, so this module walks the same layout with ``struct``,
taking the value types and the quantized blocks' sizes from the ``gguf`` package's tables.
The walk reads the tensor records too, so it knows how long the file must be: a download cut
short is named here rather than as transformers' "cannot reshape array" minutes later.

Torch-free and without transformers: ``gnnlm.pipeline.base_lm_shape`` reads a GGUF's shape with
it when a config is loaded.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

GGUF_REQUIREMENT = "gguf>=0.10"  # as pyproject.toml pins it


class TruncatedGGUF(ValueError):
    """The file ends before its header or its tensors do."""


def require_gguf(path: str | os.PathLike) -> None:
    """Refuse a GGUF base LM, in one line, where the ``gguf`` package (which transformers reads
    GGUF files with) is not installed."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{path} is a GGUF file, which needs the `gguf` package: pip install "
                          f"'{GGUF_REQUIREMENT}' (a dependency of gnnlm: reinstall it).")


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says of itself: its metadata (scalars and strings; arrays as their
    length) and the bytes its tensors need (``size``: where the last tensor's data ends)."""
    path: Path
    metadata: dict[str, Any]
    size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def field(self, name: str) -> Any:
        """The architecture's own ``<arch>.<name>`` (``context_length``, ``embedding_length``)."""
        return self.metadata.get(f"{self.architecture}.{name}")


class _Cursor:
    """Reads little- or big-endian values from a buffer; past its end is a truncated file."""

    def __init__(self, buffer: Any, endian: str):
        self.buffer, self.endian, self.offset = buffer, endian, 0

    def read(self, fmt: str) -> Any:
        fmt = self.endian + fmt
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise TruncatedGGUF
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.read("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise TruncatedGGUF
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip(self, size: int) -> None:
        self.offset += size
        if self.offset > len(self.buffer):
            raise TruncatedGGUF


def _value_reader(cursor: _Cursor) -> Callable[[int], Any]:
    """A reader of one metadata value of a ``gguf.GGUFValueType``; arrays give their length
    (their elements are skipped: the tokenizer's are long, and not needed here)."""
    from gguf import GGUFValueType

    scalars = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
               GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
               GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
               GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}

    def value(kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind in scalars:
            return cursor.read(scalars[kind])
        if kind == GGUFValueType.STRING:
            return cursor.string()
        element, count = GGUFValueType(cursor.read("I")), cursor.read("Q")
        if element in scalars:
            cursor.skip(count * struct.calcsize(scalars[element]))
        else:
            for _ in range(count):
                value(element)
        return count

    return value


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at ``path``: metadata and the size its tensors need, read
    without the tensors. A file that is not GGUF, or ends before its header or its tensors
    do, is refused in one line."""
    require_gguf(path)
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

    path = Path(path)
    actual = path.stat().st_size
    truncated = (f"{path} is truncated ({actual:,} bytes, less than its header says it "
                 f"holds): the download or copy was cut short; fetch the file again.")
    if actual < 8:
        raise TruncatedGGUF(truncated)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic = struct.unpack_from("<I", buf, 0)[0]
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not begin with 'GGUF'): give "
                             f"a .gguf model file, or a Hugging Face model's folder.")
        # the version is a small number: read little-endian it has its low bytes set
        endian = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        cursor = _Cursor(buf, endian)
        cursor.skip(8)
        try:
            n_tensors, n_fields = cursor.read("Q"), cursor.read("Q")
            value = _value_reader(cursor)
            metadata: dict[str, Any] = {}
            for _ in range(n_fields):
                key = cursor.string()
                metadata[key] = value(cursor.read("I"))
            end = 0
            for _ in range(n_tensors):
                cursor.string()
                shape = [cursor.read("Q") for _ in range(cursor.read("I"))]
                kind, offset = GGMLQuantizationType(cursor.read("I")), cursor.read("Q")
                block, block_bytes = GGML_QUANT_SIZES[kind]
                elements = 1
                for dim in shape:
                    elements *= dim
                end = max(end, offset + elements // block * block_bytes)
        except TruncatedGGUF:
            raise TruncatedGGUF(truncated) from None
        except (ValueError, KeyError) as err:  # a value or tensor type newer than the package
            raise ValueError(f"{path}: the installed gguf package cannot read its header "
                             f"({err}): upgrade it (pip install -U gguf).") from None
        alignment = int(metadata.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-cursor.offset // alignment) * alignment
    header = GGUFHeader(path, metadata, data_start + end)
    if actual < header.size:
        raise TruncatedGGUF(f"{path} is truncated ({actual:,} bytes; its tensors end at "
                            f"{header.size:,}): the download or copy was cut short; fetch the "
                            f"file again.")
    return header



def prepare_load(path: str | os.PathLike) -> None:
    """Before transformers' ``from_pretrained(..., gguf_file=...)``: the file checked (the
    package, its magic, its length), and transformers' per-tensor dequantization bar, which
    ignores its own progress-bar setting, silenced as gnnlm silences its other loading bars."""
    read_header(path)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if not isinstance(gguf_utils.tqdm, partial):
        gguf_utils.tqdm = partial(gguf_utils.tqdm, disable=True)


def unreadable_architecture(path: str | os.PathLike, err: ValueError) -> ValueError | None:
    """Transformers' error for a GGUF architecture it has no mapping for, in one line with what
    to do (None for any other error)."""
    if "architecture" not in str(err) or "is not supported yet" not in str(err):
        return None
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = ", ".join(sorted(GGUF_SUPPORTED_ARCHITECTURES))
    return ValueError(f"{path} is a GGUF of architecture {read_header(path).architecture!r}, "
                      f"which transformers {transformers.__version__} cannot read (it reads "
                      f"{readable}): give a GGUF of one of those, or the model as a Hugging "
                      f"Face folder.")
