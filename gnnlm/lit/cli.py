"""``gnnlm fit/validate/test/predict``: LightningCLI with the links from data modules to models,
the progress callback every fit gets, and a ``--ckpt_path`` check. Imported only when such a
command runs (or the pipeline trains a part), so that ``gnnlm --help`` loads no Lightning.
"""
from __future__ import annotations

import contextvars
from argparse import ArgumentError
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

from gnnlm.lit import LIGHTNING_COMMANDS
from gnnlm.utils.quiet import quiet_lightning


class GnnlmCLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        # jsonargparse keeps the last parser in a context variable it sets and never resets
        # (``subclass_arg_parser``), and through the parser this CLI, its trainer and its model:
        # in a pipeline, a trained part (GNN-LM's window-state table, 25.7 GB of GPU memory at
        # the paper's shape) would outlive its stage until the next fit's parse replaced it.
        # Built in a copy of the context, the variable goes with the copy, and the CLI is freed
        # when its last user lets it go.
        contextvars.copy_context().run(super().__init__, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # every fit writes plain progress lines where its bar cannot be seen (a redirected log);
        # a forced callback, so a config's own `trainer.callbacks` list does not drop it
        from gnnlm.lit.progress_log import ProgressLog

        parser.add_lightning_class_args(ProgressLog, "progress_log")
        # What the model needs to know of its data flows from the data module to the model,
        # once, here: the model never reads the data module (a link is skipped when the data
        # module lacks the attribute or the model the argument).
        for name in ("vocab_size", "feature_dim",
                     "vocab_fingerprint",        # what the base LM's token ids mean
                     "retrieved", "stored_k"):   # SPALM: the k the data can serve
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}",
                                  apply_on="instantiate")
        # GNN-LM: the graphs' layout (their k stays the data module's)
        parser.link_arguments("data.graph_layout", "model.init_args.graph_layout",
                              apply_on="instantiate")
        # heads that run the base LM take the one their datastore was built with
        parser.link_arguments("data.base_lm", "model.init_args.base_lm", apply_on="instantiate")
        parser.link_arguments("data.base_lm_fingerprint", "model.init_args.base_lm_fingerprint",
                              apply_on="instantiate")
        parser.link_arguments("data.base_lm_options", "model.init_args.base_lm_options",
                              apply_on="instantiate")
        # the other way, when the config is parsed: the base LM's tokens are served as
        # Transformer-XL segments when the model carries memory (skipped where either lacks it)
        parser.link_arguments("model.init_args.memory_length", "data.init_args.memory_length",
                              apply_on="parse")

    def _command_config(self):
        """The parsed config of the command that runs (``fit``, ...), or the whole config when
        the CLI runs no command."""
        subcommand = self.config.get("subcommand")
        return self.config.get(subcommand) if subcommand else self.config

    def before_instantiate_classes(self) -> None:
        """A fit run alone writes its checkpoints and logs under its work directory,
        ``<data.init_args.workdir>/logs/<model class>``, unless ``trainer.default_root_dir``
        says where (``gnnlm pipeline`` gives ``<workdir>/logs/<part>``): the YAMLs need not
        restate the work directory."""
        config = self._command_config()
        if config is None or config.get("trainer.default_root_dir") is not None:
            return
        workdir = config.get("data.init_args.workdir")
        model = config.get("model.class_path")
        if workdir and model:
            config["trainer.default_root_dir"] = str(
                Path(workdir) / "logs" / model.rsplit(".", 1)[-1])

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        """The config's trainer, with the callback that hands the model the work directory's
        arrays it reads (``gnnlm.lit.datastore``): every command gets it, whatever the
        config's ``trainer.callbacks`` list says; and its rich progress bar an ``EpochBar``."""
        from gnnlm.lit.datastore import AttachDatastore

        trainer = super().instantiate_trainer(**kwargs)
        # (Lightning sets Trainer.callbacks in a connector, so its type does not declare it)
        trainer.callbacks.append(AttachDatastore())  # type: ignore[attr-defined]
        # Lightning's rich bar (its default, or a config's, settings kept) as ``EpochBar``:
        # no "Epoch 0/-2" when max_steps bounds training; the class adds no state of its own
        from pytorch_lightning.callbacks import RichProgressBar

        from gnnlm.lit.progress_log import EpochBar

        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if type(callback) is RichProgressBar:
                callback.__class__ = EpochBar
        return trainer

    def parse_arguments(self, parser, args) -> None:
        """Parse, then refuse a ``--ckpt_path`` of another model or data module than the config
        builds, before LightningCLI puts the checkpoint's model into the config (which would
        fail only inside the run, on an attribute the config's data module lacks)."""
        super().parse_arguments(parser, args)
        config = self._command_config()
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if ckpt_path and ckpt_path not in ("best", "last", "hpc", "registry"):
            import torch

            from gnnlm.workdir.checkpoints import check_trained_as, plain_classes

            def class_path(key: str) -> str | None:
                value = config.get(key)
                return getattr(value, "class_path", None) if value is not None else None

            check_trained_as(ckpt_path, class_path("model"), class_path("data"))
            # LightningCLI and the Trainer then load the checkpoint with weights_only=True: the
            # configuration classes saved in its hyper-parameters (e.g. the GNN-LM's graph
            # layout, imported by now with the classes the config names) are plain data
            torch.serialization.add_safe_globals(plain_classes())


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
        from gnnlm.lit.config_errors import unknown_key

        line = unknown_key(str(err))
        if line is not None:
            raise ValueError(line) from None
        raise
