"""The report's data checks (gnnlm.pipeline.data_checks): the share of unknown tokens, near-copies
of the query's text among the datastore's top-1 neighbours, heads worse than the base LM, and the
warnings results.md and the printed table give for them."""
from __future__ import annotations

import numpy as np
import pytest

from gnnlm.models import protocols
from gnnlm.pipeline import data_checks
from gnnlm.pipeline.report import print_table
from gnnlm.pipeline.report_markdown import markdown as _markdown
from gnnlm.pipeline.report_warnings import rows_on_the_base_lm
from gnnlm.text.tokens import (
    CharTokenizer,
    HFTokenizer,
    TokenizerConfig,
    WordTokenizer,
    build_tokens,
)
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from tests.fakes import write_corpus, write_features


def test_unknown_share_of_a_word_vocabulary_cut_by_max_vocab():
    tok = WordTokenizer.fit("a a a b b c\n", max_vocab=3)  # <eos>, <unk>, a
    ids = tok.encode("a b c d\na\n")                       # a <unk> <unk> <unk> <eos> a <eos>
    assert data_checks.unk_id(tok) == tok.stoi["<unk>"]
    assert data_checks.unk_share(ids, data_checks.unk_id(tok)) == pytest.approx(3 / 7)


def test_unknown_ids_of_char_and_hugging_face_tokenizers():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    chars = CharTokenizer.fit("abc")
    assert data_checks.unk_id(chars) == 0
    assert data_checks.unk_share(chars.encode("abz"), 0) == pytest.approx(1 / 3)
    word_level = HFTokenizer(Backend(models.WordLevel({"[UNK]": 0, "</s>": 1, "the": 2},
                                                      unk_token="[UNK]")))
    assert data_checks.unk_id(word_level) == 0
    unigram = HFTokenizer(Backend(models.Unigram([("</s>", 0.0), ("<unk>", 0.0), ("a", -1.0)],
                                                 unk_id=1)))
    assert data_checks.unk_id(unigram) == 1
    # a byte-level BPE has a token for every byte: nothing is unknown, and no share is made up
    byte_level = HFTokenizer.train_bpe("the cat sat on the mat\n" * 20, vocab_size=300)
    assert data_checks.unk_id(byte_level) is None
    assert data_checks.unk_share(np.arange(5), None) is None


def _naive_near_copies(query, train, top1, bos, n):
    """One position at a time, as the definition reads."""
    q, r = [bos, *query.tolist()], [bos, *train.tolist()]
    out = []
    for t, p in enumerate(top1.tolist()):
        m = min(n, t + 1)
        out.append(p >= 0 and p + 1 >= m and q[t + 1 - m:t + 1] == r[p + 1 - m:p + 1])
    return np.array(out, dtype=bool)


def test_a_hand_made_duplicate_is_a_near_copy_and_a_shared_last_token_is_not():
    rng = np.random.default_rng(0)
    train = rng.integers(1, 1000, 200)
    query = rng.integers(1, 1000, 100)
    query[40:80] = train[110:150]                  # a 40-token passage copied from train
    top1 = np.full(100, 5)
    top1[75] = 145                                 # 35 tokens of the passage before both
    top1[60] = 130                                 # only 20 copied tokens before: not 32
    top1[50] = 146                                 # the right passage, one position off
    query[10] = train[7]
    top1[11] = 8                                   # the last token the same, the rest not
    top1[20] = -1                                  # no neighbour
    copies = data_checks.near_copies(query, train, top1, bos_id=0, n=32)
    assert np.flatnonzero(copies).tolist() == [75]
    assert data_checks.near_copies(query, train, top1, bos_id=0, n=20)[60]


def test_near_the_stream_s_start_the_whole_left_context_must_equal():
    """Position 3 has read [bos, x0, x1, x2]: a train position after the same three tokens
    but not at the start of its stream is not a copy of it; the one at the start is."""
    train = np.array([7, 8, 9, 5, 7, 8, 9, 6])
    query = np.array([7, 8, 9, 4])
    assert data_checks.near_copies(query, train, np.array([0, 1, 2, 3]), 0, n=32).all()
    assert not data_checks.near_copies(query, train, np.array([0, 1, 2, 7]), 0, n=32)[3]


