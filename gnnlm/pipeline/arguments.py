"""The command lines of ``gnnlm pipeline``, ``sweep`` and ``explain``, the commands that read a
pipeline config, and their help from light modules only, so that it answers at once.

The commands' own modules load torch, faiss and transformers when imported (seconds); their help
needs none of that: the sections and fields come from the config's dataclasses
(``config_help``), the command's description is its ``main``'s docstring, read from the module's
source instead of importing it, and its options besides the config's are declared here, where
the command's parser takes them from too. ``gnnlm.cli`` answers a help request with
``answer_help`` before it imports the command's module; the text is the one the command's own
parser prints, since both come from ``config_help.requested_help``.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Optional

from gnnlm.pipeline.config import PipelineConfig, config_parser
from gnnlm.pipeline.config_help import requested_help


def explain_options(parser: Any) -> Any:
    """``gnnlm explain``'s options besides the pipeline config's (``parser``, returned)."""
    parser.add_argument("--text", type=str, required=True, help="the input context")
    parser.add_argument("--top", type=int, default=3, help="retrieved contexts to show")
    return parser


# each command's module (whose ``main`` runs it) and the options it adds to the config's
COMMANDS: dict[str, tuple[str, Optional[Callable[[Any], Any]]]] = {
    "pipeline": ("gnnlm.pipeline.stages", None),
    "sweep": ("gnnlm.pipeline.sweep", None),
    "explain": ("gnnlm.inference.explain", explain_options)}


def description(module: str, function: str = "main") -> Optional[str]:
    """``function``'s docstring in ``module``, read from the module's source without running it
    (running it imports torch); ``None`` when it has none."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ImportError(f"{module} has no Python source to read {function}'s docstring from")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found = next((node for node in tree.body if isinstance(node, ast.FunctionDef)
                  and node.name == function), None)
    if found is None:
        raise ImportError(f"{module} has no function {function}")
    return ast.get_docstring(found, clean=False)  # as ``function.__doc__``: the parser's text


def answer_help(command: str, args: list[str]) -> NoReturn:
    """Print the help ``args`` ask for (``config_help.asks_for_help``) of ``gnnlm COMMAND`` and
    exit, as the command's parser would, without importing the command's module; only
    ``--help-all``, jsonargparse's help of the whole parser, builds that parser."""
    module, own = COMMANDS[command]
    prog, text = f"gnnlm {command}", description(module)

    def options() -> argparse.ArgumentParser:  # the short help lists the command's own options
        parser = argparse.ArgumentParser(prog=prog, add_help=False)
        return own(parser) if own is not None else parser

    def help_all() -> str:
        parser = config_parser(prog, text)
        if own is not None:
            own(parser)
        return parser.format_help()

    shown = requested_help(args, prog, text, PipelineConfig, options, help_all)
    if shown is None:
        raise ValueError(f"{prog} {' '.join(args)} asks for no help (-h, --help[=SECTION], "
                         f"--help-all)")
    print(shown)
    raise SystemExit(0)
