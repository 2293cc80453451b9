"""The pipeline's configuration: one dataclass per stage, the parser, and the checks that run
when a config is loaded, before any work.

A pipeline YAML names, per stage, the fields below; trained parts (the base LM and the heads)
are ``gnnlm fit`` YAMLs given as a list (a base and overlays, merged in order, as LightningCLI
merges several ``-c``). ``load_config`` refuses, with one message each:

- unknown fields (jsonargparse), and settings out of range (each dataclass checks its own);
- kNN settings that the stored neighbours cannot serve (``knn.ks``/``knn.k`` above
  ``neighbors.K``);
- head configs that read other retrieval artifacts than the pipeline builds: the graph and
  SPALM data modules must use ``knn.keys[0]`` and ``knn.metric`` (the only key whose train
  neighbours are searched), keep at most ``neighbors.K`` neighbours, and train on at most the
  ``neighbors.train_queries`` positions that have train neighbours (``train_tokens`` unset:
  every position that has them), with every count of windows (``graph.k``, ...) >= 1;
- feature windows beyond the base LM's context and an index factory faiss cannot build for
  its hidden size, where ``base_lm_shape`` knows them at load;
- with ``machine=True`` (``gnnlm pipeline``): GPU settings on a machine without a GPU
  (``check_machine``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from gnnlm.gnn.pq import PQConfig
from gnnlm.models import is_hf
from gnnlm.models.base import FEATURE_KEYS
from gnnlm.models.hf import DEFAULT_CONTEXT, DTYPES, check_keys
from gnnlm.pipeline.ablations import AblationConfig
from gnnlm.retrieval.index import IndexConfig
from gnnlm.retrieval.knn import (
    DEFAULT_KS,
    DEFAULT_LAMBDAS,
    check_lambda,
    check_temperature,
    default_temperatures,
    grid_or_point,
)
from gnnlm.retrieval.knn_cache import check_scores
from gnnlm.retrieval.neighbors import NeighborsConfig
from gnnlm.retrieval.search import check_metric
from gnnlm.text.tokens import TokenizerConfig
from gnnlm.utils.devices import (
    check_accelerator,
    check_available,
    check_device,
    check_faiss_available,
)
from gnnlm.workdir.ranks import check_devices

YAMLs = Union[str, list[str], None]


def yaml_list(value: YAMLs) -> list[str]:
    """A ``gnnlm fit`` config: one YAML, or a base and its overlays."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def config_text(path: str | os.PathLike) -> str:
    """The text of a config file, refused with the file's name when it is missing or is not
    YAML: the YAML parser alone names neither the file nor, for a relative path, the folder
    it was looked for in (config paths are resolved against the current directory, not
    against the file that lists them)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"Config file {path} is a folder: give a YAML file.")
    if not path.is_file():
        if path.is_absolute():
            raise FileNotFoundError(f"Config file {path} does not exist: check the path.")
        raise FileNotFoundError(
            f"Config file {path} does not exist (paths are resolved against the current "
            f"directory, {os.getcwd()}): run gnnlm from the folder the path is relative to "
            f"(the repository root for configs/...), or give an absolute path.")
    try:
        text = path.read_text(encoding="utf-8")
        yaml.safe_load(text)
    except UnicodeDecodeError as err:
        raise ValueError(f"Config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x}"
                         f" at offset {err.start}): save it as UTF-8.") from None
    except yaml.YAMLError as err:
        mark, start = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        context = getattr(err, "context", None)
        where = [f"line {m.line + 1}, column {m.column + 1}" for m in (mark,) if m]
        if context and start:
            where.append(f"{context} from line {start.line + 1}, column {start.column + 1}")
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ValueError(f"Config file {path} is not valid YAML: {problem}"
                         f"{' (' + '; '.join(where) + ')' if where else ''}. Fix the file at "
                         f"that line (YAML indents with spaces; quote a value holding ': ' or "
                         f"' #').") from None
    return text


def merged_yaml(paths: list[str]) -> dict:
    """The YAMLs merged in order (later files win, key by key), as LightningCLI reads them."""
    return merged_texts([config_text(path) for path in paths])


def merged_texts(texts: list[str]) -> dict:
    """``merged_yaml`` of YAML texts (e.g. as an older manifest recorded them)."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
                out.get(key), dict) else value
        return out

    result: dict = {}
    for text in texts:
        result = merge(result, yaml.safe_load(text) or {})
    return result


