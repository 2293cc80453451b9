"""The ``gnnlm`` command: LightningCLI for fit/validate/test/predict, plus the pipeline commands.

    gnnlm fit -c configs/trainer/cpu.yaml -c configs/wikitext2/base_lm.yaml -c ..._cpu.yaml
    gnnlm pipeline -c configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml
    gnnlm sweep    -c ... (the same pipeline configs)
    gnnlm explain  -c ... --text "In 2000 Boulter had a guest @-@"

A failure prints one line, ``gnnlm <command>: error: <what was wrong and what to do>``, and
exits with status 2; ``--debug`` (anywhere on the command line) shows the traceback instead.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from argparse import ArgumentError

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

USAGE = """usage: gnnlm COMMAND [-c CONFIG ...] [--section.field=value ...] [--debug]

Retrieval-augmented language modelling: GNN-LM, kNN-LM and SPALM.

commands:
  pipeline   every stage, cached, then the table: writes <workdir>/{tokens,features,index,
             neighbors,knn_cache,pq,heads,reports/<name>} (results.json, results.md, plots)
  sweep      the kNN-LM λ x T x k grid from cached scores: writes <workdir>/reports/<name>/sweep/
             (sweep.csv, sweep.md, sweep.json, the heatmap) and an offline W&B run
  explain    the train contexts a text retrieves: prints them, writes nothing
  verify     gnnlm verify WORKDIR: every artifact's files against its manifest (sizes, sha256);
             one line per artifact, a summary, exit status 2 naming each bad file
  fit        train a model (LightningCLI): a base LM, or a head on a pipeline's work directory;
             writes checkpoints and logs under trainer.default_root_dir
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


class _DropLines(logging.Filter):
    DROPPED = ("💡 Tip",                           # promotional tips
               "`weights_only` was not set")       # said when saving the full training state,
                                                   # which is meant; loading is weights-only

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.DROPPED)


def quiet_lightning() -> None:
    """Silence Lightning's promotional tips and the messages that are not true here."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                 "pytorch_lightning.trainer.connectors.checkpoint_connector"):
        logging.getLogger(name).addFilter(_DropLines())
    for message in (
            ".*tensorboardX.*",                     # the CSV logger is the intended default
            ".*sync_dist=True.*",                   # epoch metrics are reduced over ranks already
            ".*LightningCLI's args parameter.*",    # the pipeline runs the CLI from Python
            ".*isinstance\\(treespec, LeafSpec\\).*",
            ".*does not have many workers.*",       # two cores: loading in-process is intended
            ".*The number of training batches.*log_every_n_steps.*"):
        warnings.filterwarnings("ignore", message=message)


class GnnlmCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # every fit writes plain progress lines where its bar cannot be seen (a redirected log);
        # a forced callback, so a config's own `trainer.callbacks` list does not drop it
        from gnnlm.lit.progress_log import ProgressLog

        parser.add_lightning_class_args(ProgressLog, "progress_log")
        # Sizes flow from the data to the model (a link is skipped when a class lacks the key).
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size",
                              apply_on="instantiate")
        parser.link_arguments("data.feature_dim", "model.init_args.feature_dim",
                              apply_on="instantiate")
        # heads that run the base LM take the one their datastore was built with
        parser.link_arguments("data.base_lm", "model.init_args.base_lm", apply_on="instantiate")
        parser.link_arguments("data.base_lm_fingerprint", "model.init_args.base_lm_fingerprint",
                              apply_on="instantiate")
        parser.link_arguments("data.base_lm_options", "model.init_args.base_lm_options",
                              apply_on="instantiate")

    def parse_arguments(self, parser, args) -> None:
        """Parse, then refuse a ``--ckpt_path`` of another model or data module than the config
        builds, before LightningCLI puts the checkpoint's model into the config (which would
        fail only inside the run, on an attribute the config's data module lacks)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if ckpt_path and ckpt_path not in ("best", "last", "hpc", "registry"):
            from gnnlm.workdir.checkpoints import check_trained_as

            def class_path(key: str) -> str | None:
                value = config.get(key)
                return getattr(value, "class_path", None) if value is not None else None

            check_trained_as(ckpt_path, class_path("model"), class_path("data"))


def lightning_main(args: list[str] | None = None) -> GnnlmCLI:
    quiet_lightning()
    # a parse error is raised, not printed after LightningCLI's 50-line usage: `main` prints it
    # as the one line of every gnnlm error
    no_usage = {"exit_on_error": False}
    try:
        return GnnlmCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, args=args,
                        save_config_kwargs={"overwrite": True},
                        parser_kwargs={**no_usage, **{name: dict(no_usage) for name in
                                                      LIGHTNING_COMMANDS}})
    except ArgumentError as err:
        if str(err).startswith("the following arguments are required"):
            raise ValueError(f"{err}: give the configs that set them with -c, e.g. -c "
                             f"configs/trainer/cpu.yaml -c configs/wikitext2/base_lm.yaml "
                             f"(each YAML in configs/ starts with the command that runs it)."
                             ) from None
        raise


# LightningCLI's subcommands, run by ``lightning_main``
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


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
        from gnnlm.pipeline.config import config_text

        for path in files:
            config_text(path)


def _command(module: str):
    """A command whose module is imported only when it runs (keeps ``gnnlm --help`` fast)."""
    def run(args: list[str]) -> None:
        import importlib

        quiet_lightning()
        importlib.import_module(module).main(args)
    return run


# commands besides LightningCLI's fit/validate/test/predict
COMMANDS = {"pipeline": _command("gnnlm.pipeline.stages"),
            "sweep": _command("gnnlm.pipeline.sweep"),
            "explain": _command("gnnlm.pipeline.explain"),
            "verify": _command("gnnlm.workdir.verify")}


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
        check_command_line(command, words[1:])
        if command in COMMANDS:
            COMMANDS[command](words[1:])
        else:
            lightning_main(words)
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
