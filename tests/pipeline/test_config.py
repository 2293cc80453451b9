"""gnnlm.pipeline.config: settings are checked when a pipeline config loads, before any work."""
from __future__ import annotations

import re

import pytest

from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.config_files import merged_yaml
from gnnlm.pipeline.fit_configs import check_fit_configs
from tests.conftest import CPU

pytestmark = pytest.mark.usefixtures("in_repo")


def test_overlays_merge_key_by_key():
    cfg = load_config(CPU)
    assert (cfg.name, cfg.neighbors.K, cfg.features.context) == ("wikitext2-cpu", 128, 128)
    assert cfg.knn.keys == ["final"] and cfg.knn.metric == "cos"        # overlay, base
    assert cfg.heads()["gnn"][-1] == "configs/wikitext2/gnnlm_cpu.yaml"
    merged = merged_yaml(cfg.heads()["gnn"])
    assert merged["trainer"]["accelerator"] == "cpu"                     # the trainer preset
    assert merged["model"]["init_args"]["num_layers"] == 3               # the base
    assert merged["data"]["init_args"]["graph"]["k"] == 16               # the overlay


@pytest.mark.parametrize("flag,message", [
    ("--knn.lambda_=1.5", r"λ \(knn.lambda_\) must lie in \[0, 1\] \(got \[1.5\]\)"),
    ("--knn.temperature=-0.1", r"must be a finite number > 0 \(got \[-0.1\]\)"),
    ("--knn.k=1000", r"k = 1000 neighbours but neighbors.K = 128 are stored"),
    ("--knn.metric=dot", r"metric must be one of \('cos', 'ip', 'l2'\) \(got 'dot'\)"),
    ("--neighbors.K=0", r"neighbors.K must be >= 1 \(got 0\)"),
    ("--copy_report_to=README.md", r"copy_report_to = README.md is a file: name a folder"),
    # every count is refused at load when it is not positive, not after hours of work
    ("--corpus.tokenizer.max_vocab=-1", r"tokenizer.max_vocab must be >= 3 \(<eos>, <unk> "
                                        r"and at least one word\).*\(got -1\)"),
    ("--corpus.tokenizer.max_vocab=2", r"tokenizer.max_vocab must be >= 3"),
    ("--corpus.tokenizer.vocab_size=0", r"tokenizer.vocab_size must be >= 1 \(got 0\)"),
    ("--features.max_tokens={valid: 0}", r"features.max_tokens.valid must be >= 1 \(got 0\): "
                                         r"leave the split out for all of it"),
    ("--features.max_tokens={vaild: 10}", r"features.max_tokens names 'vaild': the splits are"),
    ("--pq.m=0", r"pq.m \(bytes per vector\) must be >= 1, or null for d/4 \(got 0\)"),
    ("--pq.train_sample=-5", r"pq.train_sample must be >= 1 \(got -5\)"),
    ("--pq.chunk=0", r"pq.chunk must be >= 1 \(got 0\)"),
    ("--ablations.eval_tokens=0", r"ablations.eval_tokens must be >= 1, or null"),
    ("--neighbors.batch_size=-1", r"neighbors.batch_size must be >= 1 \(got -1\)"),
    ("--neighbors.train_queries=0", r"neighbors.train_queries must be >= 1"),
    ("--index.recall_queries=-1", r"index.recall_queries must be >= 0 \(got -1\)"),
    ("--features.context=-1", r"features.context must be >= 2 \(got -1\)"),
    ("--features.stride=0", r"features.stride \(tokens between window starts\) must be >= 1"),
    ("--features.batch_size=0", r"features.batch_size must be >= 1 \(got 0\)"),
    ("--knn.ks=[8,0]", r"knn.ks and knn.k must be >= 1"),
])
def test_bad_settings_are_refused_at_load(flag, message):
    with pytest.raises((ValueError, SystemExit)) as info:
        load_config([*CPU, flag])
    text = str(info.value) if info.type is ValueError else str(info.value.__context__)
    assert re.search(message, text), text


def test_head_configs_must_read_the_neighbours_the_pipeline_builds(tmp_path):
    """Checked on each head's config as LightningCLI parses it, before any stage runs."""
    overlay = tmp_path / "l2.yaml"
    overlay.write_text("data:\n  init_args:\n    metric: l2\n")
    gnn = ["configs/trainer/cpu.yaml", "configs/wikitext2/gnnlm.yaml",
           "configs/wikitext2/gnnlm_cpu.yaml", str(overlay)]
    with pytest.raises(ValueError, match=r"data.metric = 'l2'.*knn.metric = 'cos'"):
        check_fit_configs(load_config([*CPU, f"--gnn.config={gnn}"]))
    with pytest.raises(ValueError, match=r"train_tokens = 350000 positions but only the first "
                                         r"neighbors.train_queries = 5000"):
        check_fit_configs(load_config([*CPU, "--neighbors.train_queries=5000"]))
    with pytest.raises(ValueError, match=r"keeps k = 128 neighbours per token \(graph.k = 16, "
                                         r"eval_ks \[16, 32, 64, 128\], k_schedule \[8, 16\]\) but "
                                         r"neighbors.K = 4 "
                                         r"are stored: lower them to at most 4, or raise "
                                         r"neighbors.K.$"):
        check_fit_configs(load_config([*CPU, "--neighbors.K=4", "--knn.ks=[4]"]))
    # an evaluation k above the K stored (the WikiText-2 config on a small corpus's pipeline)
    with pytest.raises(ValueError, match=r"keeps k = 128 neighbours per token \(eval_ks "
                                         r"\[128\]\) but neighbors.K = 64 are stored"):
        check_fit_configs(load_config([*CPU, "--neighbors.K=64", "--knn.ks=[8]"]))


def test_a_missing_head_config_is_refused():
    with pytest.raises(FileNotFoundError, match="configs/nowhere.yaml does not exist"):
        load_config([*CPU, "--spalm.config=configs/nowhere.yaml"])


@pytest.mark.parametrize("overlay,key", [
    ("data:\n  init_args:\n    batch_size: 0\n", "data.init_args.batch_size = 0"),
    ("model:\n  init_args:\n    n_layer: -1\n", "model.init_args.n_layer = -1"),
    ("data:\n  init_args:\n    eval_stride: 0\n", "data.init_args.eval_stride = 0"),
])
def test_a_fit_config_with_a_count_that_is_not_positive_is_refused(overlay, key, tmp_path):
    (tmp_path / "bad.yaml").write_text(overlay)
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/base_lm.yaml",
             str(tmp_path / "bad.yaml")]
    with pytest.raises(ValueError) as refused:
        load_config([*CPU, f"--base_lm.config=[{','.join(chain)}]"])
    assert str(refused.value) == (f"The `gnnlm fit` config {' + '.join(chain)} sets {key}: it "
                                  f"must be >= 1.")
