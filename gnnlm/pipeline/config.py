"""Loading a pipeline config: ``PipelineConfig``, the sections of ``gnnlm.pipeline.settings``
with the stages a run rebuilds, and the parser that reads a pipeline YAML into it and checks it.

``load_config`` refuses, with one message each, unknown fields (jsonargparse), settings out of
range (each section's dataclass checks its own), and settings that span several files
(``gnnlm.pipeline.config_checks``); with ``machine=True`` (``gnnlm pipeline``), GPU settings on a
machine without a GPU. ``check_built`` refuses a command that reads what the pipeline has not
built yet. Nothing here imports torch, faiss or transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gnnlm.pipeline.config_checks import check_contracts, check_machine
from gnnlm.pipeline.config_help import requested_help
from gnnlm.pipeline.dependencies import rebuild_set
from gnnlm.pipeline.settings import PipelineSettings
from gnnlm.workdir.manifests import is_complete


@dataclass
class PipelineConfig(PipelineSettings):
    # The settings, and which stages the run rebuilds: that takes the stage graph
    # (``gnnlm.pipeline.dependencies``), which reads the settings. The docstring is the
    # settings': the sections' help (``--help``, jsonargparse's) reads its ``Args``, and a class
    # does not inherit its docstring.
    __doc__ = PipelineSettings.__doc__

    def rebuilds(self, stage: str) -> bool:
        """Whether this run rebuilds this stage: ``--rebuild`` names it (``true`` or ``all``:
        every stage; a head by its row name, ``gnn``, ``spalm``, ..., or ``heads`` for all of
        them) or it reads one that is rebuilt (``gnnlm.pipeline.dependencies``)."""
        if isinstance(self.rebuild, bool):
            return self.rebuild
        return stage in rebuild_set(self)


def config_parser(prog: str = "gnnlm pipeline", description: Optional[str] = None):
    """The jsonargparse parser of a pipeline YAML (``-c``) and ``--section.field=value`` flags.

    ``--help`` lists the sections, one line each; ``--help=SECTION`` shows a section's fields
    and ``--help-all`` jsonargparse's own help, whose hundreds of generated lines cut each
    section's description at its first line."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    class PipelineParser(ArgumentParser):
        def parse_args(self, *args, **kwargs):
            import sys

            given = args[0] if args else kwargs.get("args")
            words = list(sys.argv[1:] if given is None else given)
            shown = requested_help(words, prog, description, PipelineConfig,
                                   options=lambda: self, help_all=self.format_help)
            if shown is not None:
                print(shown)
                raise SystemExit(0)
            return super().parse_args(*args, **kwargs)

    # errors are raised, not printed with the whole usage: the command prints one line
    parser = PipelineParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
                        help="a pipeline YAML; several -c are merged in order (overlays)")
    parser.add_class_arguments(PipelineConfig)
    return parser


def to_config(parser, namespace) -> PipelineConfig:
    init = parser.instantiate_classes(namespace)
    cfg = PipelineConfig(**{name: init[name] for name in PipelineConfig.__dataclass_fields__})
    check_contracts(cfg, [str(path) for path in namespace.get("config") or []])
    return cfg


def load_config(args: list[str], prog: str = "gnnlm pipeline",
                description: Optional[str] = None, machine: bool = False) -> PipelineConfig:
    """Parse ``-c CONFIG [-c OVERLAY ...] [--section.field=value ...]`` and check it
    (``machine``: also that this machine has the GPUs it asks for, see ``check_machine``)."""
    parser = config_parser(prog, description)
    cfg = to_config(parser, parser.parse_args(args))
    if machine:
        check_machine(cfg)
    return cfg


def check_built(command: str, args: list[str], folders: list[Path]) -> None:
    """Refuse, before anything is written, a command that reads artifact ``folders`` which
    ``gnnlm pipeline`` has not built (yet), naming the pipeline command, with the same configs
    ``args``, that builds them."""
    missing = [Path(f) for f in folders if not is_complete(f)]
    if not missing:
        return
    import shlex

    first = missing[0]
    partial = first.with_name(first.name + ".partial")
    state = (f"{first} is unfinished ({partial} holds its build so far)" if partial.exists()
             else f"{first} is not built yet")
    raise FileNotFoundError(f"`{command}` reads what `gnnlm pipeline` builds, and {state}: run "
                            f"`{shlex.join(['gnnlm', 'pipeline', *args])}` first (the same "
                            f"configs), then `{command}` again.")
