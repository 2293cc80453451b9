"""What a config names of a base LM, checked without torch or transformers: the feature keys,
the weights' precisions, the Hugging Face key paths' form, and whether a spec is a Hugging Face
model. Loading the model is ``gnnlm.models.load_base_lm``."""
from __future__ import annotations

from pathlib import Path

FEATURE_KEYS = ("final", "att")
# the precisions a Hugging Face base LM's weights may be loaded in (torch dtypes of these names)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_CONTEXT = 1024  # a model's own context can be 128k: the features' window is a setting
# the config fields that give a Hugging Face model's context, the first set one: learned or
# rotary positions, or MPT's ALiBi length; Bloom's ALiBi has none (features.context gives it)
CONTEXT_FIELDS = ("n_positions", "max_position_embeddings", "max_seq_len")


def no_context(lm: str) -> str:
    """The error of a base LM whose positions have no length (ALiBi: Bloom) when no
    ``features.context`` says how long its windows are."""
    return (f"features.context is not set and {lm} has no context length of its own (ALiBi "
            f"positions, any length): set features.context, the tokens each window reads "
            f"(e.g. {DEFAULT_CONTEXT}).")


def is_hf(spec: str) -> bool:
    """Whether ``spec`` names a Hugging Face model (``hf:`` or a folder with config.json)."""
    return spec.startswith("hf:") or (Path(spec) / "config.json").is_file()


def check_key_path(path: str, field: str) -> None:
    module, _, side = path.rpartition(":")
    if not module or side not in ("input", "output"):
        raise ValueError(f"{field} must be '<module path>:input' or '<module path>:output' "
                         f"(e.g. model.layers.-1.mlp:input), got {path!r}.")


def check_keys(keys: dict[str, str]) -> None:
    """``base_lm.keys`` names only the feature keys, each as ``<module path>:input|output``."""
    unknown = sorted(set(keys) - set(FEATURE_KEYS))
    if unknown:
        raise ValueError(f"base_lm.keys names {unknown}: the keys are {list(FEATURE_KEYS)}.")
    for key, path in keys.items():
        check_key_path(path, f"base_lm.keys.{key}")
