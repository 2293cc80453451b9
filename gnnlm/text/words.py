"""The words a prefix of a token stream covers, counted as the word tokenizer counts WikiText.

A subword LM (BPE, a Hugging Face model's tokenizer) spends about 1.3 tokens per WikiText word,
so its perplexity per token is not comparable with a word-level LM's or with published
word-level numbers. Perplexity per word divides the same Σ NLL by the words of the text the
scored tokens cover (``gnnlm.pipeline.per_word``); for it to equal what a word-level row on that
text normalises by, words are counted by ``gnnlm.text.tokens.WordTokenizer``'s rule:
``line.split() + ['<eos>']`` for every line, empty lines included.
"""
from __future__ import annotations

import numpy as np

from gnnlm.text.tokens import TokenStore

# tokenizer kinds whose tokens are not words: their reports give perplexity per word beside per
# token (``word`` needs none, the two are equal; ``char`` reports bits per character)
SUBWORD_KINDS = ("bpe", "hf")


def count_words(text: str) -> int:
    r"""Words of ``text`` by the WikiText rule: every line ended by ``\n`` counts its
    whitespace-separated words plus one ``<eos>`` (an empty line: just the ``<eos>``). Text after
    the last ``\n`` is a line the prefix cut: its words count (a word cut in the middle counts
    as one) and no ``<eos>``, since its end was not scored."""
    *complete, unfinished = text.split("\n")
    return sum(len(line.split()) + 1 for line in complete) + len(unfinished.split())


def scored_words(store: TokenStore, split: str, n: int) -> int:
    """Words of the text the first ``n`` tokens of ``split`` decode to with the store's tokenizer
    (``count_words``): the scored tokens may be a prefix of the split (``features.max_tokens``),
    cut anywhere. Byte-level BPE (kind ``bpe``, GPT-2-style models) decodes to the corpus text
    exactly; a tokenizer that normalises text (NFKC, lower-casing) is counted on what it
    decodes to."""
    ids = np.asarray(store.split(split)[:n])
    return count_words(store.tokenizer.decode(ids))
