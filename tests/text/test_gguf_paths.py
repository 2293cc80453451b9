"""Which GGUF file a path names (gnnlm.text.gguf_paths): one rule for the base LM's weights
(gnnlm.models.settings) and its tokenizer (gnnlm.text.tokens), so both come from one file."""
import pytest

from gnnlm.models.settings import gguf_file, is_hf
from gnnlm.text.gguf_paths import gguf_candidates
from gnnlm.text.tokens import HFTokenizer


def tokenizer_gguf(path: str, monkeypatch):
    """The GGUF ``HFTokenizer.from_path`` reads its tokenizer from (None: it reads none)."""
    if HFTokenizer._gguf_file(path) is None:
        return None
    monkeypatch.setattr(HFTokenizer, "_from_gguf", classmethod(lambda cls, gguf: gguf))
    return HFTokenizer.from_path(path)


def test_the_weights_and_the_tokenizer_name_the_same_gguf(tmp_path, monkeypatch):
    folder = tmp_path / "lm"
    folder.mkdir()
    file = folder / "m.Q4_1.GGUF"
    file.write_bytes(b"")
    for path in (str(file), str(folder)):
        assert gguf_file(path) == file == tokenizer_gguf(path, monkeypatch)
        assert gguf_file(f"hf:{path}") == file and is_hf(path)
    # a tokenizer.json beside it: the weights can only come from the GGUF, so the tokenizer does
    (folder / "tokenizer.json").write_text("{}")
    assert gguf_file(str(folder)) == file == tokenizer_gguf(str(folder), monkeypatch)
    # config.json makes the folder a saved Hugging Face model: neither reads the GGUF
    (folder / "config.json").write_text("{}")
    assert gguf_candidates(str(folder)) == [] and gguf_file(str(folder)) is None
    assert tokenizer_gguf(str(folder), monkeypatch) is None


def test_a_gguf_under_the_home_folder_is_found_by_both(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"")
    assert gguf_file("~/m.gguf") == tmp_path / "m.gguf" == tokenizer_gguf("~/m.gguf", monkeypatch)


def test_several_or_a_missing_gguf_name_no_weights_and_the_tokenizer_refuses_them(tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    for name in ("b.gguf", "a.gguf"):
        (two / name).write_bytes(b"")
    assert gguf_candidates(str(two)) == [two / "a.gguf", two / "b.gguf"]
    assert gguf_file(str(two)) is None and is_hf(str(two))
    with pytest.raises(FileNotFoundError) as err:
        HFTokenizer.from_path(str(two))
    assert str(err.value) == (f"{two} holds 2 GGUF files (a.gguf, b.gguf): name the one whose "
                              f"tokenizer to read.")
    missing = tmp_path / "absent.gguf"
    assert gguf_candidates(str(missing)) == [missing] and gguf_file(str(missing)) is None
    with pytest.raises(FileNotFoundError, match="there is no such GGUF file"):
        HFTokenizer.from_path(str(missing))
