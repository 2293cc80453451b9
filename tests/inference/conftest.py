"""Work directories of Hugging Face base LMs, built once per session through the pipeline on a
WikiText-2 slice (``configs/tests/hf_family.yaml``, kNN-LM on the ``final`` key, no GNN-LM): a
tiny random-weight GPT-2 (its tokenizer adds no BOS), and SmolLM2-135M read from its GGUF file
(skipped, naming ``make smollm2``, when the file is absent)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, wikitext_slice

SMOLLM2 = REPO / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def build(model: str, corpus: Path, work: Path, name: str, *extra: str) -> Path:
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import run

    run(load_config(["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt={model}",
                     f"--corpus.path={corpus}", f"--workdir={work}", f"--name={name}",
                     "--knn.keys=[final]", "--gnn.config=null", *extra]))
    return work


@pytest.fixture(scope="session")
def gpt2_work(wikitext_root, tmp_path_factory) -> SimpleNamespace:
    """A tiny GPT-2 (random weights, a 512-token BPE) and its work directory: ``folder`` (the
    model as the Hub has them, with its tokenizer) and ``work``."""
    from tests.families import FAMILIES, save_family, train_bpe

    root = tmp_path_factory.mktemp("hf-gpt2")
    bpe = train_bpe((wikitext_root / "wikitext-2" / "train.txt").read_text()[:300_000])
    folder = save_family(FAMILIES["gpt2"], bpe, root / "gpt2")
    corpus = wikitext_slice(wikitext_root, root / "slice",
                            {"train": 80_000, "valid": 20_000, "test": 20_000})
    return SimpleNamespace(folder=folder,
                           work=build(f"hf:{folder}", corpus, root / "work", "gpt2"))


@pytest.fixture(scope="session")
def smollm2_work(wikitext_root, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's GGUF as the base LM of a small work directory (context 128)."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2.relative_to(REPO)} is not there: run `make smollm2`.")
    root = tmp_path_factory.mktemp("smollm2")
    corpus = wikitext_slice(wikitext_root, root / "slice",
                            {"train": 20_000, "valid": 20_000, "test": 20_000})
    return build(str(SMOLLM2), corpus, root / "work", "smollm2", "--features.context=128",
                 "--features.stride=64",
                 "--features.max_tokens={train: 2000, valid: 400, test: 200}")
