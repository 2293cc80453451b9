"""The corpus a pipeline run tokenizes, as its config names it (``gnnlm.pipeline.run_corpus``):
what the config's load checks before any model loads."""
from __future__ import annotations

import pytest
import torch

from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.run_corpus import run_corpus
from tests.conftest import CPU

pytestmark = pytest.mark.usefixtures("in_repo")
OWN = ["-c", "configs/examples/own_corpus/pipeline.yaml"]


def test_the_corpus_section_names_it(tmp_path):
    cfg = load_config([*OWN, f"--corpus.path={tmp_path / 'laws'}"])
    assert run_corpus(cfg) == ("laws", str(tmp_path / "laws"), None)
    smoke = load_config([*OWN, "-c", "configs/examples/own_corpus/smoke.yaml"])
    assert run_corpus(smoke) == ("wikitext-2", None, None)


def test_else_the_base_lm_config_s_data_section_with_its_defaults(tmp_path):
    assert run_corpus(load_config(CPU)) == ("wikitext-2", None, None)  # LMDataModule's default
    overlay = tmp_path / "lm.yaml"
    overlay.write_text("data:\n  init_args:\n    corpus: wikitext-103\n    data_dir: /corpora\n")
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/base_lm.yaml",
             "configs/wikitext2/base_lm_cpu.yaml", str(overlay)]
    cfg = load_config([*CPU, f"--base_lm.config=[{', '.join(chain)}]"])
    assert run_corpus(cfg) == ("wikitext-103", None, "/corpora")


def test_else_what_a_checkpoint_records_and_none_for_a_hub_model(tmp_path):
    ckpt = tmp_path / "lm.ckpt"
    torch.save({"state_dict": {}, "datamodule_hyper_parameters": {
        "_class_path": "datamodules.lm.LMDataModule", "corpus": "mine",
        "corpus_path": "/data/mine"}}, ckpt)
    assert run_corpus(load_config([*CPU, f"--base_lm.ckpt={ckpt}"])) == (
        "mine", "/data/mine", None)
    assert run_corpus(load_config([*CPU, "--base_lm.ckpt=hf:gpt2"])) is None
