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
  every position that has them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from gnnlm.ablations import AblationStage
from gnnlm.devices import check_device
from gnnlm.index import IndexConfig
from gnnlm.knn import (
    DEFAULT_KS,
    DEFAULT_LAMBDAS,
    check_lambda,
    check_temperature,
    default_temperatures,
    grid_or_point,
)
from gnnlm.knn_cache import check_scores
from gnnlm.models.base import FEATURE_KEYS
from gnnlm.models.hf import DTYPES, check_keys
from gnnlm.neighbors import NeighborsConfig
from gnnlm.pq import PQConfig
from gnnlm.ranks import check_devices
from gnnlm.search import check_metric
from gnnlm.tokens import TokenizerConfig

YAMLs = Union[str, list[str], None]


def yaml_list(value: YAMLs) -> list[str]:
    """A ``gnnlm fit`` config: one YAML, or a base and its overlays."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def merged_yaml(paths: list[str]) -> dict:
    """The YAMLs merged in order (later files win, key by key), as LightningCLI reads them."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
                out.get(key), dict) else value
        return out

    result: dict = {}
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"Config file {path} does not exist.")
        result = merge(result, yaml.safe_load(Path(path).read_text()) or {})
    return result


@dataclass
class BaseLMStage:
    """``ckpt``: a ``gnnlm fit`` checkpoint or ``hf:<name-or-folder>``; when None the base LM is
    trained with ``config`` (``gnnlm fit`` YAMLs) into ``heads/base_lm`` of the work dir.

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
class CorpusStage:
    """Where tokens come from when the base LM is not trained here (a trained LM's checkpoint
    already names its corpus and tokenizer). For a Hugging Face base LM use tokenizer kind
    ``hf``: without a ``path`` it is the model's own tokenizer."""
    name: str = "wikitext-2"
    path: Optional[str] = None
    data_dir: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class FeaturesStage:
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
        if self.stride is not None and not 0 < self.stride <= (self.context or self.stride):
            raise ValueError(f"features.stride must be in [1, features.context] (got "
                             f"stride={self.stride}, context={self.context}).")
        if self.batch_size < 1:
            raise ValueError(f"features.batch_size must be >= 1 (got {self.batch_size}).")


@dataclass
class KNNStage:
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
class HeadStage:
    """A head trained with ``gnnlm fit`` YAMLs (None: the row is skipped)."""
    config: YAMLs = None


@dataclass
class LearnedWdsStage:
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
    base_lm: BaseLMStage = field(default_factory=BaseLMStage)
    corpus: Optional[CorpusStage] = None
    features: FeaturesStage = field(default_factory=FeaturesStage)
    index: IndexConfig = field(default_factory=IndexConfig)
    neighbors: NeighborsConfig = field(default_factory=NeighborsConfig)
    knn: KNNStage = field(default_factory=KNNStage)
    pq: PQConfig = field(default_factory=PQConfig)
    gnn: HeadStage = field(default_factory=HeadStage)
    spalm: HeadStage = field(default_factory=HeadStage)
    spalm_finetune: HeadStage = field(default_factory=HeadStage)
    # SPALM trained end to end (SpalmXL) and its baselines on the same segments
    transformer: HeadStage = field(default_factory=HeadStage)
    transformer_xl: HeadStage = field(default_factory=HeadStage)
    spalm_xl: HeadStage = field(default_factory=HeadStage)
    # the same SPALM with options the paper does not have (a gate bias, a memory scale): its
    # own row, labelled with them, beside the paper's form
    spalm_xl_variant: HeadStage = field(default_factory=HeadStage)
    learned_wds: LearnedWdsStage = field(default_factory=LearnedWdsStage)
    ablations: AblationStage = field(default_factory=AblationStage)
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
                "spalm_ft": yaml_list(self.spalm_finetune.config),
                "transformer": yaml_list(self.transformer.config),
                "transformer_xl": yaml_list(self.transformer_xl.config),
                "spalm_xl": yaml_list(self.spalm_xl.config),
                "spalm_xl_variant": yaml_list(self.spalm_xl_variant.config),
                **self.learned_wds.named()}
        return {name: paths for name, paths in rows.items() if paths}


STAGES = ("tokens", "base_lm", "features", "index", "neighbors", "knn_cache", "pq", "heads",
          "ablations")


def check_contracts(cfg: PipelineConfig) -> None:
    """The settings that span several files (see the module docstring)."""
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


def config_parser(prog: str = "gnnlm pipeline", description: Optional[str] = None):
    """The jsonargparse parser of a pipeline YAML (``-c``) and ``--section.field=value`` flags."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    # errors are raised, not printed with the whole usage: the command prints one line
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
                        help="a pipeline YAML; several -c are merged in order (overlays)")
    parser.add_class_arguments(PipelineConfig)
    return parser


def to_config(parser, namespace) -> PipelineConfig:
    init = parser.instantiate_classes(namespace)
    cfg = PipelineConfig(**{name: init[name] for name in PipelineConfig.__dataclass_fields__})
    check_contracts(cfg)
    return cfg


def load_config(args: list[str], prog: str = "gnnlm pipeline",
                description: Optional[str] = None) -> PipelineConfig:
    """Parse ``-c CONFIG [-c OVERLAY ...] [--section.field=value ...]`` and check it."""
    parser = config_parser(prog, description)
    return to_config(parser, parser.parse_args(args))
