"""Every YAML in configs/ starts with the command that runs it, and that command works: pipeline
configs parse and pass their cross-file checks, ``gnnlm fit`` configs (bases with their overlays)
instantiate trainer, model and data, and sweep configs are W&B sweep definitions."""
from __future__ import annotations

import re
import shlex

import pytest
import pytorch_lightning as pl
import yaml

from gnnlm.lit.cli import GnnlmCLI
from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.config_files import merged_texts, merged_yaml, yaml_list
from gnnlm.pipeline.fit_configs import check_fit_configs
from gnnlm.workdir.rows import HEAD_CONFIGS, LEARNED_WDS
from tests.conftest import REHEARSAL_SIZE_OVERLAYS, REPO, data_dir, yaml_leaves
from tests.rehearsal import REHEARSAL_OTHER_CHANGES, REHEARSAL_SIZE_FIELDS, undeclared_changes

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
def test_fit_configs_instantiate(chain, workdir, wikitext_tokens, monkeypatch, tmp_path):
    """Data modules on frozen features read the test pipeline's artifacts; LM data modules
    tokenize into the session's WikiText-2 folder (the test LM into the pipeline's own, the
    GPU rehearsal's LM, with a vocabulary of its own, into a fresh one)."""
    monkeypatch.chdir(REPO)
    merged = {}
    for f in chain:
        merged.update(yaml.safe_load((REPO / f).read_text()).get("data") or {})
    data_class = merged["class_path"]
    target = wikitext_tokens.path.parent if data_class.endswith("LMDataModule") else workdir
    if data_class.endswith("LMDataModule") and any("tests/" in f for f in chain):
        target = workdir  # the test LM's own (smaller) vocabulary lives there
        if any(f.startswith(REHEARSAL_SIZE_OVERLAYS) for f in chain):
            target = tmp_path
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


# -- the GPU table's rehearsal (configs/tests/gpu_rehearsal.yaml) ------------------------------
GPU_PIPELINE = "configs/wikitext2/pipeline.yaml"
REHEARSAL = "configs/tests/gpu_rehearsal.yaml"
# what the rehearsal may change in pipeline.yaml: sizes (and its own name and work directory)
REHEARSAL_PIPELINE_FIELDS = {("name",), ("workdir",), ("features", "context"),
                             ("features", "stride"), ("features", "max_tokens"),
                             ("index", "factory"), ("index", "train_sample"),
                             ("index", "recall_queries"), ("neighbors", "K"),
                             ("neighbors", "train_queries"), ("knn", "ks"), ("pq", "m")}



def _sections(path: str) -> dict:
    return yaml.safe_load((REPO / path).read_text())


def test_the_gpu_rehearsal_trains_every_part_of_the_gpu_table_with_its_chain():
    """Each trained part of pipeline.yaml is trained by the rehearsal with the same YAMLs, one
    size overlay put right after the model's own YAML (before any row overlay)."""
    gpu, rehearsal = _sections(GPU_PIPELINE), _sections(REHEARSAL)
    trained = {s for s, v in gpu.items() if isinstance(v, dict) and v.get("config")}
    assert trained == {s for s, v in rehearsal.items() if isinstance(v, dict) and "config" in v}
    assert {"base_lm", "gnn", "spalm", "transformer", "transformer_xl", "spalm_xl",
            "spalm_xl_variant", "transformer_xl_scratch", "spalm_xl_scratch"} == trained
    for section in trained:
        chain, rehearsed = gpu[section]["config"], rehearsal[section]["config"]
        sized = [f for f in rehearsed if f.startswith(REHEARSAL_SIZE_OVERLAYS)]
        assert len(sized) == 1 and rehearsed.index(sized[0]) == 2, section
        assert [f for f in rehearsed if f != sized[0]] == chain, section


