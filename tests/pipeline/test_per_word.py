"""Perplexity per word beside perplexity per token for subword tokenizers: the word count of the
text the scored tokens cover (WikiText's rule, a prefix cut mid-line), the conversion
exp(Σ NLL / words), the report's columns; then a pipeline on a WikiText-2 slice with a BPE trained
on it, its valid split cut mid-line by ``features.max_tokens``."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gnnlm.pipeline.per_word import columns, ppl_per_word
from gnnlm.text.tokens import EOS, HFTokenizer, TokenStore, WordTokenizer
from gnnlm.text.words import count_words
from gnnlm.utils.metrics import ppl_from_logprobs
from tests.conftest import wikitext_slice
from tests.families import FAMILIES
from tests.pipeline.test_report import SIZES
from tests.pipeline.test_report import _results as made_up_results

TEXT = "The cat sat .\n\n = Heading = \nA  line\twith   spaces\n"


def test_words_are_counted_as_the_word_tokenizer_counts_wikitext():
    # 4 + <eos>; the empty line's <eos>; 3 + <eos>; 4 + <eos>
    assert count_words(TEXT) == 5 + 1 + 4 + 5
    assert count_words(TEXT) == len(WordTokenizer.fit(TEXT).encode(TEXT))
    assert count_words("") == 0
    assert count_words("\n\n") == 2                      # two empty lines, each its <eos>


def test_a_prefix_cut_mid_line_counts_its_words_without_the_line_s_eos():
    assert count_words("The cat sat .\n\n = Head") == 5 + 1 + 2   # "=" and the cut "Head"
    assert count_words("The cat sat .\n\n = ") == 5 + 1 + 1
    assert count_words("The cat sat .\n\n") == 5 + 1             # the empty line ended: <eos>
    assert count_words("The cat sat .\n") == 5
    assert count_words("The cat sa") == 3                          # a cut word is a word


def test_perplexity_per_word_is_the_same_nll_over_the_words():
    logprobs = np.log(np.random.default_rng(0).uniform(0.01, 0.9, 1000)).astype(np.float32)
    per_token = ppl_from_logprobs(logprobs)
    nll = -float(np.sum(logprobs, dtype=np.float64))
    assert per_token == pytest.approx(math.exp(nll / 1000), rel=1e-12)
    assert ppl_per_word(per_token, 1000, 770) == pytest.approx(math.exp(nll / 770), rel=1e-12)
    assert ppl_per_word(per_token, 1000, 1000) == pytest.approx(per_token, rel=1e-12)
    assert ppl_per_word(math.inf, 1000, 770) == math.inf
    with pytest.raises(ValueError, match="needs scored tokens and words"):
        ppl_per_word(per_token, 1000, 0)


def test_word_and_char_levels_get_no_per_word_columns():
    args = ({"base": 5.0}, {"base": 6.0}, {"base": 10}, {"valid": 10, "test": 10},
            {"valid": 8, "test": 8})
    assert columns("word", *args) == columns("char", *args) == {}
    assert set(columns("bpe", *args)) == {"scored_tokens", "words", "ppl_per_word",
                                          "valid_ppl_per_word"}


def test_the_report_gives_both_perplexities_and_leaves_unknown_valid_cells_empty(tmp_path,
                                                                                capsys):
    """Every row per word on test; on valid only the rows over the valid tokens the words were
    counted on: a head's own scores, and an interpolation whose fit recorded that count (the
    made-up ``knn`` row), not one whose fit did not (``knn[att]``) or a head scoring fewer."""
    from gnnlm.pipeline.report import print_table, write_report

    wd, results = made_up_results(tmp_path)
    results.level = "bpe"
    results.words = {"valid": 300, "test": 250}
    results.fitted_on["knn"] = SIZES["valid"]
    results.scores["learned_wds"]["valid"] = results.scores["learned_wds"]["valid"][:-1]
    report = write_report(wd, results)
    assert report["words"] == {"valid": 300, "test": 250}
    assert report["scored_tokens"] == {"valid": SIZES["valid"], "test": SIZES["test"]}
    assert set(report["ppl_per_word"]) == set(report["ppl"])
    for name in report["ppl"]:
        nll = -float(np.sum(results.scores[name]["test"], dtype=np.float64))
        assert report["ppl_per_word"][name] == pytest.approx(math.exp(nll / 250), rel=1e-9)
    valid = report["valid_ppl_per_word"]
    assert {"base", "gnn", "knn"} <= set(valid)
    assert not {"knn[att]", "gnn+knn", "learned_wds+base", "learned_wds"} & set(valid)
    assert valid["knn"] == pytest.approx(7.0 ** (SIZES["valid"] / 300), rel=1e-12)
    text = (wd.report("run") / "results.md").read_text()
    assert ("| model | valid ppl / token | test ppl / token | valid ppl / word | test ppl / word |"
            in text)
    assert (f"| base LM | {report['valid_ppl']['base']:.2f} | {report['ppl']['base']:.2f} | "
            f"{valid['base']:.2f} | {report['ppl_per_word']['base']:.2f} |") in text
    assert (f"| +kNN, att keys | 7.00 | {report['ppl']['knn[att]']:.2f} |  | "
            f"{report['ppl_per_word']['knn[att]']:.2f} |") in text
    said = (f"valid 300 words for {SIZES['valid']:,} tokens, test 250 words for "
            f"{SIZES['test']:,} tokens")
    assert said in text
    print_table(report, wd)
    out = capsys.readouterr().out
    assert "valid ppl / token  test ppl / token  valid ppl / word   test ppl / word" in out
    assert said in out


# -- on WikiText-2 ----------------------------------------------------------------------------

VOCAB = 300          # the BPE's size: the corpus's and the model's tokenizer are the same one
VALID_PREFIX = 1234  # valid tokens scored: a prefix that ends inside a line


@pytest.fixture(scope="module")
def bpe_run(wikitext_root, tmp_path_factory):
    """The retrieval pipeline (configs/tests/hf_family.yaml, kNN-LM on ``final`` keys) with
    tokenizer kind ``bpe`` on the first 40k characters of WikiText-2's train split and 10k of
    valid and test, the base LM a tiny random-weight GPT-2 whose own tokenizer is the BPE the
    tokens stage trains on that train text. Returns (the slice's folder, the work directory)."""
    from transformers import PreTrainedTokenizerFast

    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import run

    root = tmp_path_factory.mktemp("per-word")
    corpus = wikitext_slice(wikitext_root, root / "slice",
                            {"train": 40_000, "valid": 10_000, "test": 10_000})
    bpe = HFTokenizer.train_bpe((corpus / "train.txt").read_text(), VOCAB)
    folder = root / "gpt2"
    FAMILIES["gpt2"].build(bpe.vocab_size, {"<|endoftext|>": bpe.bos_id}).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=bpe.backend,
                            eos_token="<|endoftext|>").save_pretrained(folder)
    run(load_config(["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
                     f"--corpus.path={corpus}", "--corpus.tokenizer.kind=bpe",
                     f"--corpus.tokenizer.vocab_size={VOCAB}", "--knn.keys=[final]",
                     "--gnn.config=null", f"--features.max_tokens={{valid: {VALID_PREFIX}}}",
                     f"--workdir={root / 'work'}", "--name=per-word"]))
    return corpus, root / "work"


