"""kNN-LM inside Hugging Face ``generate()``: a ``LogitsProcessor`` over a work directory.

    model = AutoModelForCausalLM.from_pretrained(folder)      # the work directory's base LM
    knn = KNNLogitsProcessor.from_workdir("runs/wikitext2-gpt2", model)
    input_ids = torch.tensor([knn.lm.prompt_ids("The game was")])   # BOS first, as recorded
    model.generate(input_ids, logits_processor=LogitsProcessorList([knn]), ...)

``generate()`` gives a logits processor the scores of the next token, not the hidden states, so
the processor reads the query where the pipeline read it: a forward hook at the work
directory's key paths (``final`` and ``att``, ``gnnlm.models.hf``) keeps the last forward
pass's features, whose last position is the query. It is searched as the pipeline searched
(``gnnlm.retrieval.lookup``), and the scores are replaced by kNN-LM's log p (Khandelwal et al.
2020): log((1 − λ)·p_LM + λ·p_kNN), with the row's fitted k, T and λ. p_LM is the work
directory's, the softmax of float32 logits of the ``final`` feature, not of the scores
``generate()`` hands over, which a model in bf16 (as on a GPU) rounds to bf16 (a logit near 30
to a step of 0.125).

The prompt must open as the work directory's streams do (``gnnlm.text.bos``): with its BOS,
which a GPT-2-style tokenizer does not add (``TrainedLM.prompt_ids`` builds the ids); other
``input_ids`` are refused in one line. Greedy ``generate`` with it then picks the tokens
``TrainedLM.generate(..., row="knn", greedy=True)`` picks while the text fits in the base LM's
window (``tests/models/test_hf_families.py``); longer, Hugging Face reads all of it, where gnnlm
slides its windows.

Hugging Face's own processors (``bad_words_ids``, ``suppress_tokens``, ``min_new_tokens``'s EOS
ban, forced BOS/EOS, ``no_repeat_ngram_size``, ``repetition_penalty``, ``sequence_bias``, ...)
act on kNN-LM's distribution, as they act on a model's: ``generate`` builds them before a user's
processors, so the processor puts itself first in the list ``generate`` builds
(``_RunFirst``): it mixes the model's own distribution, and those processors then ban and
penalise the mixture (a banned word a neighbour holds stays banned; a penalty applies to
kNN-LM's log p, as Hugging Face's beam search applies processors to log-probabilities). A token
that reaches it already at −inf (processors applied by hand before it) stays at −inf.
Assisted, speculative and prompt-lookup decoding score several positions of one forward pass,
where the hook keeps one query per pass: they are refused in one line.

A GGUF base LM is recorded by its file's sha256; the model given (``from_pretrained(folder,
gguf_file=...)``) is checked to hold that file's weights as the work directory loads them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from gnnlm.inference.model import TrainedLM
from gnnlm.inference.served import NotServed
from gnnlm.models import load_base_lm
from gnnlm.models.hf import HFCausalLM
from gnnlm.models.settings import gguf_file
from gnnlm.retrieval.knn import interpolate_support, knn_support
from gnnlm.retrieval.lookup import stored

ONE_QUERY = ("KNNLogitsProcessor reads the last position of each forward pass of its model and "
             "was called without a new one: assisted, speculative and prompt-lookup decoding "
             "score several positions per pass, which it does not support; generate without "
             "assistant_model and prompt_lookup_num_tokens.")


class KNNLogitsProcessor(LogitsProcessor):
    """kNN-LM's next-token log-probabilities in place of the model's scores, first among the
    processors ``generate`` runs (see the module docstring).

    Args:
        lm: the work directory (``gnnlm.load``) whose base LM ``model`` is.
        model: the Hugging Face causal LM that will generate: the same weights as the work
            directory's base LM (checked by fingerprint; a GGUF's, against its file).
        row: the kNN-LM row (``knn``, or ``knn[<key>]``).
        overrides: ``knn_k``, ``knn_temperature``, ``lam`` (default: fitted on valid).
    """

    def __init__(self, lm: TrainedLM, model: Any, row: str = "knn", **overrides: Any):
        served = lm.served.row(row)
        if not served.row.is_knn_lm:
            knn_rows = [r for r in lm.rows if lm.served.row(r).row.is_knn_lm]
            raise NotServed(f"{row!r} is not a kNN-LM row of {lm.workdir.root} (its kNN-LM rows: "
                            f"{', '.join(knn_rows) or 'none'}).")
        identity = lm.features["base_lm"]
        if not identity.get("keys"):
            raise NotServed(f"The base LM of {lm.workdir.root} is gnnlm's own GPT, not a Hugging "
                            f"Face model: generate with lm.generate(..., row={row!r}).")
        self.lm, self.row = lm, row
        self.settings = lm.settings(served, **overrides)
        self.key, self.metric, self.scores = served.retrieval
        self.adapter = HFCausalLM(model, keys=identity["keys"], check=False)
        try:
            check_base_lm(lm, self.adapter)
        except NotServed:
            self.close()
            raise
        self.lookup = lm.lookup(self.key, self.metric)
        self.pad_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        self.model = model
        _RunFirst.install(model)

    @classmethod
    def from_workdir(cls, workdir: Union[str, Path], model: Any, row: str = "knn",
                     report: Optional[str] = None, **overrides: Any) -> KNNLogitsProcessor:
        """The processor of ``row`` of the work directory at ``workdir``, for ``model``."""
        return cls(TrainedLM(workdir, report), model, row, **overrides)

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        self.check_prompt(input_ids)
        features = self.adapter.take_captured()                             # [B, T, d] each
        if self.key not in features:
            raise NotServed(ONE_QUERY)
        query = stored(features[self.key][:, -1].float().cpu().numpy())     # [B, d]
        sims, ids = self.lookup.search(query)
        sims = self.lookup.knn_sims(query, sims, ids, self.scores)
        words, knn = knn_support(sims, self.lookup.values(ids), *self.settings.knn())
        # p_LM as the work directory's rows compute it: float32 logits of the final feature
        # (the model's own scores are its lm_head's, rounded to its dtype: bf16 on a GPU)
        model = torch.log_softmax(self.adapter.logits(features["final"][:, -1]), -1).cpu()
        mixed = interpolate_support(model, words, knn, self.settings.weight)
        # a token banned before the mixture (-inf) stays banned after it
        mixed = mixed.masked_fill(torch.isneginf(scores).cpu(), -torch.inf)
        return cast(torch.FloatTensor, mixed.to(scores.device, scores.dtype))

    def check_prompt(self, input_ids: torch.Tensor) -> None:
        """Refuse ``input_ids`` whose streams do not open with the work directory's BOS."""
        rule = self.lm.bos
        row = rule.first_mismatch(input_ids.cpu().numpy(), self.pad_id)
        if row is None:
            return
        first = int(input_ids[row, 0]) if input_ids.shape[1] else None
        raise NotServed(f"input_ids row {row} opens with token {first}, but the streams of "
                        f"{self.lm.workdir.root} open with BOS {rule.id} "
                        f"({token_text(self.lm, rule.id)!r}), as its features were built: give "
                        f"input_ids = lm.prompt_ids(prompt), or {[rule.id]} + "
                        f"tokenizer(prompt).input_ids for a tokenizer that adds no BOS.")

    def close(self) -> None:
        """Take the feature hooks off the model (it then generates as before)."""
        self.adapter.remove_hooks()
        if getattr(self, "model", None) is not None:
            _RunFirst.uninstall(self.model)
            self.model = None


