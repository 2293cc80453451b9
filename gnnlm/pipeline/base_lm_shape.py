"""The base LM's context length and hidden size as far as they are known when a pipeline config
loads, without loading weights or downloading: what ``gnnlm.pipeline.config_checks`` checks the
feature windows and the index factory against, before any stage runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gnnlm.models.gguf_files import read_header
from gnnlm.models.settings import CONTEXT_FIELDS, gguf_file, is_hf
from gnnlm.pipeline.config_files import merged_yaml, yaml_list
from gnnlm.workdir.checkpoints import load_checkpoint

if TYPE_CHECKING:
    from gnnlm.pipeline.settings import PipelineSettings


def base_lm_shape(cfg: PipelineSettings) -> Optional[tuple[Optional[int], int]]:
    """The base LM's context length and hidden size (the features' dimension), as far as they
    are known at load without loading weights or downloading; None when they are not. The
    context is None for a Hugging Face model whose ALiBi positions have no length (Bloom).

    From a ``gnnlm fit`` checkpoint's saved hyper-parameters, from a Hugging Face folder's (or
    the local Hub cache's) config.json, or, when the pipeline trains the base LM, from its
    ``gnnlm fit`` YAMLs (the LanguageModel's defaults for what they leave out). A checkpoint
    that is not there yet gives None: the base LM stage says what is missing."""
    spec = cfg.base_lm.ckpt
    if spec is None:
        model = merged_yaml(yaml_list(cfg.base_lm.config)).get("model") or {}
        if not str(model.get("class_path", "LanguageModel")).endswith("LanguageModel"):
            return None
        import inspect

        from gnnlm.lit.lm import LanguageModel  # its defaults; Lightning only when asked

        defaults = {name: p.default for name, p
                    in inspect.signature(LanguageModel.__init__).parameters.items()}
        args = {**defaults, **(model.get("init_args") or {})}
        return _shape(args.get("context_length"), args.get("d_model"))
    if is_hf(spec):
        gguf = gguf_file(spec)
        return _gguf_shape(gguf) if gguf else _hf_shape(spec.removeprefix("hf:"))
    if not Path(spec).is_file():
        return None
    hparams = load_checkpoint(spec).get("hyper_parameters") or {}
    return _shape(hparams.get("context_length"), hparams.get("d_model"))


def _shape(context: Any, hidden: Any) -> Optional[tuple[int, int]]:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (context, hidden))
    return (context, hidden) if ok else None


def _hf_shape(name: str) -> Optional[tuple[Optional[int], int]]:
    """From config.json in the folder ``name``, or in the Hub cache for a model name (never
    downloaded here). The hidden size is the output embedding's input (OPT's
    ``word_embed_proj_dim`` where it projects), which the features have."""
    path = Path(name) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a Hub name, or no huggingface_hub
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    config = json.loads(path.read_text())
    config = {**(config.get("text_config") or {}), **config}  # multimodal: the text model's

    def first(*names: str) -> Any:
        return next((config[n] for n in names if config.get(n) is not None), None)

    hidden = first("word_embed_proj_dim", "hidden_size", "n_embd", "d_model")
    context = first(*CONTEXT_FIELDS)
    if context is None and _shape(1, hidden):  # ALiBi positions of any length (Bloom)
        return None, hidden
    return _shape(context, hidden)


def _gguf_shape(path: Path) -> Optional[tuple[Optional[int], int]]:
    """From the GGUF file's metadata (``<arch>.context_length``, ``<arch>.embedding_length``),
    read without its tensors; a file cut short or not GGUF is refused here, before any stage."""
    header = read_header(path)
    return _shape(header.field("context_length"), header.field("embedding_length"))
