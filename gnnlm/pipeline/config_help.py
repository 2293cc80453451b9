"""The short ``--help`` of the commands that read a pipeline config, and ``--help=SECTION``.

jsonargparse's own help (``--help-all``) lists hundreds of generated lines and cuts each
section's description at its first line. The short help says what the command does and each
section in one line; a section's help shows its documentation and every field with its type,
default and meaning. Both read the config dataclasses' docstrings (Google style ``Args:``, which
jsonargparse shows too): ``PipelineConfig``'s ``Args`` are the sections' one-liners, each
section's ``Args`` its fields' meanings.
"""
from __future__ import annotations

import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Optional

HELP_WORDS = ("-h", "--help", "--help-all")


def asks_for_help(words: list[str]) -> bool:
    """Whether a command line asks for help, wherever on it: ``-h``, ``--help``,
    ``--help=SECTION``, ``--help-all``."""
    return any(word in HELP_WORDS or word.startswith("--help=") for word in words)


def requested_help(words: list[str], prog: str, description: Optional[str], config: type,
                   options: Callable[[], Any], help_all: Callable[[], str]) -> Optional[str]:
    """The help the first help word of a command line asks for, or ``None`` when it asks for
    none: ``--help=SECTION`` or ``--help SECTION`` a section's, ``--help-all`` the whole parser's
    (``help_all``), ``-h``/``--help`` the short help. ``options`` gives a parser that holds the
    command's own options (those besides the config's, listed by the short help); both are
    called only when needed, so that help needs no more than it shows."""
    named = sections(config)
    for i, word in enumerate(words):
        if word in HELP_WORDS or word.startswith("--help="):
            after = words[i + 1] if i + 1 < len(words) else ""
            section = (word.split("=", 1)[1] if "=" in word
                       else after if word == "--help" and after in named else None)
            return (help_all() if word == "--help-all"
                    else section_help(prog, section, config) if section is not None
                    else short_help(options(), prog, description, config))
    return None


def google_args(cls: type) -> tuple[str, dict[str, str]]:
    """A class docstring's description (the text before ``Args:``) and its ``Args`` entries,
    ``{name: meaning}``, each meaning on one line."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Args:" not in lines:
        return "\n".join(lines).strip(), {}
    start = lines.index("Args:")
    args: dict[str, str] = {}
    name = None
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith(" "):  # another section
            break
        entry = line.strip()
        if line.startswith("    ") and not line.startswith("     ") and ":" in entry:
            name, _, meaning = entry.partition(":")
            args[name.strip()] = meaning.strip()
        elif name is not None and entry:
            args[name] = f"{args[name]} {entry}"
    return "\n".join(lines[:start]).strip(), args


def sections(config: type) -> dict[str, str]:
    """A config's sections (its fields, in order) and the one line that says what each is for
    (its ``Args``)."""
    meanings = google_args(config)[1]
    return {spec.name: meanings.get(spec.name, "") for spec in fields(config)}


def _wrapped(text: str, indent: str = "", first: str = "") -> str:
    """Text re-flowed to the 100 columns of the code, never breaking a word."""
    text = " ".join(text.replace("``", "`").split())
    return textwrap.fill(text, 100, initial_indent=first or indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def short_help(parser: Any, prog: str, description: Optional[str], config: type) -> str:
    """``--help``: what the command does, each section in one line, how to see its fields."""
    named = sections(config)
    actions = [a for a in parser._actions if a.option_strings and a.dest.split(".")[0] not in
               {*named, "help", "config", "print_config"}]   # the command's own options
    own = [(", ".join(a.option_strings) + (f" {a.metavar or a.dest.upper()}" if a.nargs != 0
                                           else ""), a.help or "") for a in actions]
    usage = " ".join([f"{prog} -c CONFIG [-c OVERLAY ...] [--SECTION.FIELD=VALUE ...]",
                      *(flag if a.required else f"[{flag}]" for a, (flag, _) in zip(actions, own)),
                      "[--debug]"])
    paragraphs = (description or "").split("\n\n")
    lines = [_wrapped(usage, " " * (len(prog) + 8), "usage: "), "",
             *(_wrapped(p) + "\n" for p in paragraphs if p.strip()),
             "The sections of a pipeline config (keys of the YAML; on the command line "
             "--SECTION.FIELD=VALUE):"]
    # a name too long for the column takes two spaces more (its description stays on its line)
    lines += [_wrapped(text, " " * 20, f"  {name:<18}" if len(name) < 18 else f"  {name}  ")
              for name, text in named.items()]
    lines += ["", "options:",
              "  -c, --config CONFIG   a pipeline YAML; several -c merge in order (overlays); "
              "paths are",
              "                        resolved against the current directory",
              *(_wrapped(text, " " * 24, f"  {flag:<22}") for flag, text in own),
              "  --help=SECTION        a section's fields, types and defaults (e.g. "
              "--help=features)",
              "  --print_config        the merged config as YAML, then exit",
              "  --help-all            every field at once (jsonargparse's help)",
              "  --debug               the traceback of an error instead of its one line"]
    return "\n".join(lines)


def section_help(prog: str, name: str, config: type) -> str:
    """``--help=SECTION``: the section's purpose, its documentation and every field with its
    type, default and meaning (nested settings as ``tokenizer.kind``)."""
    named = sections(config)
    if name not in named:
        raise ValueError(f"{prog} has no section {name!r}: the sections are "
                         f"{', '.join(named)}.")
    spec = next(spec for spec in fields(config) if spec.name == name)
    cls = _dataclass_in(typing.get_type_hints(config)[name])
    lines = [f"{name}: {named[name]}", ""]
    if cls is None:  # a plain setting
        default = spec.default if spec.default is not MISSING else None
        lines += [f"  --{name}  {spec.type} = {default!r}"]
        return "\n".join(lines)
    description = google_args(cls)[0]
    lines += [_wrapped(p) + "\n" for p in description.split("\n\n") if p.strip()]
    lines += [f"Its fields (in a YAML under `{name}:`; on the command line "
              f"--{name}.FIELD=VALUE):"]
    for field_name, typ, default, meaning in _fields(cls):
        lines.append(_wrapped(f"{typ} = {default}", " " * 30, f"  {field_name:<26}  "))
        if meaning:
            lines.append(_wrapped(meaning, " " * 30))
    return "\n".join(lines)


def _dataclass_in(hint: Any) -> Optional[type]:
    """The config dataclass a field's type names (``X`` or ``Optional[X]``), if any."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint
    return next((arg for arg in typing.get_args(hint)
                 if isinstance(arg, type) and is_dataclass(arg)), None)


def _fields(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(name, type, default, meaning) of a config dataclass's fields, nested dataclasses
    expanded."""
    meanings = google_args(cls)[1]
    rows = []
    for spec in fields(cls):
        default = (spec.default_factory() if spec.default_factory is not MISSING
                   else spec.default)
        if is_dataclass(default) and not isinstance(default, type):
            rows += _fields(type(default), f"{prefix}{spec.name}.")
        else:
            rows.append((f"{prefix}{spec.name}", str(spec.type), repr(default),
                         meanings.get(spec.name, "")))
    return rows
