"""The checks that run when a pipeline config loads, before any work: the settings that span
several files, and (``check_machine``) what the config asks of this machine.

A pipeline YAML names, per stage, its settings; trained parts (the base LM and the heads) are
``gnnlm fit`` YAMLs given as a list. ``check_contracts`` refuses, with one message each:

- kNN settings that the stored neighbours cannot serve (``knn.ks``/``knn.k`` above
  ``neighbors.K``);
- a corpus or tokenizer other than the base LM's (the rule is in ``CorpusConfig``);
- a size or count below 1 in a trained part's config (``FIT_COUNTS``), and a work directory
  that cannot be one (an empty path, a file);
- feature windows beyond the base LM's context and an index factory faiss cannot build for
  its hidden size, where ``base_lm_shape`` knows them at load.

``check_head`` refuses, on a head's config as LightningCLI parsed it (with its classes'
defaults: ``gnnlm.pipeline.training.check_fit_configs``, before any stage runs), one that reads
other retrieval artifacts than the pipeline builds: a data module that reads neighbours (its
class's ``reads``, or ``retrieved`` > 0) must use ``knn.keys[0]`` and ``knn.metric`` (the only
key whose train neighbours are searched), keep at most ``neighbors.K`` neighbours, and train on
at most the ``neighbors.train_queries`` positions that have train neighbours (``train_tokens``
unset: every position that has them), with every count of windows (``graph.k``, ...) >= 1
(the graph's are ``GraphConfig``'s own checks).

``check_machine`` (``gnnlm pipeline``) refuses GPU settings on a machine without a GPU, an
``hf:<folder>`` base LM whose folder is not there, and a corpus neither here nor downloadable
now. Settings
out of range within one section are each dataclass's own check (``gnnlm.pipeline.config``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yaml

from gnnlm.gnn.settings import GraphConfig
from gnnlm.models.gguf_files import read_header
from gnnlm.models.settings import (
    CONTEXT_FIELDS,
    DEFAULT_CONTEXT,
    check_hf_folder,
    gguf_file,
    is_hf,
    no_context,
)
from gnnlm.pipeline.config_files import merged_yaml, yaml_list
from gnnlm.pipeline.run_corpus import check_run_corpus
from gnnlm.text.corpus import locate_corpus
from gnnlm.text.settings import TokenizerConfig, tokenizer_settings
from gnnlm.utils.devices import check_accelerator, check_available, check_faiss_available
from gnnlm.workdir.checkpoints import datamodule_args, load_checkpoint
from gnnlm.workdir.layout import check_workdir

if TYPE_CHECKING:
    from jsonargparse import Namespace

    from gnnlm.pipeline.config import CorpusConfig, PipelineConfig

# the stages ``rebuild`` may name, besides the heads' rows and ``base_lm_xl``
# (``gnnlm.pipeline.dependencies``, which also rebuilds the stages reading them)
STAGES = ("tokens", "base_lm", "features", "index", "neighbors", "knn_cache", "pq", "heads",
          "ablations")


def check_contracts(cfg: PipelineConfig, files: Sequence[str] = ()) -> None:
    """The settings that span several files (see the module docstring); ``files`` are the
    pipeline YAMLs, named in messages."""
    if not isinstance(cfg.rebuild, bool):
        known = {"all", *STAGES, *cfg.heads(), "base_lm_xl"}
        unknown = [s for s in cfg.rebuild if s not in known]
        if unknown:
            raise ValueError(f"--rebuild names stages {sorted(known)} (got {unknown}).")
    check_workdir(cfg.root)
    if cfg.copy_report_to and os.path.exists(cfg.copy_report_to) and not os.path.isdir(
            cfg.copy_report_to):  # refused now, not when every stage has run
        raise ValueError(f"copy_report_to = {cfg.copy_report_to} is a file: name a folder "
                         f"(it is made if absent).")
    K = cfg.neighbors.K
    ks = cfg.knn.grid()[0]
    if max(ks) > K:
        raise ValueError(f"knn.ks/knn.k ask for up to k = {max(ks)} neighbours but "
                         f"neighbors.K = {K} are stored: lower k or raise neighbors.K.")
    if cfg.base_lm.ckpt is None and not yaml_list(cfg.base_lm.config):
        raise ValueError("base_lm needs `ckpt` (a checkpoint or hf:<name>) or `config` (the "
                         "`gnnlm fit` YAMLs to train one).")
    tokenizer = cfg.corpus.tokenizer if cfg.corpus is not None else None
    if (tokenizer is not None and tokenizer.kind == "hf" and not tokenizer.path
            and not (cfg.base_lm.ckpt and is_hf(cfg.base_lm.ckpt))):
        raise ValueError("corpus.tokenizer kind 'hf' without a path means the Hugging Face base "
                         "LM's own tokenizer, but base_lm.ckpt is not hf:<name-or-folder>: give "
                         "corpus.tokenizer.path.")
    if cfg.ablations.memory_lm is not None:
        merged_yaml(yaml_list(cfg.ablations.memory_lm))  # the files exist and parse
    # every trained part's files exist and parse; a head's settings against what the pipeline
    # builds are ``check_head``'s, on the parsed config, when the pipeline runs
    for chain in cfg.fit_chains():
        _check_fit_counts(chain, merged_yaml(chain))
    for paths in (yaml_list(cfg.base_lm.config),):
        merged_yaml(paths)
    _check_against_base_lm(cfg)
    _check_corpus(cfg, files)


# the sizes and counts of a `gnnlm fit` config's model and data sections: each must be >= 1
# when set, or the fit would fail, or run on nothing, only after the stages before it (the
# counts of windows, graph.k, retrieved and eval_ks, are `_check_head`'s)
FIT_COUNTS = ("context_length", "n_layer", "n_head", "d_model", "d_ff", "num_layers", "heads",
              "max_windows", "block_size", "eval_context", "eval_stride", "batch_size",
              "eval_batch_size", "train_tokens", "eval_tokens", "eval_streams")


def _check_fit_counts(paths: list[str], merged: dict) -> None:
    """Refuse a count of a trained part's config that is not positive, naming its key."""
    def walk(node: Any, where: str):
        for key, value in (node.items() if isinstance(node, dict) else ()):
            if isinstance(value, dict):
                yield from walk(value, f"{where}.{key}")
            elif key in FIT_COUNTS:
                yield f"{where}.{key}", value

    for section in ("model", "data"):
        for key, value in walk((merged.get(section) or {}).get("init_args") or {},
                               f"{section}.init_args"):
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"The `gnnlm fit` config {' + '.join(paths)} sets {key} = "
                                 f"{value}: it must be >= 1.")


