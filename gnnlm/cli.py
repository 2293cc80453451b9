"""The ``gnnlm`` command: LightningCLI for fit/validate/test, plus the pipeline commands.

gnnlm fit -c configs/wikitext2/base_lm_cpu.yaml          # train a model (LightningCLI)
gnnlm test -c configs/wikitext2/base_lm_cpu.yaml --ckpt_path PATH
gnnlm pipeline -c configs/wikitext2/pipeline_cpu.yaml    # every stage, cached, then the table
gnnlm sweep -c configs/wikitext2/pipeline_cpu.yaml       # λ × T × k from cached scores
gnnlm explain -c configs/wikitext2/pipeline_cpu.yaml --text "..."   # retrieved contexts
"""
from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI


def default_wandb_offline() -> None:
    """W&B stays offline (no account, no network) unless the user is logged in or says so."""
    logged_in = os.environ.get("WANDB_API_KEY") or (
        os.path.isfile(os.path.expanduser("~/.netrc"))
        and "api.wandb.ai" in open(os.path.expanduser("~/.netrc")).read())
    if not logged_in:
        os.environ.setdefault("WANDB_MODE", "offline")


class GnnlmCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # Sizes flow from the data to the model (a link is skipped when a class lacks the key).
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size",
                              apply_on="instantiate")
        parser.link_arguments("data.feature_dim", "model.init_args.feature_dim",
                              apply_on="instantiate")
        # heads that run the base LM take the one their datastore was built with
        parser.link_arguments("data.base_lm", "model.init_args.base_lm", apply_on="instantiate")
        parser.link_arguments("data.base_lm_fingerprint", "model.init_args.base_lm_fingerprint",
                              apply_on="instantiate")


def lightning_main(args: list[str] | None = None) -> GnnlmCLI:
    return GnnlmCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                    subclass_mode_data=True, args=args,
                    save_config_kwargs={"overwrite": True})


def _command(module: str):
    """A command whose module is imported only when it runs (keeps ``gnnlm --help`` fast)."""
    def run(args: list[str]) -> None:
        import importlib

        importlib.import_module(module).main(args)
    return run


# commands besides LightningCLI's fit/validate/test/predict
COMMANDS = {"pipeline": _command("gnnlm.pipeline"), "sweep": _command("gnnlm.sweep"),
            "explain": _command("gnnlm.explain")}


def main(argv: list[str] | None = None) -> None:
    default_wandb_offline()
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in COMMANDS:
        COMMANDS[words[0]](words[1:])
    else:
        lightning_main(argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