@dataclass
class BaseLMConfig:
    """``ckpt``: a ``gnnlm fit`` checkpoint or ``hf:<name-or-folder>``; when None the base LM is
    trained with ``config`` (``gnnlm fit`` YAMLs) into ``models/base_lm`` of the work dir.

    For a Hugging Face model: ``keys`` names where each feature is read, ``{final: ..., att:
    ...}`` as ``<module path>:input|output`` (default: the family's, see
    ``gnnlm.models.hf.KEY_PATHS``); ``dtype`` the weights' precision (``float32``, ``bfloat16``,
    ``float16``; log-probabilities stay float32); ``device_map`` spreads a model larger than one
    GPU over several (``auto``; needs ``accelerate``)."""
    ckpt: Optional[str] = None
    config: YAMLs = None
    keys: Optional[dict[str, str]] = None
    dtype: Optional[str] = None
    device_map: Optional[str] = None

    def __post_init__(self):
        hf_only = [name for name in ("keys", "dtype", "device_map") if getattr(self, name)]
        if hf_only and not (self.ckpt or "").startswith("hf:"):
            raise ValueError(f"base_lm.{hf_only[0]} applies to Hugging Face base LMs "
                             f"(base_lm.ckpt: hf:<name-or-folder>).")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"base_lm.dtype must be one of {sorted(DTYPES)} (got "
                             f"{self.dtype!r}).")
        check_keys(self.keys or {})

    def options(self) -> dict:
        """What ``load_base_lm`` takes besides the path."""
        return {"keys": self.keys, "dtype": self.dtype, "device_map": self.device_map}


@dataclass
class CorpusConfig:
    """The corpus and tokenizer of the whole run: the datastore, the heads and the report all
    read its tokens, and the base LM must have been trained on the same token ids.

    It is named once. When the pipeline trains the base LM (``base_lm.config``), this section,
    when given, is what the base LM is trained on: it is passed to ``gnnlm fit`` as the data
    module's ``corpus``, ``corpus_path``, ``data_dir`` and ``tokenizer`` (so ``--corpus.path``
    on the command line moves both); a field the base LM config's data section also sets must
    name the same corpus (the same split files) or the same tokenizer, or the config is refused
    at load. Without this section the base LM config's data section is the corpus. For a
    ``gnnlm fit`` checkpoint (``base_lm.ckpt``) the checkpoint names its own corpus and
    tokenizer; this section, when given, must use the same tokenizer settings and, for a
    vocabulary learned from the corpus (word, char, bpe), the same split files when the
    checkpoint's are found on this machine. After tokenization the vocabulary itself (the
    ordered token list's fingerprint, recorded in the checkpoint) must be the base LM's.
    For a Hugging Face base LM use tokenizer kind ``hf``: without a ``path`` it is the model's
    own tokenizer."""
    name: str = "wikitext-2"
    path: Optional[str] = None
    data_dir: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def fit_args(self) -> list[str]:
        """The ``gnnlm fit`` flags that make the base LM's data module read this corpus."""
        tokenizer = json.dumps(asdict(tokenizer_config(self.tokenizer)))
        return [f"--data.init_args.corpus={self.name}",
                f"--data.init_args.corpus_path={'null' if self.path is None else self.path}",
                f"--data.init_args.data_dir={'null' if self.data_dir is None else self.data_dir}",
                f"--data.init_args.tokenizer={tokenizer}"]


def tokenizer_config(value: Any) -> TokenizerConfig:
    """A ``TokenizerConfig`` from itself or a mapping of its fields (as YAMLs and checkpoints
    hold it)."""
    return value if isinstance(value, TokenizerConfig) else TokenizerConfig(**dict(value or {}))


def tokenizer_settings(value: Any) -> dict:
    """What of a tokenizer config decides the token ids, as the tokens artifact records it: the
    fields that are set, ``vocab_size`` only for a BPE trained here."""
    settings = {k: v for k, v in asdict(tokenizer_config(value)).items() if v is not None}
    if settings["kind"] != "bpe":
        settings.pop("vocab_size")
    return settings


