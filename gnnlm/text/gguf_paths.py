"""Which GGUF file (llama.cpp's one-file format: weights, config and tokenizer together) a path
names: one rule for the base LM's weights (``gnnlm.models.settings``, ``gnnlm.models.hf``) and
its tokenizer (``gnnlm.text.tokens``), so that both are read from the same file.

A path names a GGUF file when it ends in ``.gguf`` (a file, there or not), or when it is a
folder that is not a saved Hugging Face model (no config.json) and holds ``.gguf`` files; the
``hf:`` prefix of a base LM spec and a leading ``~`` are read as a path's. A folder with
config.json is a Hugging Face model even beside a GGUF. Torch-free and without transformers
(the text layer, below the models).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

GGUF_SUFFIX = ".gguf"


def spec_path(spec: str) -> Path:
    """The local path a spec names (``[hf:]<path>``, ``~`` expanded)."""
    return Path(spec.removeprefix("hf:")).expanduser()


def folder_ggufs(folder: Path) -> list[Path]:
    """The ``.gguf`` files in ``folder``, sorted by name."""
    return sorted(p for p in folder.glob("*") if p.suffix.lower() == GGUF_SUFFIX and p.is_file())


def gguf_candidates(spec: str) -> list[Path]:
    """The GGUF files ``spec`` may mean: itself when it ends in ``.gguf`` (whether it is there
    or not), else the ``.gguf`` files of a folder without config.json (none, one or several);
    empty when it names no GGUF (a model folder, a Hub name, a checkpoint, a tokenizer.json)."""
    path = spec_path(spec)
    if path.suffix.lower() == GGUF_SUFFIX:
        return [path]
    if path.is_dir() and not (path / "config.json").is_file():
        return folder_ggufs(path)
    return []


def gguf_file(spec: str) -> Optional[Path]:
    """The GGUF file ``spec`` names (``[hf:]<file>.gguf``, or ``[hf:]<folder>`` holding exactly
    one ``.gguf`` and no config.json), or None when it names none, a file that is not there or
    several (each caller refuses those in its own words)."""
    files = gguf_candidates(spec)
    return files[0] if len(files) == 1 and files[0].is_file() else None
