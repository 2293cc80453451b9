"""``GnnlmCLI`` (``gnnlm/lit/cli.py``): where a fit run alone writes when its YAMLs do not say."""
from __future__ import annotations

from pathlib import Path

from jsonargparse import Namespace

from gnnlm.lit.cli import GnnlmCLI


def parsed(default_root_dir=None, workdir="runs/my-corpus") -> GnnlmCLI:
    """A CLI as LightningCLI leaves it between parsing and building (nothing instantiated)."""
    cli = GnnlmCLI.__new__(GnnlmCLI)
    cli.subcommand = "fit"
    cli.config = Namespace(subcommand="fit", fit=Namespace(
        trainer=Namespace(default_root_dir=default_root_dir),
        model=Namespace(class_path="gnnlm.lit.gnn.GNNLM", init_args=Namespace()),
        data=Namespace(class_path="datamodules.graph.GraphDataModule",
                       init_args=Namespace(workdir=workdir))))
    return cli


def test_a_fit_run_alone_writes_under_its_work_directory_by_model_class():
    cli = parsed()
    cli.before_instantiate_classes()
    assert cli.config.fit.trainer.default_root_dir == str(Path("runs/my-corpus/logs/GNNLM"))


def test_a_given_default_root_dir_is_kept():
    cli = parsed(default_root_dir="/elsewhere/logs")
    cli.before_instantiate_classes()
    assert cli.config.fit.trainer.default_root_dir == "/elsewhere/logs"


def test_a_data_module_without_a_work_directory_leaves_lightning_s_default():
    cli = parsed(workdir=None)
    cli.before_instantiate_classes()
    assert cli.config.fit.trainer.default_root_dir is None