def test_the_gpu_rehearsal_changes_sizes_the_device_and_what_it_lists_only():
    """What the rehearsal overlays are sizes, the pipeline's and each fit YAML's, and the
    changes ``tests.rehearsal`` lists (the base LM's schedule); precision, time limits, workers,
    callbacks, the search backend, keys and options are pipeline.yaml's."""
    rehearsal = _sections(REHEARSAL)
    changed = {path for path in yaml_leaves({k: v for k, v in rehearsal.items()
                                         if not (isinstance(v, dict) and "config" in v)})}
    changed = {path[:2] if path[0] == "features" and path[1] == "max_tokens" else path
               for path in changed}
    assert changed <= REHEARSAL_PIPELINE_FIELDS, changed - REHEARSAL_PIPELINE_FIELDS
    overlays = sorted((REPO / REHEARSAL_SIZE_OVERLAYS).glob("*.yaml"))
    assert len(overlays) == 4
    for path in overlays:
        fields = set(yaml_leaves(_sections(str(path.relative_to(REPO)))))
        listed = REHEARSAL_SIZE_FIELDS | set(REHEARSAL_OTHER_CHANGES.get(path.stem, {}))
        assert fields <= listed, (path.name, fields - listed)
        assert _sections(str(path.relative_to(REPO)))["trainer"]["accelerator"] == "auto"
    # the searches of the GPU table, at slice size
    gpu = _sections(GPU_PIPELINE)
    assert gpu["neighbors"]["backend"] == "exact" and "backend" not in rehearsal["neighbors"]
    assert re.fullmatch(r"IVF\d+,PQ\d+x8np", rehearsal["index"]["factory"])
    assert re.fullmatch(r"IVF\d+,PQ\d+x8np", gpu["index"]["factory"])


REHEARSED_PARTS = ["base_lm", "gnn", "spalm", "transformer", "transformer_xl", "spalm_xl",
                   "spalm_xl_variant", "transformer_xl_scratch", "spalm_xl_scratch"]


def _rehearsal_configs(part: str) -> tuple[dict, dict, dict]:
    """A trained part's GPU chain merged, its rehearsal size overlay, and its rehearsal chain
    merged (what its fit reads)."""
    chain = _sections(REHEARSAL)[part]["config"]
    sized = [f for f in chain if f.startswith(REHEARSAL_SIZE_OVERLAYS)]
    return (merged_yaml([str(REPO / f) for f in _sections(GPU_PIPELINE)[part]["config"]]),
            _sections(sized[0]), merged_yaml([str(REPO / f) for f in chain]))


@pytest.mark.parametrize("part", REHEARSED_PARTS)
def test_each_rehearsed_part_departs_from_its_gpu_config_only_as_listed(part):
    """Each trained part's rehearsal config is its GPU config but for sizes, the device and the
    changes listed by part (``REHEARSAL_OTHER_CHANGES``, with both values)."""
    gpu, overlay, rehearsed = _rehearsal_configs(part)
    assert undeclared_changes(part, gpu, overlay, rehearsed) == []
    changed = {path for path, value in yaml_leaves(gpu).items()
               if yaml_leaves(rehearsed).get(path) != value} - REHEARSAL_SIZE_FIELDS
    assert changed == set(REHEARSAL_OTHER_CHANGES.get(part, {}))   # none listed in vain


def test_the_rehearsal_check_fails_on_a_change_it_does_not_list():
    """An overlay that also set the precision, another learning rate than the one listed, or a
    GPU config whose listed value moved: each is named (the check does not pass whatever the
    overlay sets)."""
    gpu, overlay, _ = _rehearsal_configs("base_lm")

    def changes(edit_overlay=None, edit_gpu=None) -> list[str]:
        table = merged_texts([yaml.safe_dump(gpu), yaml.safe_dump(edit_gpu or {})])
        sized = merged_texts([yaml.safe_dump(overlay), yaml.safe_dump(edit_overlay or {})])
        return undeclared_changes("base_lm", table, sized,
                                  merged_texts([yaml.safe_dump(table), yaml.safe_dump(sized)]))

    assert changes() == []
    assert changes({"trainer": {"precision": "32-true"}}) == [
        "trainer.precision is set by the overlay but listed nowhere",
        "trainer.precision: '32-true', not 'bf16-mixed'"]
    assert changes({"model": {"init_args": {"optim": {"lr": 0.01}}}}) == [
        "model.init_args.optim.lr: 0.01, not 0.005"]
    assert changes(edit_gpu={"model": {"init_args": {"optim": {"warmup_steps": 200}}}}) == [
        "model.init_args.optim.warmup_steps is 200 in the GPU config, listed as 300"]