def test_near_copies_match_the_definition_on_repetitive_streams():
    """Three symbols (and bos among them) so that matches of every length occur."""
    rng = np.random.default_rng(1)
    train, query = rng.integers(0, 3, 3000), rng.integers(0, 3, 2000)
    query[500:700] = train[1000:1200]
    top1 = rng.integers(-1, 3000, 2000)
    top1[520:700] = np.arange(1020, 1200)
    for n in (1, 4, 8, 32):
        fast = data_checks.near_copies(query, train, top1, bos_id=2, n=n)
        np.testing.assert_array_equal(fast, _naive_near_copies(query, train, top1, 2, n))
    assert data_checks.near_copies(query, train, top1, bos_id=2, n=32)[552:700].all()


def _workdir_with_a_duplicated_valid(tmp_path) -> Workdir:
    """Valid repeats train's first lines and its top-1 neighbours are those very positions;
    test is other text (its words cut from the vocabulary by max_vocab) with neighbours that
    follow other words."""
    lines = [f"w{i} w{i + 1} w{i + 2} w{i + 3}\n" for i in range(0, 60, 4)]
    corpus = write_corpus(tmp_path / "corpus", train="".join(lines), valid="".join(lines[:7]),
                          test="x y z x y z\nw0 w1\n")
    workdir = Workdir(tmp_path / "work")
    store = build_tokens(workdir.tokens, "tiny", corpus_path=str(corpus),
                         tokenizer=TokenizerConfig(kind="word", max_vocab=50))
    for split in ("train", "valid", "test"):
        n = len(store.split(split))
        write_features(workdir.features(split), np.zeros((n, 2), np.float32), split=split)
        if split == "train":
            continue
        ids = np.zeros((n, 4), np.int32)
        ids[:, 0] = np.arange(n) if split == "valid" else np.arange(n) + 7
        builder = ArtifactBuilder(workdir.neighbors("final", "cos", split), kind="neighbors")
        with builder:
            builder.array("ids", np.int32, ids.shape)[...] = ids
            builder.array("sims", np.float32, ids.shape)[...] = 0.0
            builder.finish(extra={"n": n, "K": 4})
    return workdir


def test_measure_reads_the_shares_from_a_work_directory(tmp_path):
    workdir = _workdir_with_a_duplicated_valid(tmp_path)
    checks = data_checks.measure(workdir, "final", "cos")
    # 75 train tokens (60 words, 15 <eos>); 48 types + 2 specials: w48..w59 are unknown; test's
    # 60% is over twice train's 16%
    assert checks["unk_token"] == "<unk>"
    assert checks["unk_share"]["train"] == pytest.approx(12 / 75)
    assert checks["unk_share"]["valid"] == 0.0               # its words are the first 48
    assert checks["unk_share"]["test"] == pytest.approx(6 / 10)   # x y z x y z are unknown
    assert checks["datastore_overlap"] == {"valid": 1.0, "test": 0.0}
    assert checks["near_copy"] == {"key": "final", "metric": "cos", "context": 32}
    found = data_checks.report_warnings(checks["unk_share"], checks["datastore_overlap"], [])
    assert [(w["kind"], w.get("split")) for w in found] == [
        ("unk_share", "test"), ("datastore_overlap", None), ("overlap_mismatch", None)]


def _unk_warnings(train: float, valid: float, test: float) -> dict[str, str]:
    found = data_checks.report_warnings({"train": train, "valid": valid, "test": test}, {}, [])
    return {w["split"]: w["message"] for w in found}


def test_unknown_shares_warned_of_too_high_or_far_above_train_s():
    """WikiText-2 as it is and cut to 10,000 or 5,000 words (measured) gives no warning; cut to
    2,000 words every split is over 20%; a test split 92% unknown against train's 2%, or 15%
    against 5%, holds words the vocabulary was not built for."""
    assert _unk_warnings(0.026, 0.054, 0.062) == {}
    assert _unk_warnings(0.097, 0.116, 0.124) == {}
    assert _unk_warnings(0.158, 0.170, 0.178) == {}
    coarse = _unk_warnings(0.253, 0.261, 0.262)
    assert set(coarse) == {"train", "valid", "test"}
    assert coarse["test"].startswith("26.2% of test tokens are unknown to the vocabulary "
                                     "(`<unk>`; train 25.3%): over 20% ")
    assert coarse["train"].startswith("25.3% of train tokens are unknown to the vocabulary "
                                      "(`<unk>`): over 20% ")
    shifted = _unk_warnings(0.02, 0.03, 0.92)
    assert list(shifted) == ["test"]
    assert shifted["test"].startswith("92.0% of test tokens are unknown to the vocabulary "
                                      "(`<unk>`; train 2.0%): over 2x train's share: ")
    assert list(_unk_warnings(0.05, 0.15, 0.04)) == ["valid"]


