"""Every YAML in configs/ parses and instantiates (LightningCLI configs: trainer, model and data
objects; pipeline configs: the PipelineConfig; sweep configs: a W&B sweep definition)."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import yaml
from conftest import REPO

from gnnlm.cli import GnnlmCLI

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
LIGHTNING = [p for p in CONFIGS if "trainer" in yaml.safe_load(p.read_text())]
PIPELINES = [p for p in CONFIGS if p.read_text().startswith("# gnnlm pipeline")]
SWEEPS = [p for p in CONFIGS if p.parent.name == "sweeps"]


def test_every_config_is_covered_and_starts_with_its_command():
    assert set(CONFIGS) == set(LIGHTNING) | set(PIPELINES) | set(SWEEPS)
    for path in CONFIGS:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and ("gnnlm " in first or "wandb sweep" in first), path


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: str(p.relative_to(REPO)))
def test_pipeline_configs_parse(path, monkeypatch):
    """Each pipeline YAML parses with the command its first line gives (overlays included)."""
    from gnnlm.pipeline import load_config

    monkeypatch.chdir(REPO)
    command = path.read_text().splitlines()[0].lstrip("# ").split()
    assert command[:2] == ["gnnlm", "pipeline"] and str(path.relative_to(REPO)) in command
    cfg = load_config(command[2:])
    cfg.knn.grid()
    referenced = [cfg.base_lm.config, cfg.gnn.config, cfg.spalm.config,
                  cfg.spalm_finetune.config, cfg.ablations.memory_lm, *cfg.learned_wds.configs]
    for config in filter(None, referenced):
        assert (REPO / config).is_file(), config


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_configs_name_the_sweep_command(path):
    sweep = yaml.safe_load(path.read_text())
    assert {"method", "metric", "parameters", "command"} <= set(sweep)
    assert "sweep" in sweep["command"] and sweep["metric"]["name"] == "val/ppl"


@pytest.mark.integration
@pytest.mark.parametrize("path", LIGHTNING, ids=lambda p: str(p.relative_to(REPO)))
def test_lightning_configs_instantiate(path, workdir, wikitext_tokens):
    """Data modules on frozen features read the test pipeline's artifacts; LM data modules
    tokenize into the session's WikiText-2 folder."""
    data_class = yaml.safe_load(path.read_text())["data"]["class_path"]
    target = wikitext_tokens.path.parent if data_class.endswith("LMDataModule") else workdir
    if data_class.endswith("LMDataModule") and "tests" in path.parts:
        target = workdir  # the test LM's own (smaller) vocabulary lives there
    cli = GnnlmCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                   subclass_mode_data=True, run=False,
                   args=["-c", str(path), f"--data.init_args.workdir={target}",
                         "--trainer.accelerator=cpu",  # GPU configs instantiate on CPU too
                         f"--trainer.default_root_dir={workdir.parent / 'instantiate'}"])
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size > 0
    if hasattr(cli.datamodule, "feature_dim"):
        assert cli.model.hparams.feature_dim == cli.datamodule.feature_dim
