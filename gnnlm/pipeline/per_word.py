"""The report's perplexity per word beside its perplexity per token, for subword tokenizers.

Per token, a row's perplexity is exp(Σ NLL / tokens); per word it is exp(Σ NLL / words), the same
Σ NLL over the words of the text those tokens cover (``gnnlm.text.words``), which is what a
word-level row on that text divides by. Since Σ NLL = tokens · ln(ppl per token), the one is the
other raised to tokens / words: the conversion holds for a row only when it scored exactly the
tokens the words were counted on. Every row scores the same test tokens; on valid, a row whose
perplexity comes from a fit (an interpolation's ``valid_ppl``) or a head that scored another
number of tokens gets no per-word value.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from gnnlm.text.words import SUBWORD_KINDS

# how words are counted, in the words results.md and the printed table say it
RULE = ("words counted as the word-level tokenizer counts WikiText: line.split() + <eos> per "
        "line; a line the scored tokens end inside: its words, no <eos>")


def ppl_per_word(ppl_per_token: float, tokens: int, words: int) -> float:
    """exp(Σ NLL / words) from ppl per token = exp(Σ NLL / tokens) over the same tokens."""
    if tokens <= 0 or words <= 0:
        raise ValueError(f"perplexity per word needs scored tokens and words (got {tokens} "
                         f"tokens, {words} words).")
    return math.exp(math.log(ppl_per_token) * tokens / words)


def columns(level: str, ppl: Mapping[str, float], valid_ppl: Mapping[str, float],
            valid_tokens: Mapping[str, int], tokens: Mapping[str, int],
            words: Mapping[str, int]) -> dict:
    """What results.json records for a subword ``level`` (nothing for ``word`` or ``char``):
    ``words`` and ``scored_tokens`` per split, ``ppl_per_word`` (test) of every row and
    ``valid_ppl_per_word`` of the rows whose valid perplexity is over the ``tokens["valid"]``
    tokens the words were counted on (``valid_tokens[row]``: how many tokens a row's valid
    perplexity is over; a row not in it is left out)."""
    if level not in SUBWORD_KINDS:
        return {}
    return {"scored_tokens": dict(tokens), "words": dict(words),
            "ppl_per_word": {name: ppl_per_word(p, tokens["test"], words["test"])
                             for name, p in ppl.items()},
            "valid_ppl_per_word": {name: ppl_per_word(p, tokens["valid"], words["valid"])
                                   for name, p in valid_ppl.items()
                                   if valid_tokens.get(name) == tokens["valid"]}}


def counted_line(report: dict) -> str:
    """How the words were counted and how many, for results.md and the printed table."""
    counts = ", ".join(f"{split} {report['words'][split]:,} words for "
                       f"{report['scored_tokens'][split]:,} tokens" for split in ("valid", "test"))
    return (f"Perplexity per word: the same Σ NLL over the words of the scored text ({counts}; "
            f"{RULE}).")
