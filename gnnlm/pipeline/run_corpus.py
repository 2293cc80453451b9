"""The corpus a pipeline run tokenizes, checked when its config loads (``gnnlm pipeline``),
before any model loads: a run whose corpus is neither on this machine nor downloadable stops
at once, not after its base LM has loaded and the Hub's client has retried for half a minute.

The corpus is where the tokens stage and the base LM's training take it from: the pipeline's
``corpus:`` section; else, for a base LM the pipeline trains, its ``gnnlm fit`` config's data
section (``LMDataModule``'s arguments, with its defaults); else what a ``gnnlm fit`` checkpoint
records. A Hugging Face base LM without a ``corpus:`` section names none (the run stops at
load for that already).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gnnlm.models.settings import is_hf
from gnnlm.pipeline.config_files import merged_yaml, yaml_list
from gnnlm.text.corpus import check_corpus

if TYPE_CHECKING:
    from gnnlm.pipeline.settings import PipelineSettings

# LMDataModule's corpus arguments and their defaults (datamodules.lm, not imported: torch)
DEFAULTS = {"corpus": "wikitext-2", "corpus_path": None, "data_dir": None}


def run_corpus(cfg: PipelineSettings) -> Optional[tuple[str, Optional[str], Optional[str]]]:
    """The corpus the run reads: ``(name, path, data_dir)``; None when the config names none."""
    if cfg.corpus is not None:
        return cfg.corpus.name, cfg.corpus.path, cfg.corpus.data_dir
    ckpt = cfg.base_lm.ckpt
    if ckpt is None:
        data = merged_yaml(yaml_list(cfg.base_lm.config)).get("data") or {}
        args = {**DEFAULTS, **(data.get("init_args") or {})}
    elif not is_hf(ckpt) and Path(ckpt).is_file():
        from gnnlm.workdir.checkpoints import datamodule_args

        args = datamodule_args(ckpt)
    else:
        return None
    if not args.get("corpus"):
        return None
    return args["corpus"], args.get("corpus_path"), args.get("data_dir")


def check_run_corpus(cfg: PipelineSettings) -> None:
    """Refuse a run whose corpus would not be found (``gnnlm.text.corpus.check_corpus``)."""
    corpus = run_corpus(cfg)
    if corpus is not None:
        check_corpus(*corpus)