def test_heads_worse_than_the_base_lm_on_valid_are_flagged():
    valid = {"base": 100.0, "gnn": 120.0, "spalm": 90.0, "knn": 130.0}
    worse = data_checks.heads_worse_than_base(valid, ["gnn", "spalm"])
    assert worse == [{"row": "gnn", "valid_ppl": 120.0, "base_valid_ppl": 100.0}]
    [warning] = data_checks.report_warnings({}, {}, worse, label={"gnn": "+GNN"}.get)
    assert warning["kind"] == "worse_than_base"
    assert warning["message"].startswith("+GNN is no better than the base LM on valid "
                                         "(120.00 vs 100.00): ")


def test_which_rows_must_beat_the_base_lm():
    """Heads on the base LM's features, by their own row or interpolated with the base LM;
    not kNN-LM (no training), not segment models (other LMs, read another way)."""
    window = protocols.sliding_window(64, 32)
    rows = {"base": window, "knn": window, "gnn": window, "gnn+knn": window,
            "learned_wds": window, "learned_wds+base": window, "spalm": window,
            "spalm_xl": protocols.segments(64, 4, 64)}
    heads = {name: {} for name in ("gnn", "learned_wds", "spalm", "spalm_xl")}
    assert rows_on_the_base_lm(list(rows), heads, rows) == ["gnn", "learned_wds+base", "spalm"]


def test_shares_like_wikitext_2_s_give_no_warning():
    """WikiText-2 (measured on the whole corpus): 2.6/5.4/6.2% <unk>, near-copies 0.06% of
    valid and 0.006% of test (the demo's final keys)."""
    unk = {"train": 0.026, "valid": 0.054, "test": 0.062}
    assert data_checks.report_warnings(unk, {"valid": 0.0006, "test": 0.00006}, []) == []
    # equal but high overlap: the gains are duplication, yet λ transfers
    kinds = [w["kind"] for w in data_checks.report_warnings(unk, {"valid": 0.3, "test": 0.32},
                                                            [])]
    assert kinds == ["datastore_overlap"]


def _results(warnings: list[dict]) -> dict:
    window = protocols.sliding_window(64, 32)
    return {"name": "run", "dataset": "corpus", "tokens": 1000,
            "base_lm": {"name": "gpt", "fingerprint": "abc", "vocab_size": 50, "hidden_size": 8},
            "ppl": {"base": 10.0, "gnn": 12.0}, "valid_ppl": {"base": 11.0, "gnn": 13.0},
            "hparams": {}, "retrieval": {}, "timing_s": {},
            "protocols": {"base": window, "gnn": window},
            "mean_left_context": {"base": 40.0, "gnn": 40.0},
            "unk_token": "<unk>", "unk_share": {"train": 0.02, "valid": 0.03, "test": 0.92},
            "datastore_overlap": {"valid": 0.0006, "test": 0.00006},
            "near_copy": {"key": "final", "metric": "cos", "context": 32},
            "warnings": warnings}


def test_results_md_and_the_table_carry_the_shares_and_one_warnings_block(capsys, tmp_path):
    results = _results([])
    results["warnings"] = data_checks.report_warnings(
        results["unk_share"], results["datastore_overlap"],
        data_checks.heads_worse_than_base(results["valid_ppl"], ["gnn"]),
        label={"gnn": "+GNN"}.get)
    text = _markdown(results)
    assert ("Data: tokens unknown to the vocabulary (`<unk>`): train 2.0%, valid 3.0%, test 92.0%; "
            "positions whose nearest train key is a near-copy (the 32 tokens before both "
            "equal): valid 0.06%, test 0.01%.") in text
    assert text.count("Warnings:") == 1
    block = text.split("Warnings:\n\n")[1].split("\n\n")[0].splitlines()
    assert block[0].startswith("- ⚠ 92.0% of test tokens are unknown to the vocabulary "
                               "(`<unk>`; train 2.0%): over 2x train's share")
    assert block[1] == ("- ⚠ +GNN is no better than the base LM on valid (13.00 vs 11.00): its "
                        "training did not improve on the LM it reads, so its test row is no "
                        "gain of the method.")
    assert len(block) == 2
    print_table(results, Workdir(tmp_path))
    printed = capsys.readouterr().out
    assert printed.index("Warnings:") > printed.index("base LM")
    assert "  ⚠ +GNN is no better than the base LM on valid (13.00 vs 11.00)" in printed


def test_nothing_to_warn_of_gives_no_warnings_block(capsys, tmp_path):
    results = _results([])
    results["unk_share"]["test"] = 0.06
    assert "Warnings" not in _markdown(results)
    print_table(results, Workdir(tmp_path))
    assert "Warnings" not in capsys.readouterr().out