@dataclass
class FeaturesConfig:
    """Sliding-window protocol (defaults: the base LM's context, at most 1,024 tokens for a
    Hugging Face model, whose own can be 128k; stride context/2)."""
    context: Optional[int] = None
    stride: Optional[int] = None
    batch_size: int = 32
    device: str = "auto"
    max_tokens: Optional[dict[str, int]] = None  # per-split prefixes, for quick runs
    devices: Union[int, str] = 1  # encoding processes: 1 here, N > 1 sharded, "auto" every GPU

    def __post_init__(self):
        check_device(self.device)
        check_devices(self.devices, "features.devices")
        if self.context is not None and self.context < 2:
            raise ValueError(f"features.context must be >= 2 (got {self.context}).")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"features.stride (tokens between window starts) must be >= 1 "
                             f"(got {self.stride}): leave it unset for half the context.")
        if self.stride is not None and self.context is not None and self.stride > self.context:
            raise ValueError(f"features.stride = {self.stride} exceeds features.context = "
                             f"{self.context}: windows would skip tokens; lower the stride to "
                             f"at most the context.")
        if self.batch_size < 1:
            raise ValueError(f"features.batch_size must be >= 1 (got {self.batch_size}).")


@dataclass
class KNNConfig:
    """Keys to compare (the first is the primary: its train neighbours feed the heads, and the
    headline kNN-LM and GNN+kNN rows use it), the similarity, the (k, T, λ) grid fitted on
    valid, and FAISS or exact recomputed scores. ``temperatures`` defaults to a grid that
    brackets the optimum for the similarity. ``k``/``temperature``/``lambda_`` pin one value
    (W&B sweep agents set them)."""
    keys: list[str] = field(default_factory=lambda: ["final", "att"])
    metric: str = "cos"
    scores: str = "faiss"
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    temperatures: Optional[list[float]] = None
    lambdas: list[float] = field(default_factory=lambda: list(DEFAULT_LAMBDAS))
    k: Optional[int] = None
    temperature: Optional[float] = None
    lambda_: Optional[float] = None

    def __post_init__(self):
        if not self.keys or any(key not in FEATURE_KEYS for key in self.keys):
            raise ValueError(f"knn.keys must be a non-empty list of {FEATURE_KEYS} "
                             f"(got {self.keys}).")
        check_metric(self.metric)
        check_scores(self.scores)
        if self.temperatures is None:
            self.temperatures = default_temperatures(self.metric)
        # an empty axis would only fail after every stage, when the fit takes the best point
        for axis, name, pin in zip(self.grid(), ("ks", "temperatures", "lambdas"),
                                   ("k", "temperature", "lambda_")):
            if not axis:
                raise ValueError(f"knn.{name} is empty: list at least one value, leave it out "
                                 f"for the default grid, or pin one with knn.{pin}.")
        check_temperature(self.grid()[1])
        check_lambda(self.grid()[2])
        if any(int(k) < 1 for k in self.grid()[0]):
            raise ValueError(f"knn.ks and knn.k must be >= 1 (got {self.grid()[0]}).")

    @property
    def primary(self) -> str:
        return self.keys[0]

    def grid(self) -> tuple[list[int], list[float], list[float]]:
        return (grid_or_point(self.ks, self.k),
                grid_or_point(self.temperatures or [], self.temperature),
                grid_or_point(self.lambdas, self.lambda_))


@dataclass
class HeadConfig:
    """A head trained with ``gnnlm fit`` YAMLs (None: the row is skipped)."""
    config: YAMLs = None


@dataclass
class LearnedWdsConfig:
    """Learned W_ds heads (Xu et al. §4.1–4.2), one row each: ``configs`` are ``gnnlm fit``
    configs of ``LearnedDatastoreLM`` (e.g. n = 1 and n = 3 embeddings per word). The first is
    the ``learned_wds`` row, the others ``learned_wds[n=…]``."""
    configs: list[YAMLs] = field(default_factory=list)

    def named(self) -> dict[str, list[str]]:
        rows = {}
        for i, config in enumerate(self.configs):
            paths = yaml_list(config)
            n = ((merged_yaml(paths).get("model") or {}).get("init_args") or {}).get(
                "embeddings_per_word", 1)
            rows["learned_wds" if i == 0 else f"learned_wds[n={n}]"] = paths
        return rows


