"""Tokenization: WikiText-2 statistics, round trips of every tokenizer, clear errors."""
import numpy as np
import pytest

from gnnlm.text.tokens import (
    CharTokenizer,
    HFTokenizer,
    TokenizerConfig,
    TokenStore,
    build_tokens,
)


def test_wikitext2_word_level_counts(wikitext_tokens):
    """The published WikiText-2 statistics: tokens counting <eos>, and 33,278 types."""
    assert wikitext_tokens.manifest["counts"] == {"train": 2088628, "valid": 217646,
                                                  "test": 245569}
    assert wikitext_tokens.vocab_size == 33278
    train = wikitext_tokens.split("train")
    assert train.dtype == np.uint16 and len(train) == 2088628
    words = wikitext_tokens.tokenizer.tokens(train[:8])
    assert words[:4] == ["<eos>", "=", "Valkyria", "Chronicles"]
    # every valid/test word is in the train vocabulary (no <unk> beyond the corpus's own)
    reopened = TokenStore.open(wikitext_tokens.path)
    assert reopened.tokenizer.vocab == wikitext_tokens.tokenizer.vocab


def test_char_level_round_trip(wikitext_root):
    text = (wikitext_root / "wikitext-2" / "valid.txt").read_text()[:20000]
    tok = CharTokenizer.fit((wikitext_root / "wikitext-2" / "train.txt").read_text()[:2_000_000])
    ids = tok.encode(text)
    assert len(ids) == len(text)
    known = np.array([c in tok.vocab[1:] for c in text])
    assert tok.decode(ids) == "".join(c if k else "<unk>" for c, k in zip(text, known))


def test_bpe_round_trip_and_reload(wikitext_root, tmp_path):
    train = (wikitext_root / "wikitext-2" / "train.txt").read_text()[:300_000]
    tok = HFTokenizer.train_bpe(train, vocab_size=600)
    text = (wikitext_root / "wikitext-2" / "test.txt").read_text()[:5000]
    text = text[: text.rindex("\n") + 1]                       # whole lines
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text) / 1.5
    tok.save(tmp_path)
    np.testing.assert_array_equal(HFTokenizer.load(tmp_path).encode(text), ids)


def test_hf_tokenizer_build_from_tokenizer_json(tmp_path):
    corpus = tmp_path / "tiny"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text("the cat sat on the mat\nthe dog sat\n" * 50)
    bpe = build_tokens(tmp_path / "bpe", "tiny", corpus_path=str(corpus),
                       tokenizer=TokenizerConfig(kind="bpe", vocab_size=300))
    json_path = bpe.path / "tokenizer.json"
    hf = build_tokens(tmp_path / "hf", "tiny", corpus_path=str(corpus),
                      tokenizer=TokenizerConfig(kind="hf", path=str(json_path)))
    np.testing.assert_array_equal(hf.split("train"), bpe.split("train"))
    assert hf.tokenizer.decode(hf.split("valid")) == (corpus / "valid.txt").read_text()


def test_missing_split_is_a_clear_error(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "train.txt").write_text("a b\n")
    (corpus / "test.txt").write_text("a b\n")
    with pytest.raises(FileNotFoundError, match="no valid split"):
        build_tokens(tmp_path / "tok", "c", corpus_path=str(corpus))
    assert not (tmp_path / "tok").exists()


def test_empty_split_is_a_clear_error(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for split, text in (("train", "a b\n"), ("valid", "\n\n"), ("test", "a\n")):
        (corpus / f"{split}.txt").write_text(text)
    with pytest.raises(ValueError, match="valid.txt is empty"):
        build_tokens(tmp_path / "tok", "c", corpus_path=str(corpus))
