"""Finding a corpus: an explicit path, then $GNNLM_DATA, with errors that say where they looked."""
from __future__ import annotations

import re

import pytest

from gnnlm.text.corpus import CorpusNotFoundError, locate_corpus


def make_corpus(folder, names=("train.txt", "valid.txt", "test.txt")):
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text(f"{name}\n")
    return folder


@pytest.fixture(autouse=True)
def no_data_dir(monkeypatch):
    """Each test says itself whether GNNLM_DATA is set (never the machine's own data)."""
    monkeypatch.delenv("GNNLM_DATA", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_explicit_path_is_the_corpus_folder_or_its_parent(tmp_path):
    folder = make_corpus(tmp_path / "data" / "tiny")
    files = locate_corpus("tiny", path=folder, cache_dir=tmp_path / "cache")
    assert files == {s: folder / f"{s}.txt" for s in ("train", "valid", "test")}
    assert locate_corpus("tiny", path=tmp_path / "data", cache_dir=tmp_path / "cache") == files


def test_wikitext_release_file_names_are_found(tmp_path):
    folder = make_corpus(tmp_path / "wt", names=("wiki.train.tokens", "wiki.valid.tokens",
                                                  "wiki.test.tokens"))
    files = locate_corpus("wt", path=folder, cache_dir=tmp_path / "cache")
    assert files["valid"] == folder / "wiki.valid.tokens"


def test_gnnlm_data_holds_named_corpora(tmp_path, monkeypatch):
    folder = make_corpus(tmp_path / "data" / "tiny")
    monkeypatch.setenv("GNNLM_DATA", str(tmp_path / "data"))
    assert locate_corpus("tiny", cache_dir=tmp_path / "cache")["train"] == folder / "train.txt"
    # data_dir, when given, is used instead of the environment
    other = make_corpus(tmp_path / "other" / "tiny")
    assert locate_corpus("tiny", data_dir=tmp_path / "other",
                         cache_dir=tmp_path / "cache")["train"] == other / "train.txt"


def test_a_folder_without_train_split_is_not_a_corpus(tmp_path, monkeypatch):
    make_corpus(tmp_path / "data" / "tiny", names=("valid.txt", "test.txt"))
    monkeypatch.setenv("GNNLM_DATA", str(tmp_path / "data"))
    with pytest.raises(CorpusNotFoundError, match="Unknown corpus 'tiny'"):
        locate_corpus("tiny", cache_dir=tmp_path / "cache")


def test_unknown_corpus_name_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("GNNLM_DATA", str(tmp_path))
    with pytest.raises(CorpusNotFoundError, match=f"Unknown corpus 'no-such-corpus'.*{tmp_path}"):
        locate_corpus("no-such-corpus", cache_dir=tmp_path / "cache")


def test_unknown_corpus_without_gnnlm_data_says_it_is_not_set(tmp_path):
    with pytest.raises(CorpusNotFoundError, match=r"\$GNNLM_DATA \(not set\)"):
        locate_corpus("no-such-corpus", cache_dir=tmp_path / "cache")


def test_known_corpus_offline_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("GNNLM_DATA", str(tmp_path))
    with pytest.raises(CorpusNotFoundError, match="wikitext-103.*offline") as err:
        locate_corpus("wikitext-103", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "wikitext-103") in str(err.value)
    assert str(tmp_path / "cache" / "wikitext-103") in str(err.value)
    assert not (tmp_path / "cache" / "wikitext-103").exists()      # nothing half-downloaded


def test_missing_explicit_path_is_an_error_even_when_gnnlm_data_has_the_corpus(tmp_path,
                                                                               monkeypatch):
    """A path the user named must not be silently replaced by another copy of the corpus."""
    make_corpus(tmp_path / "data" / "tiny")
    monkeypatch.setenv("GNNLM_DATA", str(tmp_path / "data"))
    missing = tmp_path / "typo" / "tiny"
    with pytest.raises(CorpusNotFoundError, match=re.escape(str(missing))):
        locate_corpus("tiny", path=missing, cache_dir=tmp_path / "cache")


def test_missing_explicit_path_of_an_unknown_corpus_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CorpusNotFoundError, match=f"{re.escape(str(missing))} does not exist"):
        locate_corpus("tiny", path=missing, cache_dir=tmp_path / "cache")


@pytest.fixture
def online(monkeypatch):
    """Online as far as the environment says; the Hub's answer is each test's."""
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import gnnlm.text.corpus

    def never(*args, **kwargs):
        raise AssertionError("nothing is downloaded here")

    monkeypatch.setattr(gnnlm.text.corpus, "_download", never)
    return gnnlm.text.corpus


def test_an_unreachable_hub_is_asked_once_and_not_retried(tmp_path, online, monkeypatch):
    """A known corpus found nowhere, the Hub not answering (here: nothing listens on the
    port): one request, and the error says so; the Hub's client would retry five times."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    online.hub_unreachable.cache_clear()
    with pytest.raises(CorpusNotFoundError) as err:
        locate_corpus("wikitext-2", cache_dir=tmp_path / "cache")
    assert "Looked in: $GNNLM_DATA (not set); " in str(err.value)
    assert ("Hugging Face datasets ('Salesforce/wikitext', 'wikitext-2-v1') (the Hub is not "
            "reachable: http://127.0.0.1:9: ") in str(err.value)
    with pytest.raises(CorpusNotFoundError, match="the Hub is not reachable"):
        online.check_corpus("wikitext-2", cache_dir=tmp_path / "cache")


def test_check_corpus_downloads_nothing(tmp_path, online, monkeypatch):
    monkeypatch.setattr(online, "hub_unreachable", lambda endpoint: None)   # the Hub answers
    online.check_corpus("wikitext-2", cache_dir=tmp_path / "cache")        # the stage downloads
    assert not (tmp_path / "cache").exists()
    folder = make_corpus(tmp_path / "data" / "tiny")
    online.check_corpus("tiny", path=folder, cache_dir=tmp_path / "cache")  # found here
    with pytest.raises(CorpusNotFoundError, match="Unknown corpus 'mine'"):
        online.check_corpus("mine", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CorpusNotFoundError, match=r"Hugging Face datasets \(offline\)"):
        online.check_corpus("wikitext-2", cache_dir=tmp_path / "cache")