@dataclass
class PipelineConfig:
    name: str = "wikitext2"
    workdir: str = "runs/wikitext2"
    base_lm: BaseLMConfig = field(default_factory=BaseLMConfig)
    corpus: Optional[CorpusConfig] = None
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    neighbors: NeighborsConfig = field(default_factory=NeighborsConfig)
    knn: KNNConfig = field(default_factory=KNNConfig)
    pq: PQConfig = field(default_factory=PQConfig)
    gnn: HeadConfig = field(default_factory=HeadConfig)
    spalm: HeadConfig = field(default_factory=HeadConfig)
    spalm_ft: HeadConfig = field(default_factory=HeadConfig)
    # SPALM trained end to end (SpalmXL) and its baselines on the same segments
    transformer: HeadConfig = field(default_factory=HeadConfig)
    transformer_xl: HeadConfig = field(default_factory=HeadConfig)
    spalm_xl: HeadConfig = field(default_factory=HeadConfig)
    # the same SPALM with options the paper does not have (a gate bias, a memory scale): its
    # own row, labelled with them, beside the paper's form
    spalm_xl_variant: HeadConfig = field(default_factory=HeadConfig)
    learned_wds: LearnedWdsConfig = field(default_factory=LearnedWdsConfig)
    ablations: AblationConfig = field(default_factory=AblationConfig)
    rebuild: Union[bool, list[str]] = False

    def rebuilds(self, stage: str) -> bool:
        """Whether ``--rebuild`` names this stage (``true`` or ``all``: every stage). A head's
        stage is its row name (``gnn``, ``spalm``, ...) or ``heads`` for all of them."""
        if isinstance(self.rebuild, bool):
            return self.rebuild
        heads = set(self.heads()) | {"base_lm_xl"}
        return bool({"all", stage} & set(self.rebuild)) or (
            stage in heads and "heads" in self.rebuild)

    def heads(self) -> dict[str, list[str]]:
        """Trained heads by report row: ``gnn``, ``spalm``, ``spalm_ft``, ``transformer``,
        ``transformer_xl``, ``spalm_xl``, ``spalm_xl_variant``, ``learned_wds…``."""
        rows = {"gnn": yaml_list(self.gnn.config), "spalm": yaml_list(self.spalm.config),
                "spalm_ft": yaml_list(self.spalm_ft.config),
                "transformer": yaml_list(self.transformer.config),
                "transformer_xl": yaml_list(self.transformer_xl.config),
                "spalm_xl": yaml_list(self.spalm_xl.config),
                "spalm_xl_variant": yaml_list(self.spalm_xl_variant.config),
                **self.learned_wds.named()}
        return {name: paths for name, paths in rows.items() if paths}


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
            and not (cfg.base_lm.ckpt or "").startswith("hf:")):
        raise ValueError("corpus.tokenizer kind 'hf' without a path means the Hugging Face base "
                         "LM's own tokenizer, but base_lm.ckpt is not hf:<name-or-folder>: give "
                         "corpus.tokenizer.path.")
    if cfg.ablations.memory_lm is not None:
        merged_yaml(yaml_list(cfg.ablations.memory_lm))  # the files exist and parse
    for row, paths in cfg.heads().items():
        _check_head(cfg, row, paths, merged_yaml(paths))
    for paths in (yaml_list(cfg.base_lm.config),):
        merged_yaml(paths)
    _check_against_base_lm(cfg)
    _check_corpus(cfg, files)


# the pipeline's corpus fields and the ``LMDataModule`` arguments that name the same thing
CORPUS_ARGS = {"name": "corpus", "path": "corpus_path", "data_dir": "data_dir"}


def _check_corpus(cfg: PipelineConfig, files: Sequence[str]) -> None:
    """One corpus and tokenizer for the whole run (the rule is in ``CorpusConfig``)."""
    from gnnlm.models import is_hf

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
    from gnnlm.workdir.checkpoints import datamodule_args

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
    from gnnlm.text.corpus import locate_corpus

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
    default = CorpusConfig()
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


