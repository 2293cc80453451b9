"""``gnnlm.load(workdir)``: a built work directory as a language model, one object for every row.

    lm = gnnlm.load("runs/wikitext2-cpu")
    lm.rows                                    # ['base', 'knn', 'gnn', 'gnn+knn']
    lm.score("The game was released in 2004 .", row="gnn+knn").ppl
    lm.next_token_logprobs("The game was", row="knn")          # float32 [V]
    lm.generate("The game was", row="gnn", max_new_tokens=20, greedy=True).text

A row is what the report's table calls it, with the settings the pipeline fitted on valid
(``gnnlm.inference.served``), each overridable per call (``knn_k``, ``knn_temperature``, ``lam``,
``gnn_k``). ``score`` reads a text as the pipeline read its splits (``gnnlm.inference.scoring``):
on a split's own tokens it gives the report's per-token scores. ``next_token_logprobs`` and
``generate`` read text that grows (``gnnlm.inference.decoding``): the base LM's sliding windows
without an end, one retrieval per new token, GNN-LM's context nodes appended. Every route reads a
text as the stream the pipeline read, under the BOS rule its features record (``gnnlm.text.bos``):
BOS first, whatever the tokenizer adds; ``prompt_ids`` gives that stream to Hugging Face.

Every part runs on the CPU, on a GPU machine too, so that every route computes one number.
Nothing is loaded before a row needs it: the base LM and the tokenizer first, then the index
(train keys and targets stay memory-mapped), a head's weights, and GNN-LM's window states, each
computed when a token first retrieves its window. Reading never writes into the work directory
and takes no lock, so a running pipeline is not disturbed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from gnnlm.inference.decoding import Decoder
from gnnlm.inference.generation import generate
from gnnlm.inference.parts import LMParts, Text
from gnnlm.inference.scoring import score


class TrainedLM(LMParts):
    """A work directory's rows as language models. See the module docstring and ``load``."""

    # -- using it: scoring and decoding -------------------------------------------------------
    def score(self, text: Text, row: Union[str, list[str]] = "base", **overrides):
        """Per-token log-probabilities and perplexity of ``text`` (a string, or token ids) under
        ``row`` (or a list of rows: a dict of scores by row), read as the pipeline read its
        splits (``gnnlm.inference.scoring``)."""
        return score(self, self.encode(text), row, overrides)

    def next_token_logprobs(self, context: Text, row: str = "base",
                            **overrides: Optional[float]) -> torch.Tensor:
        """The next token's distribution after ``context`` under ``row``: log p, float32 [V],
        computed from scratch."""
        ids = self.encode(context, prompt=True)
        served = self.served.row(row)
        decoder = Decoder(self, served, self.settings(served, **overrides), incremental=False)
        return decoder.start(torch.from_numpy(ids)[None])[0]

    def generate(self, prompt: Union[Text, list[str]], row: str = "base",
                 max_new_tokens: int = 20, **options):
        """Continue ``prompt`` (a text or token ids; a list of texts: a batch) under ``row``;
        see ``gnnlm.inference.generation.generate`` for the sampling options."""
        return generate(self, prompt, row, max_new_tokens, **options)


def load(workdir: Union[str, Path], report: Optional[str] = None) -> TrainedLM:
    """A work directory that ``gnnlm pipeline`` built, as a language model (``TrainedLM``);
    ``report``: which of its reports' rows and settings (needed when it holds several)."""
    return TrainedLM(workdir, report)
