"""The pipeline's settings: one dataclass per section of a pipeline YAML, and ``PipelineSettings``,
a run's sections together, which every check and stage reads.

A pipeline YAML names, per stage, the fields below (``gnnlm pipeline --help=SECTION`` shows a
section's, from its ``Args``); trained parts (the base LM and the heads) are ``gnnlm fit`` YAMLs
given as a list (a base and overlays, merged in order, as LightningCLI merges several ``-c``).
Each dataclass refuses its own settings out of range, with one message each; the settings that
span several files are ``gnnlm.pipeline.config_checks``'s, and ``gnnlm.pipeline.config`` loads a
pipeline YAML into ``PipelineConfig``, these sections with the stages a run rebuilds. Of the
pipeline's modules only ``config_files`` and ``rows`` are imported here, and neither torch, faiss
nor transformers: each stage's settings come from its light ``settings`` module.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from gnnlm.gnn.settings import PQConfig
from gnnlm.models.settings import DTYPE_NAMES, FEATURE_KEYS, check_keys, is_hf
from gnnlm.pipeline.config_files import YAMLs, merged_yaml, yaml_list
from gnnlm.retrieval.settings import (
    DEFAULT_KS,
    DEFAULT_LAMBDAS,
    IndexConfig,
    NeighborsConfig,
    check_lambda,
    check_metric,
    check_scores,
    check_temperature,
    default_temperatures,
    grid_or_point,
)
from gnnlm.text.settings import TokenizerConfig, tokenizer_config
from gnnlm.utils.devices import check_device, check_devices
from gnnlm.workdir.rows import HEAD_CONFIGS, learned_wds_row


@dataclass
class BaseLMConfig:
    """The frozen base LM: a checkpoint, a Hugging Face model, or YAMLs to train it.

    Args:
        ckpt: a ``gnnlm fit`` checkpoint, ``hf:<name-or-folder>`` or a GGUF file (unset: the
            base LM is trained with ``config`` into ``models/base_lm`` of the work dir).
        config: the ``gnnlm fit`` YAMLs that train the base LM (a base and its overlays), when
            ``ckpt`` is unset.
        keys: Hugging Face only: where each feature is read, ``{final: ..., att: ...}`` as
            ``<module path>:input|output`` (unset: the family's, see
            ``gnnlm.models.hf.KEY_PATHS``).
        dtype: Hugging Face only: the weights' precision (``float32``, ``bfloat16``,
            ``float16``); log-probabilities stay float32.
        device_map: Hugging Face only: spread a model larger than one GPU over several
            (``auto``; needs ``accelerate``).
    """
    ckpt: Optional[str] = None
    config: YAMLs = None
    keys: Optional[dict[str, str]] = None
    dtype: Optional[str] = None
    device_map: Optional[str] = None

    def __post_init__(self):
        hf_only = [name for name in ("keys", "dtype", "device_map") if getattr(self, name)]
        if hf_only and not (self.ckpt and is_hf(self.ckpt)):
            raise ValueError(f"base_lm.{hf_only[0]} applies to Hugging Face base LMs "
                             f"(base_lm.ckpt: hf:<name-or-folder>, or a GGUF file).")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"base_lm.dtype must be one of {sorted(DTYPE_NAMES)} (got "
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
    own tokenizer.

    Args:
        name: the corpus's name: ``wikitext-2`` or ``wikitext-103`` (``-raw`` for the raw
            text), downloaded when not found, or your own corpus's folder name (unset: the
            last folder of ``path``, else ``wikitext-2``).
        path: the folder holding train.txt, valid.txt and test.txt (or its parent, the folder
            named ``name``).
        data_dir: a folder holding corpora by name (unset: ``$GNNLM_DATA``).
        tokenizer: how its text becomes token ids.
    """
    name: str = ""
    path: Optional[str] = None
    data_dir: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self):
        if not self.name:  # /data/lawtexts is the corpus lawtexts
            self.name = Path(self.path).resolve().name if self.path else "wikitext-2"

    def fit_args(self) -> list[str]:
        """The ``gnnlm fit`` flags that make the base LM's data module read this corpus."""
        tokenizer = json.dumps(asdict(tokenizer_config(self.tokenizer)))
        return [f"--data.init_args.corpus={self.name}",
                f"--data.init_args.corpus_path={'null' if self.path is None else self.path}",
                f"--data.init_args.data_dir={'null' if self.data_dir is None else self.data_dir}",
                f"--data.init_args.tokenizer={tokenizer}"]


