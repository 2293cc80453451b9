"""The checks of a head's config as LightningCLI parsed it (with its classes' defaults:
``gnnlm.pipeline.fit_configs.check_fit_configs``, before any stage runs), and what its data module
reads of the pipeline's retrieval artifacts (``data_reads``, ``reads_neighbors``, ``reads_pq``).

``check_head`` refuses a head that reads other retrieval artifacts than the pipeline builds: a
data module that reads neighbours (its class's ``reads``, or ``retrieved`` > 0) must use
``knn.keys[0]`` and ``knn.metric`` (the only key whose train neighbours are searched), keep at
most ``neighbors.K`` neighbours, and train on at most the ``neighbors.train_queries`` positions
that have train neighbours (``train_tokens`` unset: every position that has them), with every
count of windows (``graph.k``, ...) >= 1 (the graph's are ``GraphConfig``'s own checks). Then
every head's data module checks its own arguments (``check_arguments``), naming the file that
sets the key.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from gnnlm.gnn.settings import GraphConfig
from gnnlm.pipeline.config_files import merged_yaml

if TYPE_CHECKING:
    from jsonargparse import Namespace

    from gnnlm.pipeline.settings import PipelineSettings


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


def reads_neighbors(data: Namespace) -> bool:
    """Whether a parsed data section reads the pipeline's neighbours: its class may
    (``reads``), or it keeps ``retrieved`` > 0 of them per token."""
    return "neighbors" in data_reads(data) or int(data.init_args.get("retrieved") or 0) > 0


def reads_pq(data: Namespace) -> bool:
    """Whether a parsed data section reads the PQ codes: its class may (``reads``) and its
    ``node_features`` (the parsed value: the class's default when the YAMLs leave it out) say
    so."""
    return "pq" in data_reads(data) and data.init_args.get("node_features") == "pq"


def check_head(cfg: PipelineSettings, row: str, paths: list[str], data: Namespace) -> None:
    """A head's parsed data section (``gnnlm.pipeline.fit_configs.check_fit_config``) against the
    retrieval artifacts the pipeline builds, when it reads neighbours (its class's ``reads``,
    or ``retrieved`` > 0): the same key and similarity, at most ``neighbors.K`` neighbours per
    token, at most ``neighbors.train_queries`` train positions, every count of windows >= 1.
    Then, for every head, its data module's own checks of its arguments (``check_arguments``),
    which would otherwise run only when the head's stage begins."""
    args = data.init_args
    where = f"the {row} config ({' + '.join(paths)})"
    if reads_neighbors(data):
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


def _check_retrieval(cfg: PipelineSettings, where: str, args: Namespace) -> None:
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
