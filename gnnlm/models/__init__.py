"""Base LMs: the built-in GPT and a Hugging Face adapter, behind one interface."""
from __future__ import annotations

from pathlib import Path

from gnnlm.models.base import FEATURE_KEYS, BaseLM, Features


def load_base_lm(spec: str, map_location: str = "cpu") -> BaseLM:
    """Load a frozen base LM from ``spec``.

    ``spec`` is a Lightning checkpoint of the built-in LM (``*.ckpt``), or ``hf:<name or folder>``
    for a Hugging Face causal LM (a folder with ``config.json`` also works without the prefix).
    """
    if spec.startswith("hf:") or (Path(spec).is_dir() and (Path(spec) / "config.json").is_file()):
        from gnnlm.models.hf import HFCausalLM

        model = HFCausalLM.from_pretrained(spec.removeprefix("hf:"))
    else:
        if not Path(spec).is_file():
            raise FileNotFoundError(f"No base LM checkpoint at {spec}: give a .ckpt written by "
                                    f"`gnnlm fit` or hf:<name-or-folder>.")
        from gnnlm.lm_module import LanguageModel

        model = LanguageModel.load_from_checkpoint(spec, map_location=map_location).model
        model.name = f"gpt:{spec}"
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


__all__ = ["FEATURE_KEYS", "BaseLM", "Features", "load_base_lm"]