@dataclass
class FeaturesConfig:
    """Sliding-window protocol (defaults: the base LM's context, at most 1,024 tokens for a
    Hugging Face model, whose own can be 128k; stride context/2).

    Args:
        context: tokens per window (unset: the base LM's context, at most 1,024 for a Hugging
            Face model).
        stride: tokens between window starts, at most ``context`` (unset: half the context).
        batch_size: windows encoded at once.
        device: where the base LM encodes (``auto``: the GPU when there is one).
        max_tokens: per-split prefixes to encode, e.g. ``{train: 100000}``, for quick runs
            (unset: whole splits).
        devices: encoding processes: 1 here, N > 1 sharded, ``auto`` every GPU.
    """
    context: Optional[int] = None
    stride: Optional[int] = None
    batch_size: int = 32
    device: str = "auto"
    max_tokens: Optional[dict[str, int]] = None
    devices: Union[int, str] = 1

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
        for split, n in (self.max_tokens or {}).items():
            if split not in ("train", "valid", "test"):
                raise ValueError(f"features.max_tokens names {split!r}: the splits are train, "
                                 f"valid and test.")
            if n < 1:
                raise ValueError(f"features.max_tokens.{split} must be >= 1 (got {n}): leave "
                                 f"the split out for all of it.")


@dataclass
class KNNConfig:
    """kNN-LM (Khandelwal et al. 2020): the keys to compare, the similarity, and the (k, T, λ)
    grid fitted on valid, with FAISS or exact recomputed scores.

    Args:
        keys: feature keys to compare (``final``, ``att``); the first is the primary: its train
            neighbours feed the heads, and the headline kNN-LM and GNN+kNN rows use it.
        metric: the similarity: ``cos``, ``ip`` or ``l2`` (negative squared distance).
        scores: ``faiss`` keeps the search's scores, ``exact`` recomputes them from the stored
            keys (Xu et al. 2023, §5.1).
        ks: the grid of k, neighbours read per token.
        temperatures: the grid of T (unset: a grid that brackets the optimum for the
            similarity).
        lambdas: the grid of λ, the kNN distribution's weight.
        k: pin one k (W&B sweep agents set it).
        temperature: pin one T.
        lambda_: pin one λ.
    """
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
    """A head trained with ``gnnlm fit``.

    Args:
        config: its ``gnnlm fit`` YAMLs, a base and its overlays (unset: the row is skipped).
    """
    config: YAMLs = None


@dataclass
class LearnedWdsConfig:
    """Learned W_ds heads (Xu et al. 2023, §4.1–4.2), one row each: ``configs`` are ``gnnlm
    fit`` configs of ``LearnedDatastoreLM`` (e.g. n = 1 and n = 3 embeddings per word). The
    first is the ``learned_wds`` row, the others ``learned_wds[n=…]``.

    Args:
        configs: one ``gnnlm fit`` config (a YAML, or a base and its overlays) per row.
    """
    configs: list[YAMLs] = field(default_factory=list)

    def named(self) -> dict[str, list[str]]:
        rows = {}
        for i, config in enumerate(self.configs):
            paths = yaml_list(config)
            n = ((merged_yaml(paths).get("model") or {}).get("init_args") or {}).get(
                "embeddings_per_word", 1)
            rows[learned_wds_row(i, n)] = paths
        return rows


@dataclass
class AblationConfig:
    """The kNN-LM ablations of Xu et al. 2023, one table (``gnnlm.pipeline.ablations``).

    Args:
        enabled: build the ablation table.
        eval_tokens: the prefix of valid and test that every row scores (exact search over the
            whole datastore costs N_train per query; unset: every token).
        metrics: the similarities compared on exact neighbours (§3).
        subsample: the fractions of the datastore searched (§4.2, Figure 2), each in (0, 1].
        unbounded_temperatures: the T grid of ``ip`` and ``l2``, whose scores are not bounded
            like ``cos``'s: it must reach larger values.
        seed: the seed of the datastore subsamples.
        device: where exact search runs (``auto``: the GPU when there is one).
        memory_lm: ``gnnlm fit`` YAMLs of a Transformer-XL base LM: adds the memory on/off rows.
    """
    enabled: bool = False
    eval_tokens: Optional[int] = 5000
    metrics: list[str] = field(default_factory=lambda: ["cos", "ip", "l2"])
    subsample: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.5, 1.0])
    unbounded_temperatures: list[float] = field(
        default_factory=lambda: [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0])
    seed: int = 0
    device: str = "auto"
    memory_lm: Union[str, list[str], None] = None

    @property
    def wanted(self) -> bool:
        """Whether the stage has anything to build: the table, the memory rows, or both."""
        return self.enabled or bool(self.memory_lm)

    def __post_init__(self):
        check_device(self.device)
        if self.eval_tokens is not None and self.eval_tokens < 1:
            raise ValueError(f"ablations.eval_tokens must be >= 1, or null for every token "
                             f"(got {self.eval_tokens}).")
        if any(not 0 < f <= 1 for f in self.subsample):
            raise ValueError(f"ablations.subsample fractions must lie in (0, 1] "
                             f"(got {self.subsample}).")