def direct_count(text: str, tokenizer: HFTokenizer, n: int) -> int:
    """Words of the text the first ``n`` tokens of ``text`` cover, found without decoding: the
    tokens stage encodes each line with its newline, so whole lines are taken while they fit,
    and the line the prefix ends in is cut at the end of its last scored token's characters."""
    words = 0
    for line in text.split("\n")[:-1]:
        encoding = tokenizer.backend.encode(line + "\n", add_special_tokens=False)
        if len(encoding.ids) <= n:
            words, n = words + len(line.split()) + 1, n - len(encoding.ids)
            continue
        return words + (len(line[:encoding.offsets[n - 1][1]].split()) if n else 0)
    return words


@pytest.mark.integration
@pytest.mark.usefixtures("in_repo", "one_faiss_thread")
def test_a_bpe_report_gives_perplexity_per_word_over_the_scored_text(bpe_run):
    corpus, work = bpe_run
    results = json.loads((work / "reports" / "per-word" / "results.json").read_text())
    store = TokenStore.open(work / "tokens")
    assert results["level"] == "bpe" and store.level == "bpe"
    texts = {s: (corpus / f"{s}.txt").read_text() for s in ("valid", "test")}
    n = results["scored_tokens"]
    assert n == {"valid": VALID_PREFIX, "test": results["tokens"]}
    assert n["test"] == len(store.split("test"))                    # test whole, valid a prefix
    assert not store.tokenizer.decode(store.split("valid")[:VALID_PREFIX]).endswith("\n")
    # whole: the word-level tokenizer's count of the same text; the prefix: counted directly
    assert results["words"]["test"] == len(WordTokenizer([EOS, "<unk>"]).encode(texts["test"]))
    assert results["words"]["valid"] == direct_count(texts["valid"], store.tokenizer,
                                                     VALID_PREFIX)
    assert n["test"] / results["words"]["test"] > 2     # a BPE of 300 on 40k characters: 3.4
    for split, per_token, per_word in (("test", "ppl", "ppl_per_word"),
                                       ("valid", "valid_ppl", "valid_ppl_per_word")):
        assert set(results[per_word]) == set(results[per_token]) == {"base", "knn"}
        for row, ppl in results[per_token].items():
            expected = ppl ** (n[split] / results["words"][split])
            assert results[per_word][row] == pytest.approx(expected, rel=1e-9)
            assert results[per_word][row] > ppl                   # fewer words than tokens
    text = (work / "reports" / "per-word" / "results.md").read_text()
    assert "| model | valid ppl / token | test ppl / token | valid ppl / word | test ppl / word |" \
        in text
    assert (f"valid {results['words']['valid']:,} words for {VALID_PREFIX:,} tokens, test "
            f"{results['words']['test']:,} words for {n['test']:,} tokens") in text