def _check_head(cfg: PipelineConfig, row: str, paths: list[str], merged: dict) -> None:
    data = merged.get("data") or {}
    args: dict[str, Any] = data.get("init_args") or {}
    reads_neighbors = (data.get("class_path", "").endswith(("GraphDataModule",
                                                           "RetrievalWindowsDataModule",
                                                           "SpalmDataModule"))
                       or int(args.get("retrieved") or 0) > 0)
    if not reads_neighbors:
        return
    where = f"the {row} config ({' + '.join(paths)})"
    _check_counts(where, args)
    for name, expected in (("key", cfg.knn.primary), ("metric", cfg.knn.metric)):
        if args.get(name, expected) != expected:
            raise ValueError(f"{where} reads the neighbours of data.{name} = {args[name]!r}, but "
                             f"the pipeline searches train neighbours for knn.keys[0] = "
                             f"{cfg.knn.primary!r} under knn.metric = {cfg.knn.metric!r}.")
    k = max([int((args.get("graph") or {}).get("k") or 0), int(args.get("retrieved") or 0),
             *(int(k) for k in args.get("eval_ks") or [])])
    if k > cfg.neighbors.K:
        raise ValueError(f"{where} keeps k = {k} neighbours per token (graph.k, retrieved or "
                         f"eval_ks) but neighbors.K = {cfg.neighbors.K} are stored.")
    covered = cfg.neighbors.train_queries
    asked = args.get("train_tokens")
    if covered is not None and asked is not None and int(asked) > covered:
        raise ValueError(f"{where} trains on data.train_tokens = {asked} positions but "
                         f"only the first neighbors.train_queries = {covered} have train "
                         f"neighbours: lower train_tokens or raise train_queries.")


def _check_counts(where: str, args: dict) -> None:
    """A head's counts of windows and tokens (the graph data module's ``graph.*``, ``k_schedule``,
    ``eval_ks``, ``block_size``): the data module checks them only when it is built, after the
    datastore and PQ stages. Values that are not integers are left to the parse of the config."""
    graph = args.get("graph") or {}
    counts = [("graph.k", graph.get("k"), 1, "windows retrieved per token"),
              ("graph.left", graph.get("left"), 0, "tokens before a retrieved one"),
              ("graph.right", graph.get("right"), 0, "tokens after a retrieved one"),
              ("graph.ctx_window", graph.get("ctx_window"), 1, "or null for the whole block"),
              ("block_size", args.get("block_size"), 1, "target tokens per sample")]
    for name, value, least, meaning in counts:
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ValueError(f"{where} sets data.init_args.{name} = {value}, but it must be >= "
                             f"{least} ({meaning}).")
    for name, ks in (("k_schedule", [s[-1] for s in args.get("k_schedule") or [] if s]),
                     ("eval_ks", args.get("eval_ks") or [])):
        if any(isinstance(k, int) and k < 1 for k in ks):
            raise ValueError(f"{where} sets data.init_args.{name} = {args[name]}, but every k "
                             f"(windows retrieved per token) must be >= 1.")


def base_lm_shape(cfg: PipelineConfig) -> Optional[tuple[int, int]]:
    """The base LM's context length and hidden size (the features' dimension), as far as they
    are known at load without loading weights or downloading; None when they are not.

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

        from gnnlm.lit.lm import LanguageModel

        defaults = {name: p.default for name, p
                    in inspect.signature(LanguageModel.__init__).parameters.items()}
        args = {**defaults, **(model.get("init_args") or {})}
        return _shape(args.get("context_length"), args.get("d_model"))
    if is_hf(spec):
        return _hf_shape(spec.removeprefix("hf:"))
    if not Path(spec).is_file():
        return None
    from gnnlm.workdir.checkpoints import load_checkpoint

    hparams = load_checkpoint(spec).get("hyper_parameters") or {}
    return _shape(hparams.get("context_length"), hparams.get("d_model"))


def _shape(context: Any, hidden: Any) -> Optional[tuple[int, int]]:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (context, hidden))
    return (context, hidden) if ok else None


def _hf_shape(name: str) -> Optional[tuple[int, int]]:
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

    return _shape(first("n_positions", "max_position_embeddings"),
                  first("word_embed_proj_dim", "hidden_size", "n_embd", "d_model"))


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
    ``trainer.accelerator`` of every trained part the pipeline runs. Checked by the commands
    that run those stages (``gnnlm pipeline``), not by those that read their results (a GPU
    config is fine for ``gnnlm sweep`` on a laptop)."""
    from gnnlm.pipeline.stages import fit_chains  # the pipeline names its trained parts

    check_available(cfg.features.device, "features.device")
    check_faiss_available(cfg.index.device, "index.device")
    for chain in fit_chains(cfg):
        trainer = merged_yaml(chain).get("trainer") or {}
        check_accelerator(trainer.get("accelerator"),
                          f"the `gnnlm fit` config {' + '.join(chain)}")


