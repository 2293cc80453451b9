"""The BOS rule: the token every stream the base LM reads opens with, decided once at build time.

The pipeline reads each split as the stream ``[bos] + tokens`` (``gnnlm.models.encode``): the
first token is scored after BOS, whatever the tokenizer, so a GPT-2-style tokenizer that adds
nothing to a text still has its streams opened by its end-of-text token. Models trained with a
BOS before every sequence (Llama, Gemma, ...) also read it first in every later window
(``each_window``). The features stage records the rule in its manifest (``bos``); everything
that reads text with a built work directory applies that record: ``gnnlm.load``'s ``score``,
``next_token_logprobs`` and ``generate``, ``gnnlm score`` and ``gnnlm generate``, and
``KNNLogitsProcessor``, which checks that Hugging Face's ``input_ids`` open with it.
Work directories built before the record derive it as the pipeline did: the tokens' ``bos_id``,
and ``bos_each_window`` of the features (or, before that, of the tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class BosRule:
    """Every stream opens with token ``id``; with ``each_window``, every window as well."""
    id: int
    each_window: bool = False

    @classmethod
    def recorded(cls, features: dict, tokens: Optional[dict] = None) -> BosRule:
        """The rule a features manifest records, or, for features built before it did, the one
        the pipeline applied: ``bos_id`` of the tokens manifest, ``bos_each_window`` of the
        features manifest (its config where only that has it), else of the tokens manifest."""
        record = features.get("bos")
        if isinstance(record, dict):
            return cls(int(record["id"]), bool(record.get("each_window", False)))
        tokens = tokens or {}
        if "bos_id" not in tokens:
            raise ValueError("The features record no BOS and no tokens manifest was given to "
                             "derive it from: pass the work directory's tokens manifest.")
        each = features.get("bos_each_window", (features.get("config") or {}).get(
            "bos_each_window", tokens.get("bos_each_window", False)))
        return cls(int(tokens["bos_id"]), bool(each))

    def record(self) -> dict:
        """What the features manifest records (``opens_stream``: always, in every version)."""
        return {"id": int(self.id), "opens_stream": True, "each_window": bool(self.each_window)}

    def stream(self, tokens: np.ndarray) -> np.ndarray:
        """``[bos] + tokens`` (int64): the stream a text's tokens are read as."""
        return np.concatenate([[self.id], np.asarray(tokens, dtype=np.int64)]).astype(np.int64)

    def first_mismatch(self, input_ids, pad_id: Optional[int] = None) -> Optional[int]:
        """The first row of ``input_ids [B, L]`` whose first token (after left padding with
        ``pad_id``, where that is not BOS) is not BOS; None when every row opens with it."""
        ids = np.asarray(input_ids)
        for b, row in enumerate(ids):
            start = 0
            if pad_id is not None and pad_id != self.id:
                while start < len(row) - 1 and row[start] == pad_id:
                    start += 1
            if len(row) == 0 or int(row[start]) != self.id:
                return b
        return None
