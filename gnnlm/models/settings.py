"""What a config names of a base LM, checked without torch or transformers: the feature keys,
the weights' precisions, the Hugging Face key paths' form, and whether a spec is a Hugging Face
model (a folder, a Hub name, or a GGUF file that transformers reads). Loading the model is
``gnnlm.models.load_base_lm``."""
from __future__ import annotations

from pathlib import Path

# which GGUF file a spec names is one rule with the tokenizer's (in the text layer, below);
# the models' and the pipeline's callers import gguf_file from here
from gnnlm.text.gguf_paths import (  # noqa: F401
    GGUF_SUFFIX,
    folder_ggufs,
    gguf_candidates,
    gguf_file,
)

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
    """Whether ``spec`` names a Hugging Face model: ``hf:``, a folder with config.json, or a GGUF
    file (``*.gguf``, or a folder of them without config.json), with or without the prefix."""
    return (spec.startswith("hf:") or (Path(spec) / "config.json").is_file()
            or bool(gguf_candidates(spec)))


def looks_like_folder(name: str) -> bool:
    """Whether a Hugging Face name is meant as a local folder: a path from the root, the home or
    the current directory, or more than the Hub's ``namespace/name``."""
    return name.startswith(("/", "~", ".")) or name.count("/") > 1 or "\\" in name


def check_hf_folder(spec: str, field: str = "base_lm.ckpt") -> None:
    """Refuse ``hf:<folder>`` when the folder is not there or holds no model, before anything
    runs: the Hub client would read the path as a repository id and answer "Repo id must be in
    the form 'repo_name' or 'namespace/repo_name'", which says nothing of the typo. A GGUF file
    must be there, and a folder of GGUF files must hold one, not several."""
    name = spec.removeprefix("hf:")
    folder = Path(name).expanduser()
    if folder.suffix.lower() == GGUF_SUFFIX and not folder.is_file():
        raise FileNotFoundError(
            f"{field} {spec}: there is no file {folder} (relative paths are resolved against "
            f"the current directory, {Path.cwd()}): give a GGUF file that exists (`make "
            f"smollm2` fetches SmolLM2-135M-Instruct into models/smollm2/).")
    if folder.is_dir():
        if (folder / "config.json").is_file():
            return
        ggufs = folder_ggufs(folder)
        if len(ggufs) > 1:
            raise ValueError(f"{field} {spec}: the folder {folder} holds {len(ggufs)} GGUF files "
                             f"({', '.join(p.name for p in ggufs)}): name the one to load.")
        if not ggufs:
            raise FileNotFoundError(
                f"{field} {spec}: the folder {folder} holds no config.json and no .gguf file, "
                f"so it is not a saved Hugging Face model: give the folder `save_pretrained` "
                f"wrote, a GGUF file, or a Hub name such as hf:gpt2.")
        return
    if folder.exists():
        if folder.suffix.lower() == GGUF_SUFFIX:
            return
        raise FileNotFoundError(f"{field} {spec}: {folder} is a file, not a model's folder: "
                                f"give the folder `save_pretrained` wrote, a GGUF file "
                                f"(*.gguf), or a Hub name such as hf:gpt2.")
    if looks_like_folder(name):
        raise FileNotFoundError(
            f"{field} {spec}: there is no folder {name} (relative paths are resolved against "
            f"the current directory, {Path.cwd()}): give the folder `save_pretrained` wrote, or "
            f"a Hub name such as hf:gpt2.")


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