# the pipeline's corpus fields and the ``LMDataModule`` arguments that name the same thing
CORPUS_ARGS = {"name": "corpus", "path": "corpus_path", "data_dir": "data_dir"}


def _check_corpus(cfg: PipelineConfig, files: Sequence[str]) -> None:
    """One corpus and tokenizer for the whole run (the rule is in ``CorpusConfig``)."""
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


def data_reads(data: Namespace) -> frozenset[str]:
    """What a parsed ``gnnlm fit`` data section's class reads of the pipeline's retrieval
    artifacts: its ``reads`` (``datamodules``: ``neighbors``, ``pq``); a data module that declares
    nothing reads none of them. Imports the class (the parse already has)."""
    return frozenset(getattr(_data_class(data), "reads", frozenset()))


def _data_class(data: Namespace) -> type:
    """A parsed data section's class (imported: the parse already has)."""
    import importlib

    module, _, name = str(data.class_path).rpartition(".")
    return getattr(importlib.import_module(module), name)


def reads_pq(data: Namespace) -> bool:
    """Whether a parsed data section reads the PQ codes: its class may (``reads``) and its
    ``node_features`` (the parsed value: the class's default when the YAMLs leave it out) say
    so."""
    return "pq" in data_reads(data) and data.init_args.get("node_features") == "pq"


def check_head(cfg: PipelineConfig, row: str, paths: list[str], data: Namespace) -> None:
    """A head's parsed data section (``gnnlm.pipeline.training.check_fit_config``) against the
    retrieval artifacts the pipeline builds, when it reads neighbours (its class's ``reads``,
    or ``retrieved`` > 0): the same key and similarity, at most ``neighbors.K`` neighbours per
    token, at most ``neighbors.train_queries`` train positions, every count of windows >= 1.
    Then, for every head, its data module's own checks of its arguments (``check_arguments``),
    which would otherwise run only when the head's stage begins."""
    args = data.init_args
    where = f"the {row} config ({' + '.join(paths)})"
    if "neighbors" in data_reads(data) or int(args.get("retrieved") or 0) > 0:
        _check_retrieval(cfg, where, args)
    values = {**args.as_dict(), "graph": _check_counts(where, args)}
    try:  # a data module of gnnlm's (WorkdirDataModule) has them
        getattr(_data_class(data), "check_arguments", lambda **_: None)(**values)
    except ValueError as err:  # its message starts with the argument's name
        key, line = str(err).split(" ", 1)[0], f"{where}: data.init_args.{err}"
        setters = [p for p in paths
                   if key in ((merged_yaml([p]).get("data") or {}).get("init_args") or {})]
        raise ValueError(line.rstrip(".") + f"; {setters[-1]} sets it." if setters
                         else line) from None