# what each section of a pipeline config is for, one line each (``--help`` lists them)
SECTIONS = {
    "name": "the run's name: the report goes to <workdir>/reports/<name>/",
    "workdir": "the work directory every stage writes its artifact folder under",
    "base_lm": "the frozen base LM: a checkpoint, hf:<name-or-folder>, or YAMLs to train it",
    "corpus": "the corpus and tokenizer of the whole run (unset: the base LM config's own)",
    "features": "the sliding windows that encode every split with the base LM",
    "index": "the FAISS index over train keys and the recall its search settings must reach",
    "neighbors": "the top-K train neighbours of every split, leakage masked for train queries",
    "knn": "kNN-LM: the keys, the similarity, and the (k, T, λ) grid fitted on valid",
    "pq": "PQ codes of the train features, which GNN-LM's window nodes may read",
    "gnn": "the GNN-LM head: `config` lists its `gnnlm fit` YAMLs (unset: no row)",
    "spalm": "SPALM's gate on the frozen base LM (`config`: its `gnnlm fit` YAMLs)",
    "spalm_ft": "SPALM's gate with the base LM's last block and final norm fine-tuned",
    "transformer": "the SPALM comparison's transformer row: segments alone, no memory",
    "transformer_xl": "the SPALM comparison's Transformer-XL row: short-term memory only",
    "spalm_xl": "SPALM trained end to end: a Transformer-XL LM gated with retrieved tokens",
    "spalm_xl_variant": "spalm_xl with options the paper does not have, in a row of its own",
    "learned_wds": "learned W_ds heads (Xu et al.): one list of `gnnlm fit` YAMLs per row",
    "ablations": "the Xu et al. ablation table (off unless `enabled`)",
    "rebuild": "stages to build again although complete, e.g. [index,neighbors] (true: all)",
}
HELP_WORDS = ("-h", "--help", "--help-all")


