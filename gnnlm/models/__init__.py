"""Base LMs: the built-in GPT and a Hugging Face adapter, behind one interface.

- ``settings``: what a config names of a base LM, checked without torch or transformers;
- ``base``: ``BaseLM``, the interface: the ``final`` and ``att`` features, the output embedding;
- ``gpt``: the built-in GPT, with optional Transformer-XL memory (Dai et al. 2019);
- ``hf``: any Hugging Face causal LM, its features read by hooks at module paths;
- this package: ``load_base_lm``, a ``gnnlm fit`` checkpoint or ``hf:<name>``, frozen;
- ``encode``: the sliding-window protocol, every position of a split scored once;
- ``protocols``: how each report row scored its tokens, and the left context each had;
- ``multi_embedding``: learned W_ds, several output rows per word (Xu et al. 2023).

The package imports no torch by itself: ``gnnlm.models.settings`` (what a config checks) stays
light, and ``BaseLM``/``Features`` are read from ``gnnlm.models.base`` when first asked for.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

# TokenizerConfig, which a base LM checkpoint's data module saves, registered for its loader
import gnnlm.text.settings  # noqa: F401
from gnnlm.models.settings import FEATURE_KEYS, check_hf_folder, is_hf

if TYPE_CHECKING:
    from gnnlm.models.base import BaseLM, Features


def __getattr__(name: str) -> Any:
    """``BaseLM`` and ``Features`` of ``gnnlm.models.base``, imported (with torch) when asked."""
    if name in ("BaseLM", "Features"):
        import importlib

        return getattr(importlib.import_module("gnnlm.models.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_gpt_checkpoint(path: str) -> BaseLM:
    """The built-in GPT of a ``gnnlm fit`` checkpoint, built from its saved hyper-parameters
    (read as plain data; no code from the file runs). ``vocab_fingerprint`` is the vocabulary it
    was trained on, as the checkpoint records it (None in checkpoints written before it was)."""
    from gnnlm.models.gpt import GPT, GPTConfig
    from gnnlm.workdir.checkpoints import CheckpointError, load_checkpoint, model_state

    checkpoint = load_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    state = model_state(checkpoint, "model.")
    if "vocab_size" not in hparams or not state:
        raise CheckpointError(f"{path} is not a checkpoint of the built-in LM "
                              f"(gnnlm.lit.lm.LanguageModel): it has no GPT weights.")
    model = GPT(GPTConfig(**{k: v for k, v in hparams.items() if k in fields}))
    model.load_state_dict(state)
    model.vocab_fingerprint = hparams.get("vocab_fingerprint")
    return model


def load_base_lm(spec: str, options: Optional[dict] = None) -> BaseLM:
    """Load a frozen base LM from ``spec``.

    ``spec`` is a checkpoint of the built-in LM written by ``gnnlm fit`` (``*.ckpt``), or
    ``hf:<name or folder>`` for a Hugging Face causal LM (a folder with ``config.json`` also works
    without the prefix), or a GGUF file (``[hf:]<file>.gguf``, or a folder holding one), read by
    transformers with the tokenizer inside it. ``options`` apply to Hugging Face models only:
    ``keys`` (module paths of the features), ``dtype`` and ``device_map`` (see
    ``HFCausalLM.from_pretrained``). Models are identified by their weights' fingerprint (a
    GGUF's: its file's sha256), not by the path.
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if is_hf(spec):
        from gnnlm.models.hf import HFCausalLM

        check_hf_folder(spec, "base LM")
        model: BaseLM = HFCausalLM.from_pretrained(spec.removeprefix("hf:"), **options)
    else:
        if options:
            raise ValueError(f"base_lm.{sorted(options)[0]} applies to Hugging Face models "
                             f"(hf:<name-or-folder>), not to the checkpoint {spec}.")
        model = load_gpt_checkpoint(spec)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def hf_options(identity: dict) -> dict:
    """The loading options a features manifest records for its base LM (empty for gnnlm's)."""
    return {name: identity[name] for name in ("keys", "dtype") if identity.get(name)}


__all__ = ["FEATURE_KEYS", "BaseLM", "Features", "hf_options", "is_hf", "load_base_lm",
           "load_gpt_checkpoint"]
