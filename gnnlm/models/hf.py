"""Any Hugging Face causal LM as the frozen base LM, its features read at named module paths.

A key is read by a forward hook at ``<module path>:<input|output>``, the path taken from the
top-level model (``LlamaForCausalLM``: ``model.layers.-1.mlp``; integers index module lists,
negative ones from the end). The model's ``forward`` is never replaced. Defaults per
``config.model_type`` (``KEY_PATHS``) follow the papers' definitions:

- ``final``: the last hidden state after the final norm, what the output embedding reads
  (GNN-LM's node feature; Khandelwal et al.'s final-layer key);
- ``att``: the input of the last block's FFN, i.e. the normed attention-side residual
  (Xu et al. §3). In parallel-residual blocks (GPT-NeoX/Pythia, Phi, Cohere) the FFN reads the
  block's normed input, which does not include that block's attention output; in OLMo 2's
  post-norm blocks it reads the residual stream itself.

Some families transform the output embedding's logits before the softmax: Gemma 2/3 soft-cap
them (``final_logit_softcapping``), Cohere multiplies them by ``logit_scale`` and Granite divides
them by ``logits_scaling`` (``LOGIT_SCALES``). The adapter records that as its
``logit_transform`` (``gnnlm.models.base.LogitTransform``), which every head that reads the output
embedding applies. At load, one short forward pass checks that ``final`` reproduces the model's
logits through the output embedding and that transform, so a wrong path fails at once.
Log-probabilities are computed in float32 whatever dtype the weights are loaded in.

The context is the config's ``CONTEXT_FIELDS`` (MPT's ALiBi: ``max_seq_len``). Bloom's ALiBi
positions have no length: its ``context_length`` is None and ``features.context`` sets the
windows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import os
from functools import partial
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gnnlm.models.base import BaseLM, Features, LogitTransform
from gnnlm.models.gguf_files import prepare_load, unreadable_architecture

# the settings a config checks without torch; importable from here too
from gnnlm.models.settings import (  # noqa: F401
    CONTEXT_FIELDS,
    DEFAULT_CONTEXT,
    DTYPE_NAMES,
    FEATURE_KEYS,
    check_key_path,
    check_keys,
    gguf_file,
)
from gnnlm.workdir.fingerprints import file_sha256

_LLAMA_STYLE = {"att": "model.layers.-1.mlp:input", "final": "model.norm:output"}
KEY_PATHS: dict[str, dict[str, str]] = {
    "gpt2": {"att": "transformer.h.-1.mlp:input", "final": "transformer.ln_f:output"},
    "gpt_neox": {"att": "gpt_neox.layers.-1.mlp:input",
                 "final": "gpt_neox.final_layer_norm:output"},
    # OPT-350m projects after a post-norm stack: set final to model.decoder.project_out:output
    "opt": {"att": "model.decoder.layers.-1.fc1:input",
            "final": "model.decoder.final_layer_norm:output"},
    "phi": {"att": "model.layers.-1.mlp:input", "final": "model.final_layernorm:output"},
    "bloom": {"att": "transformer.h.-1.mlp:input", "final": "transformer.ln_f:output"},
    "mpt": {"att": "transformer.blocks.-1.ffn:input", "final": "transformer.norm_f:output"},
    **{family: _LLAMA_STYLE for family in (
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
        "phi3", "olmo", "olmo2", "granite", "stablelm", "cohere")},
}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# families whose forward scales the output embedding's logits: the config field, and whether it
# multiplies or divides them (MPT's config has a logit_scale that its forward does not apply)
LOGIT_SCALES: dict[str, tuple[str, str]] = {
    **{family: ("logit_scale", "multiply") for family in ("cohere", "cohere2", "cohere2_moe")},
    **{family: ("logits_scaling", "divide") for family in (
        "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
        "granitemoehybrid")},
    "hyperclovax": ("logits_scaling", "multiply"),
}


def logit_transform(config: Any) -> LogitTransform:
    """What the model's forward does to ``final @ W.T + b``: its family's logit scale
    (``LOGIT_SCALES``), then ``final_logit_softcapping`` where set."""
    scale = 1.0
    if str(getattr(config, "model_type", "")) in LOGIT_SCALES:
        field, how = LOGIT_SCALES[config.model_type]
        value = float(getattr(config, field, None) or 1.0)
        scale = value if how == "multiply" else 1.0 / value
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(scale, float(cap) if cap else None)


def hf_context(config: Any) -> Optional[int]:
    """The positions the model reads (``CONTEXT_FIELDS``, the first set), or None for ALiBi
    positions without a length (Bloom)."""
    value = next((getattr(config, field, None) for field in CONTEXT_FIELDS
                  if getattr(config, field, None)), None)
    return int(value) if value else None


def find_module(model: nn.Module, path: str, field: str) -> nn.Module:
    """The submodule at a dotted path (a key's ``:input``/``:output`` is ignored); integer parts
    index module lists (``-1``: the last)."""
    module = model
    parts = path.rpartition(":")[0].split(".") if ":" in path else path.split(".")
    for i, part in enumerate(parts):
        try:
            module = (module[int(part)] if part.lstrip("-").isdigit()  # type: ignore[index]
                      else getattr(module, part))
        except (AttributeError, IndexError, TypeError):
            where = ".".join(parts[:i]) or type(model).__name__
            raise ValueError(f"{field} = {path!r}: {where} has no {part!r} in "
                             f"{type(model).__name__}; name a module of "
                             f"`print(model)`.") from None
        if not isinstance(module, nn.Module):
            raise ValueError(f"{field} = {path!r} names a {type(module).__name__}, not a "
                             f"module.")
    return module


def _tensor_of(value: Any) -> Optional[Tensor]:
    """The hidden states in a hook's input or output (a tensor, a tuple, or a ModelOutput)."""
    if isinstance(value, Tensor):
        return value
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


class HFCausalLM(BaseLM):
    """A ``transformers`` causal LM behind ``BaseLM``: features by hooks at ``keys``."""
    model: Any               # a transformers PreTrainedModel
    dtype_name: str = "float32"
    placed: bool = False     # spread over devices by device_map: never moved
    gguf_sha256: Optional[str] = None  # loaded from a GGUF file: its sha256

    def __init__(self, model: Any, name: str = "hf",
                 keys: Optional[dict[str, str]] = None, check: bool = True):
        super().__init__()
        self.model = model
        cfg = model.config
        self.name = f"hf:{name}"
        self.model_type = str(getattr(cfg, "model_type", ""))
        head = model.get_output_embeddings()
        self.vocab_size, self.hidden_size = head.weight.shape
        self.context_length = hf_context(cfg)
        self.logit_transform = logit_transform(cfg)
        self.keys = self._key_paths(keys or {})
        self._captured: dict[str, Tensor] = {}
        modules = {key: find_module(model, path, f"base_lm.keys.{key}")
                   for key, path in self.keys.items()}
        inside = set(model.base_model.modules())
        # run only the transformer (no [B, T, V] logits) when every key lies inside it
        self._runner = (model.base_model if all(m in inside for m in modules.values())
                        else model)
        self._cache_argument = ("cache" if "cache" in inspect.signature(
            self._runner.forward).parameters else "past_key_values")
        self._hooks = []
        for key, module in modules.items():  # partials of methods: the model still pickles
            if self.keys[key].endswith(":input"):
                self._hooks.append(module.register_forward_pre_hook(
                    partial(self._capture_input, key), with_kwargs=True))
            else:
                self._hooks.append(module.register_forward_hook(
                    partial(self._capture_output, key)))
        if check:
            self.check_final()

    def _key_paths(self, given: dict[str, str]) -> dict[str, str]:
        check_keys(given)
        defaults = KEY_PATHS.get(self.model_type, {})
        paths = {key: given.get(key) or defaults.get(key) for key in FEATURE_KEYS}
        for key, path in paths.items():
            if path is None:
                raise ValueError(
                    f"{type(self.model).__name__} (model_type {self.model_type!r}) has no "
                    f"default feature paths: set base_lm.keys.{key} (e.g. "
                    f"{_LLAMA_STYLE[key]!r}): the module path its {key} feature is read at.")
        return paths  # type: ignore[return-value]

    def _capture_input(self, key: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._captured[key] = next(v for v in (*args, *kwargs.values()) if isinstance(v, Tensor))

    def _capture_output(self, key: str, module: nn.Module, args: tuple, output: Any) -> None:
        tensor = _tensor_of(output)
        if tensor is None:
            raise ValueError(f"base_lm.keys.{key} = {self.keys[key]!r}: the module returns "
                             f"{type(output).__name__}, not hidden states.")
        self._captured[key] = tensor

    def captured(self, key: str) -> Tensor:
        """The ``key`` feature of the model's last forward pass, however it was called (e.g.
        by ``generate()``), as the hook caught it."""
        if key not in self._captured:
            raise ValueError(f"No {key} feature was captured: run the model first.")
        return self._captured[key]

    def take_captured(self) -> dict[str, Tensor]:
        """Every feature of the last forward pass by key, forgotten once taken: empty when the
        model has not run since they were last taken."""
        captured, self._captured = self._captured, {}
        return captured

    def remove_hooks(self) -> None:
        """Take the feature hooks off the model."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @classmethod
    def from_pretrained(cls, name_or_path: str, keys: Optional[dict[str, str]] = None,
                        dtype: Optional[str] = None,
                        device_map: Union[str, dict, None] = None) -> HFCausalLM:
        """Load with the model's fast attention (SDPA) where the family has it, in ``dtype``
        (``float32``, ``bfloat16``, ``float16``; default: float32), and across devices with
        ``device_map`` (needs ``accelerate``)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if device_map is not None and importlib.util.find_spec("accelerate") is None:
            raise ImportError("base_lm.device_map needs the `accelerate` package: pip install "
                              "accelerate (or gnnlm[gpu]).")
        hf_logging.disable_progress_bar()  # per-tensor loading bars would fill redirected logs
        kwargs: dict[str, Any] = {"dtype": DTYPES[dtype or "float32"]}
        gguf = gguf_file(name_or_path)
        if gguf is not None:  # read by transformers from the folder holding it; checked first
            prepare_load(gguf)
            name_or_path, kwargs["gguf_file"] = str(gguf.parent), gguf.name
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.path.isdir(name_or_path)
        if os.path.isdir(name_or_path) and any(
                f.endswith(".safetensors") for f in os.listdir(name_or_path)):
            kwargs["use_safetensors"] = True  # never unpickle when tensors exist
        if device_map is not None:
            kwargs["device_map"] = device_map
        try:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    name_or_path, local_files_only=offline, attn_implementation="sdpa", **kwargs)
            except ValueError as err:  # a family without an SDPA kernel: its own attention
                if not any(word in str(err) for word in ("sdpa", "scaled_dot_product")):
                    raise
                model = AutoModelForCausalLM.from_pretrained(
                    name_or_path, local_files_only=offline, **kwargs)
        except OSError as err:
            raise FileNotFoundError(f"Cannot load a Hugging Face causal LM from {name_or_path!r}: "
                                    f"{err}") from err
        except ValueError as err:
            unreadable = unreadable_architecture(gguf, err) if gguf else None
            if unreadable is None:
                raise
            raise unreadable from None
        name = gguf.stem if gguf else os.path.basename(os.path.normpath(name_or_path))
        lm = cls(model.eval(), name=name, keys=keys)
        lm.dtype_name = dtype or "float32"
        lm.gguf_sha256 = file_sha256(gguf) if gguf else None
        lm.placed = device_map is not None
        return lm

    def forward(self, input_ids: Tensor, memory: Optional[list[Tensor]] = None) -> Features:
        if memory is not None:
            raise ValueError("Hugging Face base LMs do not take Transformer-XL memory.")
        return self._run(input_ids, use_cache=False)[0]

    def step(self, input_ids: Tensor, cache: Any = None) -> tuple[Features, Any]:
        """Incremental decoding through the model's own key/value cache, which the model
        extends in place (its forward's ``cache``, ``past_key_values`` before transformers
        5.2x)."""
        return self._run(input_ids, use_cache=True, **{self._cache_argument: cache})

    def _run(self, input_ids: Tensor, **kwargs: Any) -> tuple[Features, Any]:
        """The features the hooks capture in one forward pass, and the model's cache."""
        self._captured = {}
        first = self.model.get_input_embeddings().weight.device
        out = self._runner(input_ids=input_ids.to(first), **kwargs)
        captured, self._captured = self._captured, {}
        missing = [key for key in FEATURE_KEYS if key not in captured]
        if missing:
            raise ValueError(f"base_lm.keys.{missing[0]} = {self.keys[missing[0]]!r}: the module "
                             f"did not run in the forward pass; name one that does.")
        # some blocks flatten tokens before their FFN (OPT): back to [B, T, d]
        shape = (*input_ids.shape, -1)
        # the output's cache field is `cache` (transformers 5.2x) or `past_key_values` (before);
        # naming the old one where the new one exists logs a deprecation, even `in`: read the
        # field its class declares (an output that is not a dataclass declares none)
        declared = ({field.name for field in dataclasses.fields(out)}
                    if dataclasses.is_dataclass(out) else set())
        cache = getattr(out, "cache" if "cache" in declared else "past_key_values", None)
        return Features(final=captured["final"].reshape(shape),
                        att=captured["att"].reshape(shape)), cache

    @torch.no_grad()
    def check_final(self, n_tokens: int = 8) -> None:
        """``final`` through the output embedding and the logit transform must give the model's
        own logits. Logits off by one constant factor are a family that scales them in a way
        ``LOGIT_SCALES`` does not know, and the error says so rather than blame the path."""
        ids = torch.arange(min(n_tokens, self.vocab_size))[None] % self.vocab_size
        was_training = self.model.training
        self.model.eval()
        first = self.model.get_input_embeddings().weight.device
        reference = self.model(input_ids=ids.to(first), use_cache=False).logits.float()
        ours = self.logits(self(ids).final)
        self.model.train(was_training)
        if ours.shape != reference.shape:
            raise ValueError(f"base_lm.keys.final = {self.keys['final']!r} gives features of "
                             f"width {ours.shape[-1]}, not what the output embedding reads.")
        scale = reference.abs().max().clamp(min=1.0)
        tolerance = 1e-4 if self.model.dtype == torch.float32 else 3e-2
        error = float((ours - reference.to(ours.device)).abs().max() / scale)
        if error > tolerance:
            self._check_scale(ours, reference.to(ours.device), scale, tolerance)
            raise ValueError(f"base_lm.keys.final = {self.keys['final']!r} does not reproduce "
                             f"the model's logits (relative error {error:.2g}): name the module "
                             f"whose output the output embedding reads (the final norm).")

    def _check_scale(self, ours: Tensor, reference: Tensor, scale: Tensor,
                     tolerance: float) -> None:
        """Raise where the model's logits are ``ours`` times one factor (least squares)."""
        factor = float((ours * reference).sum() / (ours * ours).sum().clamp(min=1e-30))
        if abs(factor - 1.0) > 1e-3 and float(
                (factor * ours - reference).abs().max() / scale) <= tolerance:
            raise ValueError(
                f"The model's logits are those of base_lm.keys.final = {self.keys['final']!r} "
                f"times {factor:.4g}: model_type {self.model_type!r} scales its logits past the "
                f"output embedding, which gnnlm.models.hf.LOGIT_SCALES does not list; add its "
                f"config field there.")

    def logits(self, final: Tensor) -> Tensor:
        """float32 logits of ``final``: ``final @ W.T + b``, then the model's logit transform
        (its scale, its soft-cap)."""
        weight, bias = self.output_embedding()
        final = final.to(weight.device, torch.float32)
        logits = F.linear(final, weight.float(), None if bias is None else bias.float())
        return self.logit_transform(logits)

    def to(self, *args, **kwargs):
        """A model spread over devices (``device_map``) stays where it was placed."""
        return self if self.placed else super().to(*args, **kwargs)

    def last_block(self) -> list[nn.Module]:
        """The module holding the last block (the ``att`` path's block) and the final norm."""
        att_block = self.keys["att"].rpartition(":")[0].split(".")
        for end in range(len(att_block), 0, -1):  # the module list's entry on the path
            if att_block[end - 1].lstrip("-").isdigit():
                block = find_module(self.model, ".".join(att_block[:end]), "base_lm.keys.att")
                break
        else:
            raise ValueError(f"Cannot tell the last block from base_lm.keys.att = "
                             f"{self.keys['att']!r}: it has no block index.")
        final = find_module(self.model, self.keys["final"], "base_lm.keys.final")
        return [block, final]

    def output_embedding(self) -> tuple[Tensor, Optional[Tensor]]:
        head = self.model.get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

    def fingerprint(self) -> str:
        """A model loaded from a GGUF file is that file dequantized to a dtype: in float32 (the
        default) the file's sha256 (its first 16 hex digits); in another dtype the sha256 of the
        file's sha256 and the dtype's name, so the features of a float32 and a bfloat16 load of
        one file are never taken for each other. Other models: the hash of their weights."""
        if not self.gguf_sha256:
            return super().fingerprint()
        if self.dtype_name == "float32":
            return self.gguf_sha256[:16]
        return hashlib.sha256(f"{self.gguf_sha256}:{self.dtype_name}".encode()).hexdigest()[:16]

    def identity(self) -> dict:
        return {**super().identity(), "keys": dict(self.keys), "dtype": self.dtype_name,
                **self.logit_transform.identity()}