def config_parser(prog: str = "gnnlm pipeline", description: Optional[str] = None):
    """The jsonargparse parser of a pipeline YAML (``-c``) and ``--section.field=value`` flags.

    ``--help`` lists the sections, one line each; ``--help=SECTION`` shows a section's fields
    and ``--help-all`` jsonargparse's own help, whose hundreds of generated lines cut each
    section's description at its first line."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    class PipelineParser(ArgumentParser):
        def parse_args(self, *args, **kwargs):
            import sys

            given = args[0] if args else kwargs.get("args")
            words = list(sys.argv[1:] if given is None else given)
            for i, word in enumerate(words):
                if word in HELP_WORDS or word.startswith("--help="):
                    after = words[i + 1] if i + 1 < len(words) else ""
                    section = (word.split("=", 1)[1] if "=" in word
                               else after if word == "--help" and after in SECTIONS else None)
                    print(self.format_help() if word == "--help-all"
                          else section_help(prog, section) if section is not None
                          else short_help(self, prog, description))
                    raise SystemExit(0)
            return super().parse_args(*args, **kwargs)

    # errors are raised, not printed with the whole usage: the command prints one line
    parser = PipelineParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
                        help="a pipeline YAML; several -c are merged in order (overlays)")
    parser.add_class_arguments(PipelineConfig)
    return parser


def _wrapped(text: str, indent: str = "", first: str = "") -> str:
    """Text re-flowed to the 100 columns of the code, never breaking a word."""
    import textwrap

    text = " ".join(text.replace("``", "`").split())
    return textwrap.fill(text, 100, initial_indent=first or indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def short_help(parser, prog: str, description: Optional[str]) -> str:
    """``--help``: what the command does, each section in one line, how to see its fields."""
    actions = [a for a in parser._actions if a.option_strings and a.dest.split(".")[0] not in
               {*SECTIONS, "help", "config", "print_config"}]   # the command's own options
    own = [(", ".join(a.option_strings) + (f" {a.metavar or a.dest.upper()}" if a.nargs != 0
                                           else ""), a.help or "") for a in actions]
    usage = " ".join([f"{prog} -c CONFIG [-c OVERLAY ...] [--SECTION.FIELD=VALUE ...]",
                      *(flag if a.required else f"[{flag}]" for a, (flag, _) in zip(actions, own)),
                      "[--debug]"])
    paragraphs = (description or "").split("\n\n")
    lines = [_wrapped(usage, " " * (len(prog) + 8), "usage: "), "",
             *(_wrapped(p) + "\n" for p in paragraphs if p.strip()),
             "The sections of a pipeline config (keys of the YAML; on the command line "
             "--SECTION.FIELD=VALUE):"]
    lines += [_wrapped(text, " " * 20, f"  {name:<18}") for name, text in SECTIONS.items()]
    lines += ["", "options:",
              "  -c, --config CONFIG   a pipeline YAML; several -c merge in order (overlays); "
              "paths are",
              "                        resolved against the current directory",
              *(_wrapped(text, " " * 24, f"  {flag:<22}") for flag, text in own),
              "  --help=SECTION        a section's fields, types and defaults (e.g. "
              "--help=features)",
              "  --print_config        the merged config as YAML, then exit",
              "  --help-all            every field at once (jsonargparse's help)",
              "  --debug               the traceback of an error instead of its one line"]
    return "\n".join(lines)


def section_help(prog: str, name: str) -> str:
    """``--help=SECTION``: the section's purpose, its documentation and every field with its
    type and default (nested settings as ``tokenizer.kind``)."""
    if name not in SECTIONS:
        raise ValueError(f"{prog} has no section {name!r}: the sections are "
                         f"{', '.join(SECTIONS)}.")
    import inspect
    from dataclasses import MISSING

    spec = PipelineConfig.__dataclass_fields__[name]
    cls = {c.__name__: c for c in (BaseLMConfig, CorpusConfig, FeaturesConfig, IndexConfig,
                                   NeighborsConfig, KNNConfig, PQConfig, HeadConfig,
                                   LearnedWdsConfig, AblationConfig)
           }.get(str(spec.type).removeprefix("Optional[").removesuffix("]"))
    lines = [f"{name}: {SECTIONS[name]}", ""]
    if cls is None:  # a plain setting
        default = spec.default if spec.default is not MISSING else None
        lines += [f"  --{name}  {spec.type} = {default!r}"]
        return "\n".join(lines)
    if cls.__doc__:
        lines += [_wrapped(p) + "\n" for p in inspect.cleandoc(cls.__doc__).split("\n\n")]
    lines += [f"Its fields (in a YAML under `{name}:`; on the command line "
              f"--{name}.FIELD=VALUE):"]
    lines += [_wrapped(f"{typ} = {default}", " " * 30, f"  {field_name:<26}  ")
              for field_name, typ, default in _fields(cls)]
    return "\n".join(lines)


def _fields(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(name, type, default) of a config dataclass's fields, nested dataclasses expanded."""
    from dataclasses import MISSING, fields, is_dataclass

    rows = []
    for spec in fields(cls):
        default = (spec.default_factory() if spec.default_factory is not MISSING
                   else spec.default)
        if is_dataclass(default) and not isinstance(default, type):
            rows += _fields(type(default), f"{prefix}{spec.name}.")
        else:
            rows.append((f"{prefix}{spec.name}", str(spec.type), repr(default)))
    return rows


def to_config(parser, namespace) -> PipelineConfig:
    init = parser.instantiate_classes(namespace)
    cfg = PipelineConfig(**{name: init[name] for name in PipelineConfig.__dataclass_fields__})
    check_contracts(cfg, [str(path) for path in namespace.get("config") or []])
    return cfg


def load_config(args: list[str], prog: str = "gnnlm pipeline",
                description: Optional[str] = None, machine: bool = False) -> PipelineConfig:
    """Parse ``-c CONFIG [-c OVERLAY ...] [--section.field=value ...]`` and check it
    (``machine``: also that this machine has the GPUs it asks for, see ``check_machine``)."""
    parser = config_parser(prog, description)
    cfg = to_config(parser, parser.parse_args(args))
    if machine:
        check_machine(cfg)
    return cfg


def check_built(command: str, args: list[str], folders: list[Path]) -> None:
    """Refuse, before anything is written, a command that reads artifact ``folders`` which
    ``gnnlm pipeline`` has not built (yet), naming the pipeline command, with the same configs
    ``args``, that builds them."""
    missing = [Path(f) for f in folders if not (Path(f) / "manifest.json").is_file()]
    if not missing:
        return
    import shlex

    first = missing[0]
    partial = first.with_name(first.name + ".partial")
    state = (f"{first} is unfinished ({partial} holds its build so far)" if partial.exists()
             else f"{first} is not built yet")
    raise FileNotFoundError(f"`{command}` reads what `gnnlm pipeline` builds, and {state}: run "
                            f"`{shlex.join(['gnnlm', 'pipeline', *args])}` first (the same "
                            f"configs), then `{command}` again.")
