"""The ``gnnlm`` command: LightningCLI for fit/validate/test/predict, plus the pipeline commands.

    gnnlm fit -c configs/trainer/cpu.yaml -c configs/wikitext2/base_lm.yaml -c ..._cpu.yaml
    gnnlm pipeline -c configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml
    gnnlm sweep    -c ... (the same pipeline configs)
    gnnlm explain  -c ... --text "In 2000 Boulter had a guest @-@"
    gnnlm score    runs/wikitext2-cpu --file my.txt
    gnnlm generate runs/wikitext2-cpu --prompt "The game was" --row gnn+knn
    gnnlm reproduce runs/wikitext2 --decode gnn+knn --json served.json

A failure prints one line, ``gnnlm <command>: error: <what was wrong and what to do>``, and
exits with status 2; ``--debug`` (anywhere on the command line) shows the traceback instead.
SIGTERM or SIGINT stops a command within seconds (``gnnlm.utils.stopping``): one line,
``gnnlm pipeline: stopped by SIGTERM at <stage>; rerun to resume`` (``after <stage>`` between two
stages), and status 143 (SIGINT: 130).
"""
from __future__ import annotations

import os
import re
import sys
import traceback

from gnnlm.lit import LIGHTNING_COMMANDS
from gnnlm.utils.stopping import Stopped, errors_as_stop, handling_stop_signals

USAGE = """usage: gnnlm COMMAND [-c CONFIG ...] [--section.field=value ...] [--debug]

Retrieval-augmented language modelling: GNN-LM, kNN-LM and SPALM.

commands:
  pipeline   every stage, cached, then the table: writes <workdir>/{tokens,features,index,
             neighbors,knn_cache,pq,models,reports/<name>} (results.json, results.md, plots)
  sweep      the kNN-LM λ x T x k grid from cached scores: writes <workdir>/reports/<name>/sweep/
             (sweep.csv, sweep.md, sweep.json, the heatmap) and an offline W&B run
  explain    the train contexts a text retrieves: prints them, writes nothing
  verify     gnnlm verify WORKDIR: every artifact's files against its manifest (sizes, sha256);
             one line per artifact, a summary, exit status 2 naming each bad file
  score      gnnlm score WORKDIR --text TEXT | --file FILE [--rows ROW ...] [--json]: any
             text's perplexity under each row of a built work directory; writes nothing
  generate   gnnlm generate WORKDIR --prompt TEXT --row ROW [--max_new_tokens N] [--greedy |
             --temperature T --top_k K --top_p P] [--seed S] [--show-retrieval]: a
             continuation with retrieval; writes nothing
  reproduce  gnnlm reproduce WORKDIR [--rows ROW ...] [--decode ROW ...] [--positions N]
             [--json OUT]: the report's test scores served on this machine (every row's score,
             the first N prefixes' decoding), against those the report stored; writes only OUT
  fit        train a model (LightningCLI): a base LM, or a head on a pipeline's work directory;
             writes checkpoints and logs under trainer.default_root_dir (unset: under
             <data workdir>/logs/<model class>)
  validate, test, predict
             LightningCLI's: evaluate a checkpoint (--ckpt_path)

Help: `gnnlm pipeline --help` (and sweep, explain) lists the sections of a pipeline config, one
line each, and `--help=SECTION` a section's fields; `gnnlm fit --help` is LightningCLI's (every
trainer, model and data option; `--model.help CLASS` for one model's). Config paths, given with
-c or listed in a pipeline config, are resolved against the current directory: run gnnlm from
the repository root. Each YAML in configs/ starts with the command that runs it; README.md's
Setup and Troubleshooting sections cover installing and the common errors. --debug shows the
traceback of an error."""


def default_wandb_offline() -> None:
    """W&B stays offline (no account, no network) unless the user is logged in or says so."""
    netrc = os.path.expanduser("~/.netrc")
    logged_in = os.environ.get("WANDB_API_KEY") or (
        os.path.isfile(netrc) and "api.wandb.ai" in open(netrc).read())
    if not logged_in:
        os.environ.setdefault("WANDB_MODE", "offline")




def config_files(words: list[str]) -> list[str]:
    """The files a command line gives with ``-c``/``--config`` (not inline YAML strings)."""
    given = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-c", "--config")]
    given += [w.split("=", 1)[1] for w in words if w.startswith(("-c=", "--config="))]
    return [g for g in given if "\n" not in g and not g.lstrip().startswith(("{", "["))]


