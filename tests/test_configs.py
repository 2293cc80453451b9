"""Every YAML in configs/ starts with the command that runs it, and that command works: pipeline
configs parse and pass their cross-file checks, ``gnnlm fit`` configs (bases with their overlays)
instantiate trainer, model and data, and sweep configs are W&B sweep definitions."""
from __future__ import annotations

import shlex

import pytest
import pytorch_lightning as pl
import yaml

from gnnlm.lit.cli import GnnlmCLI
from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.config_files import yaml_list
from gnnlm.pipeline.rows import HEAD_CONFIGS, LEARNED_WDS
from gnnlm.pipeline.training import check_fit_configs
from tests.conftest import REPO, data_dir

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def command(path) -> list[str]:
    return shlex.split(path.read_text().splitlines()[0].lstrip("# "))


PIPELINES = [p for p in CONFIGS if command(p)[:2] == ["gnnlm", "pipeline"]]
FITS = [p for p in CONFIGS if command(p)[:2] == ["gnnlm", "fit"]]
SWEEPS = [p for p in CONFIGS if p.parent.name == "sweeps"]


def config_files(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == "-c"]


def test_every_config_starts_with_the_command_that_runs_it():
    assert set(CONFIGS) == set(PIPELINES) | set(FITS) | set(SWEEPS)
    for path in PIPELINES + FITS:
        files = config_files(command(path)[2:])
        assert str(path.relative_to(REPO)) in files, path
        assert all((REPO / f).is_file() for f in files), path


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: str(p.relative_to(REPO)))
def test_pipeline_configs_parse(path, monkeypatch):
    """Each pipeline YAML parses with its command (overlays included), names head configs
    that exist and that each start with a command of their own, and each trained part's config
    parses as `gnnlm fit` parses it, each head's reading what the pipeline builds."""
    monkeypatch.chdir(REPO)
    cfg = load_config(command(path)[2:])
    check_fit_configs(cfg)
    fits = {str(p.relative_to(REPO)) for p in FITS}
    chains = [yaml_list(cfg.base_lm.config), yaml_list(cfg.ablations.memory_lm),
              *cfg.heads().values()]
    for chain in filter(None, chains):
        assert all((REPO / f).is_file() for f in chain), chain
        assert chain[-1] in fits, chain


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_configs_name_the_sweep_command(path):
    sweep = yaml.safe_load(path.read_text())
    assert {"method", "metric", "parameters", "command"} <= set(sweep)
    assert "sweep" in sweep["command"] and sweep["metric"]["name"] == "val/ppl"
    temperatures = sweep["parameters"]["knn.temperature"]["values"]
    assert min(temperatures) <= 0.01 <= max(temperatures)  # the cosine optimum is in the grid
    pipeline = config_files(sweep["command"])
    assert pipeline and all((REPO / f).is_file() for f in pipeline)
    assert max(sweep["parameters"]["knn.k"]["values"]) <= load_config(
        [a for f in pipeline for a in ("-c", str(REPO / f))]).neighbors.K


def fit_chains() -> list[list[str]]:
    """Every ``gnnlm fit`` chain: each fit YAML's own command, and each chain a pipeline names
    (read from the pipeline YAMLs merged in their commands' order)."""
    chains = {tuple(config_files(command(p)[2:])) for p in FITS}
    for path in PIPELINES:
        merged: dict = {}
        for f in config_files(command(path)[2:]):
            for section, value in (yaml.safe_load((REPO / f).read_text()) or {}).items():
                merged[section] = ({**merged.get(section, {}), **value}
                                   if isinstance(value, dict) else value)
        named = [merged.get(s, {}).get("config") for s in ("base_lm", *HEAD_CONFIGS)]
        named += [merged.get("ablations", {}).get("memory_lm"),
                  *merged.get(LEARNED_WDS, {}).get("configs", [])]
        chains |= {tuple(yaml_list(c)) for c in named if c}
    return [list(c) for c in sorted(chains)]


@pytest.mark.integration
@pytest.mark.parametrize("chain", fit_chains(), ids=lambda c: c[-1])
def test_fit_configs_instantiate(chain, workdir, wikitext_tokens, monkeypatch):
    """Data modules on frozen features read the test pipeline's artifacts; LM data modules
    tokenize into the session's WikiText-2 folder (the test LM into the pipeline's own)."""
    monkeypatch.chdir(REPO)
    merged = {}
    for f in chain:
        merged.update(yaml.safe_load((REPO / f).read_text()).get("data") or {})
    data_class = merged["class_path"]
    target = wikitext_tokens.path.parent if data_class.endswith("LMDataModule") else workdir
    if data_class.endswith("LMDataModule") and any("tests/" in f for f in chain):
        target = workdir  # the test LM's own (smaller) vocabulary lives there
    corpus = [(yaml.safe_load((REPO / f).read_text()).get("data") or {}).get("init_args", {})
              .get("corpus") for f in chain]
    corpus = [c for c in corpus if c][-1:]
    # a corpus this machine does not hold (WikiText-103) is swapped for WikiText-2: the test is
    # of the config's shape, and the WikiText-103 chain's own stages run in its own test
    swap = (["--data.init_args.corpus=wikitext-2"]
            if corpus and not (data_dir() / corpus[0]).exists() else [])
    cli = GnnlmCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                   subclass_mode_data=True, run=False,
                   args=[*(a for f in chain for a in ("-c", f)), *swap,
                         f"--data.init_args.workdir={target}",
                         "--trainer.accelerator=cpu", "--trainer.precision=32-true",
                         f"--trainer.default_root_dir={workdir.parent / 'instantiate'}"])
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size > 0
    if hasattr(cli.datamodule, "feature_dim"):
        assert cli.model.hparams.feature_dim == cli.datamodule.feature_dim
