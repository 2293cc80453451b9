"""Shared fixtures: where WikiText-2 lives, W&B offline, and small real-data work directories."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def data_dir() -> Path:
    return Path(os.environ.get("GNNLM_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def wikitext_root() -> Path:
    root = data_dir()
    if not (root / "wikitext-2" / "train.txt").is_file():
        pytest.fail(f"WikiText-2 not found under {root}: set GNNLM_DATA to the folder holding "
                    f"wikitext-2/ (CI has it at ../shared/data).")
    return root


@pytest.fixture(scope="session")
def wikitext_tokens(wikitext_root, tmp_path_factory):
    """The whole of WikiText-2, word level, tokenized once per session."""
    from gnnlm.tokens import build_tokens

    return build_tokens(tmp_path_factory.mktemp("wt2") / "tokens", "wikitext-2",
                        data_dir=str(wikitext_root))