def check_command_line(command: str, words: list[str]) -> None:
    """Refuse an unknown command, and a ``-c`` file that is missing or is not YAML, naming
    the file (jsonargparse would say ``"<unicode string>"``, and for a relative path not where
    it looked)."""
    if command not in COMMANDS and command not in LIGHTNING_COMMANDS and not command.startswith(
            "-"):
        raise ValueError(f"unknown command {command!r}: the commands are "
                         f"{', '.join([*COMMANDS, *LIGHTNING_COMMANDS])} (gnnlm --help).")
    files = config_files(words)
    if files:
        from gnnlm.pipeline.config_files import config_text

        for path in files:
            config_text(path)


def _command(module: str, function: str = "main"):
    """A command whose module is imported only when it runs (keeps ``gnnlm --help`` fast)."""
    def run(args: list[str]) -> None:
        import importlib

        from gnnlm.utils.quiet import quiet_lightning

        quiet_lightning()
        getattr(importlib.import_module(module), function)(args)
    return run


def _config_command(name: str):
    """A command that reads a pipeline config (``gnnlm.pipeline.arguments``): its help is
    answered from the config's modules, before its own module (torch, faiss: seconds) is
    imported."""
    def run(args: list[str]) -> None:
        from gnnlm.pipeline.arguments import COMMANDS as CONFIG_COMMANDS
        from gnnlm.pipeline.arguments import answer_help
        from gnnlm.pipeline.config_help import asks_for_help

        if asks_for_help(args):
            answer_help(name, args)
        _command(CONFIG_COMMANDS[name][0])(args)
    return run


# commands besides LightningCLI's fit/validate/test/predict
COMMANDS = {"pipeline": _config_command("pipeline"),
            "sweep": _config_command("sweep"),
            "explain": _config_command("explain"),
            "verify": _command("gnnlm.workdir.verify"),
            "score": _command("gnnlm.inference.commands", "score_main"),
            "generate": _command("gnnlm.inference.commands", "generate_main"),
            "reproduce": _command("gnnlm.inference.reproduce")}


def error_line(err: BaseException) -> str:
    """The one line a user sees for an error: its message, without the traceback."""
    message = " ".join(str(err).split()) or type(err).__name__
    # jsonargparse reports a failure inside a class it builds as one of the "Union subtypes":
    # the user's error is the first of those, the rest is the parser's bookkeeping
    found = re.search(r"Errors: - (?:Problem with given class_path '[^']*': )?(.*?)"
                      r" - Expected a <class 'NoneType'>", message)
    if found:
        message = found.group(1)
    if isinstance(err, MemoryError):
        message = "out of memory: lower the batch size or the number of neighbours"
    elif isinstance(err, KeyboardInterrupt):
        message = "interrupted: a rerun resumes unfinished stages"
    return message


# commands whose rerun continues where a stopped run left off (finished artifacts and chunks,
# the training checkpoint)
RESUMING = ("pipeline",)


def stop_line(command: str, stop: Stopped) -> str:
    """The one line a run stopped by a signal prints: where it stopped, and that a rerun
    resumes (for the commands that do)."""
    return f"gnnlm {command}: {stop}" + ("; rerun to resume" if command in RESUMING else "")


def main(argv: list[str] | None = None) -> None:
    default_wandb_offline()
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words or os.environ.get("GNNLM_DEBUG") == "1"
    words = [w for w in words if w != "--debug"]
    if not words or words[0] in ("-h", "--help"):
        print(USAGE)
        return
    command = words[0]
    try:
        # an exit or error the signal caused (a library's SystemExit, a failing loader) is the stop
        with handling_stop_signals(), errors_as_stop():
            check_command_line(command, words[1:])
            if command in COMMANDS:
                COMMANDS[command](words[1:])
            else:
                from gnnlm.lit.cli import lightning_main

                lightning_main(words)
    except Stopped as stop:
        if debug:
            traceback.print_exc()
        print(stop_line(command, stop), file=sys.stderr)
        sys.exit(stop.exit_code)
    except SystemExit:
        raise  # argument parsers print their own short usage errors
    except (Exception, KeyboardInterrupt) as err:
        if debug:
            raise
        print(f"gnnlm {command}: error: {error_line(err)}", file=sys.stderr)
        print("(rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
