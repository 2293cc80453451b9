"""A text file a user gives is UTF-8 text, or one line says what it is instead: the checks the
corpus reader and ``gnnlm score --file`` share (``gnnlm.text.text_files``)."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from gnnlm.text.text_files import read_text, utf16_without_bom

TEXT = "The game was released in Japan in 2011 .\nIt was well received — café.\n"


@pytest.mark.parametrize("encoding,order", [("utf-16-le", "le"), ("utf-16-be", "be")])
def test_utf16_without_a_byte_order_mark_is_told_by_where_its_nul_bytes_are(encoding, order):
    assert utf16_without_bom(TEXT.encode(encoding)) == order
    assert utf16_without_bom((TEXT * 5000).encode(encoding)[:70001]) == order  # cut anywhere


def test_a_binary_of_small_numbers_is_not_called_utf16():
    counts = np.arange(5000, dtype="<u2") % 7  # NUL high bytes, as ASCII in UTF-16LE has
    assert utf16_without_bom(counts.tobytes()) is None


@pytest.mark.parametrize("content,message", [
    # mtime=0: the same bytes, so the same test id, in every process that collects it
    (gzip.compress(TEXT.encode(), mtime=0), "is not text: it is gzip-compressed (it begins "
                                            "with b'\\x1f\\x8b'): decompress it first (gunzip)."),
    (TEXT.encode("utf-16"), "is UTF-16 text: convert it to UTF-8 (e.g. iconv -f utf-16 -t "
                            "utf-8)."),
    (TEXT.encode("utf-16-be"), "is UTF-16 text without a byte-order mark (UTF-16BE): convert "
                               "it to UTF-8 (e.g. iconv -f utf-16be -t utf-8)."),
    (b"\x00\x01\x02\x03binary", "is not text: it holds a NUL byte at offset 0 (it begins with "
                                "b'\\x00\\x01\\x02\\x03bina'): give text."),
    ("café\n".encode("latin-1"), "is not UTF-8 text: byte 0xe9 at offset 3 cannot be decoded. "
                                 "Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)."),
])
def test_what_is_not_utf8_text_is_named(content, message, tmp_path):
    path = tmp_path / "given.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        read_text(path, give="give text")
    assert str(refused.value) == f"{path} {message}"


def test_utf8_text_is_read_as_it_is(tmp_path):
    path = tmp_path / "given.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert read_text(path) == TEXT


def test_a_few_nul_bytes_in_utf8_text_are_not_utf16():
    """Two NUL bytes side by side, one at an even and one at an odd offset: no byte order."""
    assert utf16_without_bom(b"the cat\x00\x00sat\n") is None
    assert utf16_without_bom(("the cat sat\n" * 40).encode() + b"\x00\x00") is None