@dataclass
class PipelineSettings:
    """A pipeline run: its stages' settings, one section each (``--help=SECTION``).

    Args:
        name: the run's name, of reports/<name>/ (unset: the corpus's name, else wikitext2)
        workdir: the folder every stage writes its artifact folder under (unset: runs/<name>)
        base_lm: the frozen base LM: a checkpoint, hf:<name-or-folder>, or YAMLs to train it
        corpus: the corpus and tokenizer of the whole run (unset: the base LM config's own)
        features: the sliding windows that encode every split with the base LM
        index: the FAISS index over train keys and the recall its search settings must reach
        neighbors: the top-K train neighbours of every split, leakage masked for train queries
        knn: kNN-LM: the keys, the similarity, and the (k, T, λ) grid fitted on valid
        pq: PQ codes of the train features, which GNN-LM's window nodes may read
        gnn: the GNN-LM head: `config` lists its `gnnlm fit` YAMLs (unset: no row)
        spalm: SPALM's gate on the frozen base LM (`config`: its `gnnlm fit` YAMLs)
        spalm_ft: SPALM's gate with the base LM's last block and final norm fine-tuned
        transformer: the SPALM comparison's transformer row: segments alone, no memory
        transformer_xl: the SPALM comparison's Transformer-XL row: short-term memory only
        spalm_xl: SPALM trained end to end: a Transformer-XL LM gated with retrieved tokens
        spalm_xl_variant: spalm_xl with options the paper does not have, in a row of its own
        transformer_xl_scratch: the from-scratch pair's Transformer-XL: random initial weights
        spalm_xl_scratch: the from-scratch pair's SPALM, trained like transformer_xl_scratch
        learned_wds: learned W_ds heads (Xu et al.): one list of `gnnlm fit` YAMLs per row
        ablations: the Xu et al. ablation table (off unless `enabled`)
        rebuild: stages to build again, with every stage reading them, e.g. [pq] (true: all)
        copy_report_to: a folder to copy reports/<name>/ into when the run ends (made if absent)
    """
    name: str = ""
    workdir: Optional[str] = None   # unset, not empty: an empty path is refused at load
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
    # the same comparison trained from random initial weights (the paper's setting: the
    # pretrained LM only encodes the keys)
    transformer_xl_scratch: HeadConfig = field(default_factory=HeadConfig)
    spalm_xl_scratch: HeadConfig = field(default_factory=HeadConfig)
    learned_wds: LearnedWdsConfig = field(default_factory=LearnedWdsConfig)
    ablations: AblationConfig = field(default_factory=AblationConfig)
    rebuild: Union[bool, list[str]] = False
    copy_report_to: Optional[str] = None

    def heads(self) -> dict[str, list[str]]:
        """Trained heads by report row, in table order (``gnnlm.workdir.rows.HEAD_FIELDS``):
        each ``HeadConfig`` field's row, then the ``learned_wds…`` rows. The head fields above
        are written out because the parser reads fields; a test checks they match the registry."""
        rows = {name: yaml_list(getattr(self, name).config) for name in HEAD_CONFIGS}
        rows.update(self.learned_wds.named())
        return {name: paths for name, paths in rows.items() if paths}

    def fit_chains(self) -> list[list[str]]:
        """The ``gnnlm fit`` configs of every trained part the pipeline will run: the base LM
        (when it trains one), the ablations' memory LM, and the heads."""
        chains = [yaml_list(self.base_lm.config) if self.base_lm.ckpt is None else [],
                  yaml_list(self.ablations.memory_lm), *self.heads().values()]
        return [chain for chain in chains if chain]

    def __post_init__(self):
        # a run on one's own corpus is named after it: --corpus.path=/data/lawtexts writes
        # runs/lawtexts/reports/lawtexts/ unless name or workdir is given
        if not self.name:
            self.name = self.corpus.name if self.corpus is not None else "wikitext2"
        if self.workdir is None:
            self.workdir = f"runs/{self.name}"

    @property
    def root(self) -> str:
        """The work directory's path as given, or ``runs/<name>`` when unset (an empty path is
        kept as given: the checks at load refuse it)."""
        assert self.workdir is not None, "set in __post_init__"
        return self.workdir

