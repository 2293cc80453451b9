"""Reading a text file a user gives (a corpus's split, a file ``gnnlm score`` scores): UTF-8 text,
or one line saying what the file is instead and what to do.

A file that is not text at all (a binary, an archive) would otherwise be misread as text in
another encoding and told to convert from Latin-1, which would turn it into nonsense: it is named
by its first bytes, or by a NUL byte, which never occurs in UTF-8 or Latin-1 text (git and grep
judge a file binary the same way). UTF-16 text, whose ASCII characters carry NUL bytes, is named
as such, with or without a byte-order mark.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

# what a file that is not text begins with: its kind, and what to do instead (None: give text)
MAGIC = {b"\x7fELF": ("an ELF binary", None),
         b"\x1f\x8b": ("gzip-compressed", "decompress it first (gunzip)"),
         b"PK\x03\x04": ("a zip archive", "extract it first (unzip)"),
         b"\xfd7zXZ\x00": ("xz-compressed", "decompress it first (unxz)"),
         b"\x28\xb5\x2f\xfd": ("zstd-compressed", "decompress it first (unzstd)")}
# how much of a file the checks read: its start tells what it is
SAMPLE = 1 << 16


def utf16_without_bom(raw: bytes) -> Optional[str]:
    """``"le"`` or ``"be"`` when ``raw`` reads as UTF-16 text without a byte-order mark, else
    None. The byte order is where the NUL bytes are: the high byte of an ASCII character, at
    odd offsets in little-endian, and (a quarter of the characters or more being ASCII) at a
    quarter of those offsets or more, and ten times as many as at the others; the start of the
    file, read so, must be printable text (a binary of small 16-bit numbers is not)."""
    sample = raw[:SAMPLE]
    sample = sample[:len(sample) // 2 * 2]
    even, odd = sample[0::2].count(0), sample[1::2].count(0)
    if max(even, odd) < len(sample) / 8 or min(even, odd) * 10 > max(even, odd):
        return None
    order = "le" if odd > even else "be"
    text = sample.decode(f"utf-16-{order}", errors="replace")
    readable = sum(c != "\ufffd" and (c.isprintable() or c.isspace()) for c in text)
    return order if text and readable >= 0.95 * len(text) else None


def check_is_text(path: Path | str, raw: bytes,
                  give: str = "point the corpus at plain text files") -> None:
    """Refuse a file that is not UTF-8 or Latin-1 text (see the module docstring), in one line
    naming ``path``; ``give`` says what to do instead of a binary."""
    for magic, (kind, fix) in MAGIC.items():
        if raw.startswith(magic):
            raise ValueError(f"{path} is not text: it is {kind} (it begins with "
                             f"{raw[:len(magic)]!r}): {fix or give}.")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{path} is UTF-16 text: convert it to UTF-8 (e.g. iconv -f utf-16 -t "
                         f"utf-8).")
    nul = raw.find(b"\x00", 0, SAMPLE)
    if nul < 0:
        return
    order = utf16_without_bom(raw)
    if order is not None:
        raise ValueError(f"{path} is UTF-16 text without a byte-order mark (UTF-16"
                         f"{order.upper()}): convert it to UTF-8 (e.g. iconv -f utf-16{order} "
                         f"-t utf-8).")
    raise ValueError(f"{path} is not text: it holds a NUL byte at offset {nul} (it begins "
                     f"with {raw[:8]!r}): {give}.")


def decode_text(path: Path | str, raw: bytes,
                give: str = "point the corpus at plain text files") -> str:
    """``raw``, the bytes of the file ``path``, as UTF-8 text; refused in one line when it is
    not text (``check_is_text``, with ``give``) or not UTF-8."""
    check_is_text(path, raw, give)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset "
                         f"{err.start} cannot be decoded. Convert the file to UTF-8 (e.g. iconv "
                         f"-f latin1 -t utf-8).") from None


def read_text(path: Path | str, give: str = "point the corpus at plain text files") -> str:
    """The UTF-8 text of the file ``path`` (``decode_text``)."""
    return decode_text(path, Path(path).read_bytes(), give)
