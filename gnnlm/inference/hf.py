"""kNN-LM inside Hugging Face ``generate()``: a ``LogitsProcessor`` over a work directory.

    model = AutoModelForCausalLM.from_pretrained(folder)      # the work directory's base LM
    knn = KNNLogitsProcessor.from_workdir("runs/wikitext2-gpt2", model)
    model.generate(input_ids, logits_processor=LogitsProcessorList([knn]), ...)

``generate()`` gives a logits processor the scores of the next token, not the hidden states, so
the processor reads the query where the pipeline read it: a forward hook at the work
directory's key path (``final`` or ``att``, ``gnnlm.models.hf``) keeps the last forward pass's
feature, whose last position is the query. It is searched as the pipeline searched
(``gnnlm.retrieval.lookup``), and the scores are replaced by kNN-LM's log p (Khandelwal et al.
2020): log((1 − λ)·softmax(scores) + λ·p_kNN), with the row's fitted k, T and λ. Greedy
``generate`` with it picks the tokens ``TrainedLM.generate(..., row="knn", greedy=True)`` picks
while the text fits in the base LM's window (``tests/models/test_hf_families.py``); longer,
Hugging Face reads all of it, where gnnlm slides its windows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from transformers import LogitsProcessor

from gnnlm.inference.model import TrainedLM
from gnnlm.inference.served import NotServed
from gnnlm.models.hf import HFCausalLM
from gnnlm.retrieval.knn import interpolate_support, knn_support
from gnnlm.retrieval.lookup import stored


class KNNLogitsProcessor(LogitsProcessor):
    """kNN-LM's next-token log-probabilities in place of the model's scores.

    Args:
        lm: the work directory (``gnnlm.load``) whose base LM ``model`` is.
        model: the Hugging Face causal LM that will generate: the same weights as the work
            directory's base LM (checked by fingerprint).
        row: the kNN-LM row (``knn``, or ``knn[<key>]``).
        overrides: ``knn_k``, ``knn_temperature``, ``lam`` (default: fitted on valid).
    """

    def __init__(self, lm: TrainedLM, model: Any, row: str = "knn", **overrides: Any):
        if not lm.served.is_knn(row):
            raise NotServed(f"{row!r} is not a kNN-LM row of {lm.workdir.root} (its kNN-LM rows: "
                            f"{', '.join(r for r in lm.rows if lm.served.is_knn(r)) or 'none'}).")
        identity = lm.features["base_lm"]
        if not identity.get("keys"):
            raise NotServed(f"The base LM of {lm.workdir.root} is gnnlm's own GPT, not a Hugging "
                            f"Face model: generate with lm.generate(..., row={row!r}).")
        self.lm, self.row = lm, row
        self.settings = lm.settings(row, **overrides)
        self.key, self.metric, self.scores = lm.served.retrieval(row)
        self.adapter = HFCausalLM(model, keys=identity["keys"], check=False)
        if self.adapter.fingerprint() != identity["fingerprint"]:
            self.close()
            raise NotServed(f"The model given (weights {self.adapter.fingerprint()}) is not the "
                            f"base LM the datastore of {lm.workdir.root} was built with "
                            f"({identity['fingerprint']}).")
        self.lookup = lm.lookup(self.key, self.metric)

    @classmethod
    def from_workdir(cls, workdir: Union[str, Path], model: Any, row: str = "knn",
                     report: Optional[str] = None, **overrides: Any) -> KNNLogitsProcessor:
        """The processor of ``row`` of the work directory at ``workdir``, for ``model``."""
        return cls(TrainedLM(workdir, report), model, row, **overrides)

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        features = self.adapter.captured(self.key)                          # [B, T, d]
        query = stored(features[:, -1].float().cpu().numpy())               # [B, d]
        sims, ids = self.lookup.search(query)
        sims = self.lookup.knn_sims(query, sims, ids, self.scores)
        words, knn = knn_support(sims, self.lookup.values(ids), *self.settings.knn())
        model = torch.log_softmax(scores.float(), dim=-1).cpu()
        mixed = interpolate_support(model, words, knn, self.settings.weight)
        return cast(torch.FloatTensor, mixed.to(scores.device, scores.dtype))

    def close(self) -> None:
        """Take the feature hooks off the model (it then generates as before)."""
        self.adapter.remove_hooks()
