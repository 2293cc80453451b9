"""Base LMs: the built-in GPT and a Hugging Face adapter, behind one interface."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from gnnlm.models.base import FEATURE_KEYS, BaseLM, Features


def load_gpt_checkpoint(path: str) -> BaseLM:
    """The built-in GPT of a ``gnnlm fit`` checkpoint, built from its saved hyper-parameters
    (read as plain data; no code from the file runs)."""
    from gnnlm.checkpoints import CheckpointError, load_checkpoint, model_state
    from gnnlm.models.gpt import GPT, GPTConfig

    checkpoint = load_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    state = model_state(checkpoint, "model.")
    if "vocab_size" not in hparams or not state:
        raise CheckpointError(f"{path} is not a checkpoint of the built-in LM "
                              f"(gnnlm.lit.lm.LanguageModel): it has no GPT weights.")
    model = GPT(GPTConfig(**{k: v for k, v in hparams.items() if k in fields}))
    model.load_state_dict(state)
    return model


def load_base_lm(spec: str) -> BaseLM:
    """Load a frozen base LM from ``spec``.

    ``spec`` is a checkpoint of the built-in LM written by ``gnnlm fit`` (``*.ckpt``), or
    ``hf:<name or folder>`` for a Hugging Face causal LM (a folder with ``config.json`` also works
    without the prefix). Models are identified by their weights' fingerprint, not by the path.
    """
    if spec.startswith("hf:") or (Path(spec).is_dir() and (Path(spec) / "config.json").is_file()):
        from gnnlm.models.hf import HFCausalLM

        model: BaseLM = HFCausalLM.from_pretrained(spec.removeprefix("hf:"))
    else:
        model = load_gpt_checkpoint(spec)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


__all__ = ["FEATURE_KEYS", "BaseLM", "Features", "load_base_lm", "load_gpt_checkpoint"]