def _check_retrieval(cfg: PipelineConfig, where: str, args: Namespace) -> None:
    """``check_head``'s checks of a head that reads neighbours."""
    retrieved = int(args.get("retrieved") or 0)
    graph = _check_counts(where, args)
    for name, expected in (("key", cfg.knn.primary), ("metric", cfg.knn.metric)):
        value = args.get(name)
        if value is not None and value != expected:
            raise ValueError(f"{where} reads the neighbours of data.{name} = {value!r}, but "
                             f"the pipeline searches train neighbours for knn.keys[0] = "
                             f"{cfg.knn.primary!r} under knn.metric = {cfg.knn.metric!r}.")
    graph_k = graph.k if graph is not None else 0
    eval_ks = [int(k) for k in args.get("eval_ks") or []]
    schedule = [int(step[-1]) for step in args.get("k_schedule") or [] if step]
    k = max([graph_k, retrieved, *eval_ks, *schedule])
    K = cfg.neighbors.K
    if k > K:
        # which settings ask for more than the K stored neighbours of each token
        above = {name: [k for k in ks if k > K] for name, ks in (("eval_ks", eval_ks),
                                                                 ("k_schedule", schedule))}
        too_many = [f"{name} = {value}" for name, value in (("graph.k", graph_k),
                                                             ("retrieved", retrieved))
                    if value > K] + [f"{name} {ks}" for name, ks in above.items() if ks]
        raise ValueError(f"{where} keeps k = {k} neighbours per token ({', '.join(too_many)}) "
                         f"but neighbors.K = {K} are stored: lower them to at most {K}, or "
                         f"raise neighbors.K.")
    covered = cfg.neighbors.train_queries
    asked = args.get("train_tokens")
    if covered is not None and asked is not None and int(asked) > covered:
        raise ValueError(f"{where} trains on data.train_tokens = {asked} positions but "
                         f"only the first neighbors.train_queries = {covered} have train "
                         f"neighbours: lower train_tokens or raise train_queries.")


def _check_counts(where: str, args: Namespace) -> Optional[GraphConfig]:
    """A head's counts of windows and tokens, which its data module checks only when it is
    built, after the datastore and PQ stages: the graph's (``GraphConfig``'s own checks, on the
    parsed values), ``k_schedule`` and ``eval_ks`` (``block_size`` is one of ``FIT_COUNTS``,
    checked at load). Returns the graph's settings, if the data module has any."""
    graph = None
    if args.get("graph") is not None:
        try:
            graph = GraphConfig(**args.graph.as_dict())
        except ValueError as err:
            raise ValueError(f"{where}: data.init_args.{err}") from None
    for name, ks in (("k_schedule", [s[-1] for s in args.get("k_schedule") or [] if s]),
                     ("eval_ks", args.get("eval_ks") or [])):
        if any(k < 1 for k in ks):
            raise ValueError(f"{where} sets data.init_args.{name} = {_listed(args[name])}, but "
                             f"every k (windows retrieved per token) must be >= 1.")
    return graph


def _listed(value: Any) -> list:
    """A parsed list setting as its YAML wrote it (pairs as lists, not tuples)."""
    return [list(v) if isinstance(v, tuple) else v for v in value]


def base_lm_shape(cfg: PipelineConfig) -> Optional[tuple[Optional[int], int]]:
    """The base LM's context length and hidden size (the features' dimension), as far as they
    are known at load without loading weights or downloading; None when they are not. The
    context is None for a Hugging Face model whose ALiBi positions have no length (Bloom).

    From a ``gnnlm fit`` checkpoint's saved hyper-parameters, from a Hugging Face folder's (or
    the local Hub cache's) config.json, or, when the pipeline trains the base LM, from its
    ``gnnlm fit`` YAMLs (the LanguageModel's defaults for what they leave out). A checkpoint
    that is not there yet gives None: the base LM stage says what is missing."""
    spec = cfg.base_lm.ckpt
    if spec is None:
        model = merged_yaml(yaml_list(cfg.base_lm.config)).get("model") or {}
        if not str(model.get("class_path", "LanguageModel")).endswith("LanguageModel"):
            return None
        import inspect

        from gnnlm.lit.lm import LanguageModel  # its defaults; Lightning only when asked

        defaults = {name: p.default for name, p
                    in inspect.signature(LanguageModel.__init__).parameters.items()}
        args = {**defaults, **(model.get("init_args") or {})}
        return _shape(args.get("context_length"), args.get("d_model"))
    if is_hf(spec):
        gguf = gguf_file(spec)
        return _gguf_shape(gguf) if gguf else _hf_shape(spec.removeprefix("hf:"))
    if not Path(spec).is_file():
        return None
    hparams = load_checkpoint(spec).get("hyper_parameters") or {}
    return _shape(hparams.get("context_length"), hparams.get("d_model"))


