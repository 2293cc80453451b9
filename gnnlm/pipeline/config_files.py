"""Reading config files: a ``gnnlm fit`` config given as one YAML or a list (a base and its
overlays), each file's text refused with one line naming it when it is missing or not YAML, and
several merged as LightningCLI merges them. Plain Python and yaml: the pipeline's config and its
checks read them, and so does the training that records what a trained part was trained with."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import yaml

YAMLs = Union[str, list[str], None]


def yaml_list(value: YAMLs) -> list[str]:
    """A ``gnnlm fit`` config: one YAML, or a base and its overlays."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def config_text(path: str | os.PathLike) -> str:
    """The text of a config file, refused with the file's name when it is missing, is not
    YAML or holds no settings: the YAML parser alone names neither the file nor, for a
    relative path, the folder it was looked for in (config paths are resolved against the
    current directory, not against the file that lists them)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"Config file {path} is a folder: give a YAML file.")
    if not path.is_file():
        if path.is_absolute():
            raise FileNotFoundError(f"Config file {path} does not exist: check the path.")
        raise FileNotFoundError(
            f"Config file {path} does not exist (paths are resolved against the current "
            f"directory, {os.getcwd()}): run gnnlm from the folder the path is relative to "
            f"(the repository root for configs/...), or give an absolute path.")
    try:
        text = path.read_text(encoding="utf-8")
        settings = yaml.safe_load(text)
    except UnicodeDecodeError as err:
        raise ValueError(f"Config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x}"
                         f" at offset {err.start}): save it as UTF-8.") from None
    except yaml.YAMLError as err:
        mark, start = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        context = getattr(err, "context", None)
        where = [f"line {m.line + 1}, column {m.column + 1}" for m in (mark,) if m]
        if context and start:
            where.append(f"{context} from line {start.line + 1}, column {start.column + 1}")
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ValueError(f"Config file {path} is not valid YAML: {problem}"
                         f"{' (' + '; '.join(where) + ')' if where else ''}. Fix the file at "
                         f"that line (YAML indents with spaces; quote a value holding ': ' or "
                         f"' #').") from None
    # jsonargparse would say only "Unexpected config:" of a file with nothing in it
    if settings is None:
        raise ValueError(f"Config file {path} is empty (or only comments): write its settings "
                         f"in it, or leave it out.")
    if not isinstance(settings, dict):
        raise ValueError(f"Config file {path} holds a YAML {type(settings).__name__}, not "
                         f"settings: a config maps sections to their values (`section:` lines, "
                         f"the values indented under them).")
    return text


def merged_yaml(paths: list[str]) -> dict:
    """The YAMLs merged in order (later files win, key by key), as LightningCLI reads them."""
    return merged_texts([config_text(path) for path in paths])


def merged_texts(texts: list[str]) -> dict:
    """``merged_yaml`` of YAML texts (e.g. as an older manifest recorded them)."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
                out.get(key), dict) else value
        return out

    result: dict = {}
    for text in texts:
        result = merge(result, yaml.safe_load(text) or {})
    return result
