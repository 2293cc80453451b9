"""The tokenizer's settings, light enough for a config to check without the tokenizers library.

``TokenizerConfig`` is what a data module and a pipeline's ``corpus.tokenizer`` take, and what a
``gnnlm fit`` checkpoint saves among its data module's hyper-parameters (hence
``checkpoint_safe``: it moved from ``gnnlm.tokens`` and ``gnnlm.text.tokens``, where checkpoints
written before pickled it). Building the tokens is ``gnnlm.text.tokens``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

from gnnlm.workdir.checkpoints import checkpoint_safe


@checkpoint_safe("gnnlm.text.tokens.TokenizerConfig", "gnnlm.tokens.TokenizerConfig")
@dataclass
class TokenizerConfig:
    r"""How text becomes token ids. The vocabulary is learned from the train split only.

    Args:
        kind: ``word`` (whitespace + ``<eos>`` per line, the WikiText convention), ``char`` (one
            id per character, ``\n`` included), ``bpe`` (a byte-level BPE trained on the train
            split), or ``hf`` (a Hugging Face tokenizer read from ``path``).
        vocab_size: the BPE vocabulary's size (``bpe`` only).
        path: ``hf`` only: a ``tokenizer.json`` file or a pretrained model's name or folder
            (unset in a pipeline config: the Hugging Face base LM's own tokenizer).
        max_vocab: ``word`` only: the vocabulary's size, ``<eos>`` and ``<unk>`` included: the
            most frequent words are kept, the rest map to ``<unk>`` (unset: every word of the
            train split).
    """
    kind: Literal["word", "char", "bpe", "hf"] = "word"
    vocab_size: int = 32000
    path: Optional[str] = None
    max_vocab: Optional[int] = None

    def __post_init__(self):
        # named as both configs write them (corpus.tokenizer.*, data.init_args.tokenizer.*)
        if self.vocab_size < 1:
            raise ValueError(f"tokenizer.vocab_size must be >= 1 (got {self.vocab_size}).")
        if self.max_vocab is not None and self.max_vocab < 3:  # <eos> and <unk> count too
            raise ValueError(f"tokenizer.max_vocab must be >= 3 (<eos>, <unk> and at least one "
                             f"word), or null for every word of the train split "
                             f"(got {self.max_vocab}).")


def tokenizer_config(value: Any) -> TokenizerConfig:
    """A ``TokenizerConfig`` from itself or a mapping of its fields (as YAMLs and checkpoints
    hold it)."""
    return value if isinstance(value, TokenizerConfig) else TokenizerConfig(**dict(value or {}))


def tokenizer_settings(value: Any) -> dict:
    """What of a tokenizer config decides the token ids, as the tokens artifact records it: the
    fields that are set, ``vocab_size`` only for a BPE trained here."""
    settings = {k: v for k, v in asdict(tokenizer_config(value)).items() if v is not None}
    if settings["kind"] != "bpe":
        settings.pop("vocab_size")
    return settings