def _shape(context: Any, hidden: Any) -> Optional[tuple[int, int]]:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (context, hidden))
    return (context, hidden) if ok else None


def _hf_shape(name: str) -> Optional[tuple[Optional[int], int]]:
    """From config.json in the folder ``name``, or in the Hub cache for a model name (never
    downloaded here). The hidden size is the output embedding's input (OPT's
    ``word_embed_proj_dim`` where it projects), which the features have."""
    path = Path(name) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a Hub name, or no huggingface_hub
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    config = json.loads(path.read_text())
    config = {**(config.get("text_config") or {}), **config}  # multimodal: the text model's

    def first(*names: str) -> Any:
        return next((config[n] for n in names if config.get(n) is not None), None)

    hidden = first("word_embed_proj_dim", "hidden_size", "n_embd", "d_model")
    context = first(*CONTEXT_FIELDS)
    if context is None and _shape(1, hidden):  # ALiBi positions of any length (Bloom)
        return None, hidden
    return _shape(context, hidden)


def _gguf_shape(path: Path) -> Optional[tuple[Optional[int], int]]:
    """From the GGUF file's metadata (``<arch>.context_length``, ``<arch>.embedding_length``),
    read without its tensors; a file cut short or not GGUF is refused here, before any stage."""
    header = read_header(path)
    return _shape(header.field("context_length"), header.field("embedding_length"))


def _check_against_base_lm(cfg: PipelineConfig) -> None:
    """The features' windows and the index factory against the base LM's shape, when it is
    known at load (``base_lm_shape``); ``stage_features`` checks the windows again against the
    loaded model."""
    shape = base_lm_shape(cfg)
    if shape is None:
        cfg.index.check_factory(None, cfg.knn.metric)
        return
    limit, hidden = shape
    fc, spec = cfg.features, cfg.base_lm.ckpt
    lm = (f"base_lm.ckpt {spec}" if spec else
          f"the base LM of base_lm.config ({' + '.join(yaml_list(cfg.base_lm.config))})")
    if limit is None:  # the model reads any length: features.context says how long
        if fc.context is None:
            raise ValueError(no_context(lm))
        limit = fc.context
    if fc.context is not None and fc.context > limit:
        raise ValueError(f"features.context = {fc.context} exceeds the context of {lm}, "
                         f"{limit} tokens: lower it to at most {limit}, or leave it unset for "
                         f"the model's own.")
    hf_default = (spec is not None and is_hf(spec) and fc.context is None
                  and limit > DEFAULT_CONTEXT)
    context = fc.context or (DEFAULT_CONTEXT if hf_default else limit)
    if fc.stride is not None and fc.stride > context:
        source = "features.context" if fc.context else (
            "the default features.context for a Hugging Face model" if hf_default
            else f"the context of {lm}")
        raise ValueError(f"features.stride = {fc.stride} exceeds {source}, {context} tokens: "
                         f"windows would skip tokens; lower the stride to at most {context}, or "
                         f"leave it unset for half the context.")
    cfg.index.check_factory(hidden, cfg.knn.metric)


def check_machine(cfg: PipelineConfig) -> None:
    """The settings that ask this machine for a GPU: ``features.device``, ``index.device`` and
    ``trainer.accelerator`` of every trained part the pipeline runs; and for a model folder
    (``base_lm.ckpt: hf:<folder>``), that it is there. Checked by the commands
    that run those stages (``gnnlm pipeline``), not by those that read their results (a GPU
    config is fine for ``gnnlm sweep`` on a laptop). Then the corpus: here, or to download
    (``gnnlm.pipeline.run_corpus``), before any model loads."""
    if cfg.base_lm.ckpt is not None and is_hf(cfg.base_lm.ckpt):
        check_hf_folder(cfg.base_lm.ckpt)  # a model folder on this machine
    check_available(cfg.features.device, "features.device")
    check_faiss_available(cfg.index.device, "index.device")
    for chain in cfg.fit_chains():
        trainer = merged_yaml(chain).get("trainer") or {}
        check_accelerator(trainer.get("accelerator"),
                          f"the `gnnlm fit` config {' + '.join(chain)}")
    check_run_corpus(cfg)
