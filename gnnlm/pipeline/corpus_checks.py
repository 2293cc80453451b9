"""The check at load that a pipeline run reads one corpus and one tokenizer (the rule is in
``gnnlm.pipeline.settings.CorpusConfig``): the pipeline's ``corpus`` section against the data
section of the base LM config the pipeline trains, or against the corpus and tokenizer a ``gnnlm
fit`` checkpoint was trained on. A refusal names where each field it shows was set: a pipeline
YAML, the command line or the default; the base LM config's file; the checkpoint.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import yaml

from gnnlm.models.settings import is_hf
from gnnlm.pipeline.config_files import merged_yaml, yaml_list
from gnnlm.text.corpus import locate_corpus
from gnnlm.text.settings import TokenizerConfig, tokenizer_settings
from gnnlm.workdir.checkpoints import datamodule_args

if TYPE_CHECKING:
    from gnnlm.pipeline.settings import CorpusConfig, PipelineSettings


# the pipeline's corpus fields and the ``LMDataModule`` arguments that name the same thing
CORPUS_ARGS = {"name": "corpus", "path": "corpus_path", "data_dir": "data_dir"}


def check_one_corpus(cfg: PipelineSettings, files: Sequence[str]) -> None:
    """One corpus and tokenizer for the whole run (the rule is in ``CorpusConfig``); ``files``
    are the pipeline YAMLs, named in messages."""
    ckpt = cfg.base_lm.ckpt
    if cfg.corpus is None:
        return
    if ckpt is None:
        _check_trained_corpus(cfg.corpus, yaml_list(cfg.base_lm.config), files)
    elif not is_hf(ckpt):
        _check_checkpoint_corpus(cfg.corpus, ckpt, files)


def _check_trained_corpus(corpus: CorpusConfig, paths: list[str], files: Sequence[str]) -> None:
    """The base LM trained here reads the pipeline's corpus: a field its config's data section
    also sets must agree with it."""
    layers = [(merged_yaml([p]).get("data") or {}).get("init_args") or {} for p in paths]
    data = (merged_yaml(paths).get("data") or {}).get("init_args") or {}
    setter = {arg: p for p, layer in zip(paths, layers) for arg in layer}  # the last wins

    def theirs(args: list[str]) -> str:
        return ", ".join(f"data.init_args.{a} = {_shown(data[a])} ({setter[a]})" for a in args)

    def fix(what: str) -> str:
        return (f"Name the {what} once: in the pipeline's corpus section (passed to the base "
                f"LM's training) or in the base LM config's data section.")

    named = [arg for arg in CORPUS_ARGS.values() if arg in setter]
    if named:
        same = _same_corpus(corpus, data.get("corpus", "wikitext-2"), data.get("corpus_path"),
                            data.get("data_dir"), [f for f, a in CORPUS_ARGS.items() if a in named])
        if not same:
            raise ValueError(f"The pipeline's {_ours(corpus, files)} and its base LM config's "
                             f"{theirs(named)} name different corpora: the base LM would be "
                             f"trained on one and the datastore built from the other. "
                             f"{fix('corpus')}")
    if "tokenizer" in setter and (tokenizer_settings(data["tokenizer"])
                                  != tokenizer_settings(corpus.tokenizer)):
        raise ValueError(f"The pipeline's {_ours(corpus, files, ['tokenizer'])} and its base LM "
                         f"config's {theirs(['tokenizer'])} name different tokenizers: the base "
                         f"LM would be trained on other token ids than the datastore's. "
                         f"{fix('tokenizer')}")


def _check_checkpoint_corpus(corpus: CorpusConfig, ckpt: str, files: Sequence[str]) -> None:
    """A ``gnnlm fit`` checkpoint names the corpus and tokenizer it was trained on."""
    saved = datamodule_args(ckpt)
    if "corpus" not in saved:  # not trained by ``gnnlm fit`` on a corpus: nothing to compare
        return
    fix = ("Leave out the pipeline's corpus section (the checkpoint names its own), or train a "
           "base LM on this corpus (base_lm.config).")
    tokenizer = tokenizer_settings(saved.get("tokenizer"))
    mine = tokenizer_settings(corpus.tokenizer)
    if tokenizer["kind"] == mine["kind"] == "hf":  # one file: its vocabulary decides, later
        tokenizer.pop("path", None)
        mine.pop("path", None)
    if tokenizer != mine:
        raise ValueError(f"The pipeline's {_ours(corpus, files, ['tokenizer'])} differs from "
                         f"the tokenizer the base LM {ckpt} was trained with "
                         f"({_shown(tokenizer)}, saved in the checkpoint): token ids would mean "
                         f"other words. {fix}")
    if mine["kind"] == "hf":  # a fixed vocabulary: another corpus is read with the same ids
        return
    args = [a for a in CORPUS_ARGS.values() if saved.get(a) is not None]
    if not _same_corpus(corpus, saved["corpus"], saved.get("corpus_path"),
                        saved.get("data_dir"), list(CORPUS_ARGS), found_only=True):
        names = ", ".join(f"{a} = {_shown(saved[a])}" for a in args)
        raise ValueError(f"The pipeline's {_ours(corpus, files)} names other split files than "
                         f"the corpus the base LM {ckpt} was trained on ({names}, saved in the "
                         f"checkpoint): its {mine['kind']} vocabulary was learned from that "
                         f"corpus's train split, so token ids would mean other words. {fix}")


def _split_files(name: str, path: Optional[str], data_dir: Optional[str]
                 ) -> Optional[tuple[str, ...]]:
    """The split files a corpus setting reads on this machine (None: not found here)."""
    try:
        files = locate_corpus(name, path=path, data_dir=data_dir, download=False)
    except (FileNotFoundError, OSError):
        return None
    return tuple(os.path.realpath(files[split]) for split in sorted(files))


def _same_corpus(corpus: CorpusConfig, name: str, path: Optional[str], data_dir: Optional[str],
                 fields: list[str], found_only: bool = False) -> bool:
    """Whether two corpus settings read the same split files; where either is not found on this
    machine, whether the ``fields`` agree (``found_only``: then they count as the same, and the
    vocabulary's fingerprint decides after tokenization)."""
    ours = _split_files(corpus.name, corpus.path, corpus.data_dir)
    other = _split_files(name, path, data_dir)
    if ours is not None and other is not None:
        return ours == other
    if found_only:
        return True
    given = {"name": name, "path": path, "data_dir": data_dir}
    return all(getattr(corpus, f) == given[f] for f in fields)


def _ours(corpus: CorpusConfig, files: Sequence[str],
          fields: Sequence[str] = ("name", "path", "data_dir")) -> str:
    """The pipeline's corpus fields and where each was set: the last pipeline YAML that sets it
    to this value, the command line, or the default."""
    default = type(corpus)()
    shown = []
    for name in fields:
        value = getattr(corpus, name)
        if value is None:
            continue
        where = "the default" if value == getattr(default, name) else "the command line"
        for path in files:
            section = (merged_yaml([path]).get("corpus") or {})
            if name in section:
                same = (tokenizer_settings(section[name]) == tokenizer_settings(value)
                        if name == "tokenizer" else section[name] == value)
                where = path if same else "the command line"
        if name == "tokenizer":
            value = tokenizer_settings(value)
        shown.append(f"corpus.{name} = {_shown(value)} ({where})")
    return ", ".join(shown)


def _shown(value: Any) -> str:
    """A setting as a message shows it: a tokenizer as a YAML flow mapping (``{kind: word,
    max_vocab: 2000}``), anything else as its repr."""
    if isinstance(value, TokenizerConfig):
        value = tokenizer_settings(value)
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return repr(value)