class _RunFirst:
    """The model's ``_get_logits_processor`` with every ``KNNLogitsProcessor`` moved to the
    front of the list it builds: Hugging Face's processors (built from the generation config,
    and placed before a user's) then act on kNN-LM's mixture, as they act on a model's scores.
    Installed on the model instance once, while a processor uses it."""

    def __init__(self, build: Any):
        self.build, self.users = build, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        processors = self.build(*args, **kwargs)
        ours = [p for p in processors if isinstance(p, KNNLogitsProcessor)]
        if not ours:
            return processors
        return LogitsProcessorList(ours + [p for p in processors if p not in ours])

    @classmethod
    def install(cls, model: Any) -> None:
        current = getattr(model, "_get_logits_processor", None)
        if current is None:
            return  # not a transformers model that builds its processors: nothing to reorder
        if not isinstance(current, cls):
            current = cls(current)
            model._get_logits_processor = current
        current.users += 1

    @staticmethod
    def uninstall(model: Any) -> None:
        current = model.__dict__.get("_get_logits_processor")
        if isinstance(current, _RunFirst):
            current.users -= 1
            if current.users <= 0:
                del model._get_logits_processor


def token_text(lm: TrainedLM, token: int) -> str:
    """A token as the vocabulary spells it (special tokens included)."""
    backend = getattr(lm.store.tokenizer, "backend", None)
    if backend is not None:
        return str(backend.id_to_token(token))
    return lm.store.tokenizer.tokens([token])[0]


def check_base_lm(lm: TrainedLM, adapter: HFCausalLM) -> None:
    """Refuse a model that is not the work directory's base LM. A GGUF base LM is recorded by
    its file's sha256, which a model loaded by transformers does not carry: its weights are
    compared with the file's, dequantized as the work directory loads it."""
    identity = lm.features["base_lm"]
    gguf = gguf_file(lm.base_lm_spec)
    if gguf is None:
        if adapter.fingerprint() != identity["fingerprint"]:
            dtype = identity.get("dtype", "float32")
            held = str(adapter.model.dtype).removeprefix("torch.")
            hint = "" if held == dtype else (f": it is in {held}, the work directory's in "
                                             f"{dtype} (from_pretrained(..., dtype=torch."
                                             f"{dtype}))")
            raise NotServed(f"The model given (weights {adapter.fingerprint()}) is not the base "
                            f"LM the datastore of {lm.workdir.root} was built with "
                            f"({identity['fingerprint']}){hint}.")
        return
    # the work directory's own load where it has one (it checked the file's sha256), else one
    # made for this comparison only
    recorded = lm.__dict__.get("base_lm")
    if recorded is None:
        recorded = load_base_lm(lm.base_lm_spec, lm.base_lm_options)
    if recorded.fingerprint() != identity["fingerprint"]:
        raise NotServed(f"{gguf} (sha256 {recorded.fingerprint()}) is not the GGUF the "
                        f"datastore of {lm.workdir.root} was built with "
                        f"({identity['fingerprint']}).")
    if not same_weights(adapter, recorded):  # both wrap their model, under the same names
        dtype = identity.get("dtype", "float32")
        raise NotServed(f"The model given does not hold the weights of {gguf} in {dtype}, the "
                        f"base LM of {lm.workdir.root}: load it with AutoModelForCausalLM."
                        f"from_pretrained({str(gguf.parent)!r}, gguf_file={gguf.name!r}, "
                        f"dtype=torch.{dtype}).")


def same_weights(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    """Whether two models hold the same tensors under the same names (dtype included)."""
    ours, theirs = model.state_dict(), other.state_dict()
    if ours.keys() != theirs.keys():
        return False
    return all(a.dtype == theirs[name].dtype and a.shape == theirs[name].shape
               and torch.equal(a.cpu(), theirs[name].cpu()) for name, a in ours.items())
