"""Any Hugging Face causal LM (GPT-2 family, Llama-style ``layers[i].mlp``) as a base LM.

``final`` is the base model's ``last_hidden_state`` (after its final norm). ``att`` is captured
by a forward *pre*-hook on the last block's MLP, i.e. the normed attention-side residual that
the FFN reads; the model's ``forward`` is left untouched.
"""
from __future__ import annotations

import os
from typing import Optional

from torch import Tensor, nn

from gnnlm.models.base import BaseLM, Features


def _last_block(model: nn.Module) -> nn.Module:
    base = model.base_model
    for attr in ("h", "layers", "blocks"):
        blocks = getattr(base, attr, None)
        if isinstance(blocks, nn.ModuleList) and hasattr(blocks[-1], "mlp"):
            return blocks[-1]
    raise ValueError(f"Cannot find the last block's MLP in {type(model).__name__}: supported are "
                     f"models whose base has `h`, `layers` or `blocks` with an `.mlp` (GPT-2, "
                     f"GPT-Neo, Llama, Mistral, Qwen, ...).")


def _final_norm(model: nn.Module) -> nn.Module:
    base = model.base_model
    for attr in ("ln_f", "norm", "final_layernorm", "final_layer_norm"):
        if isinstance(getattr(base, attr, None), nn.Module):
            return getattr(base, attr)
    raise ValueError(f"Cannot find the final norm of {type(model).__name__} (looked for ln_f, "
                     f"norm, final_layernorm, final_layer_norm).")


class HFCausalLM(BaseLM):
    def __init__(self, model: nn.Module, name: str = "hf"):
        super().__init__()
        self.model = model
        cfg = model.config
        self.name = f"hf:{name}"
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = model.get_output_embeddings().weight.shape[1]
        self.context_length = int(getattr(cfg, "n_positions", None)
                                  or cfg.max_position_embeddings)
        self._captured: Optional[Tensor] = None
        _last_block(model).mlp.register_forward_pre_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple) -> None:
        self._captured = args[0]

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs) -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.path.isdir(name_or_path)
        if os.path.isdir(name_or_path) and any(
                f.endswith(".safetensors") for f in os.listdir(name_or_path)):
            kwargs.setdefault("use_safetensors", True)  # never unpickle when tensors exist
        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, local_files_only=offline,
                                                         **kwargs)
        except OSError as err:
            raise FileNotFoundError(f"Cannot load a Hugging Face causal LM from {name_or_path!r}: "
                                    f"{err}") from err
        return cls(model.eval(), name=os.path.basename(os.path.normpath(name_or_path)))

    def forward(self, input_ids: Tensor, memory: Optional[list[Tensor]] = None) -> Features:
        if memory is not None:
            raise ValueError("Hugging Face base LMs do not take Transformer-XL memory.")
        out = self.model.base_model(input_ids=input_ids, use_cache=False)
        att, self._captured = self._captured, None
        return Features(final=out.last_hidden_state, att=att)

    def last_block(self) -> list[nn.Module]:
        return [_last_block(self.model), _final_norm(self.model)]

    def output_embedding(self) -> tuple[Tensor, Optional[Tensor]]:
        head = self.model.get_output_embeddings()
        return head.weight, getattr(head, "bias", None)
