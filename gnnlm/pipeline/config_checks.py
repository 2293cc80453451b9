"""The checks that run when a pipeline config loads, before any work: the settings that span
several files, and (``check_machine``) what the config asks of this machine.

A pipeline YAML names, per stage, its settings; trained parts (the base LM and the heads) are
``gnnlm fit`` YAMLs given as a list. ``check_contracts`` refuses, with one message each:

- kNN settings that the stored neighbours cannot serve (``knn.ks``/``knn.k`` above
  ``neighbors.K``);
- a corpus or tokenizer other than the base LM's (``gnnlm.pipeline.corpus_checks``);
- a size or count below 1 in a trained part's config (``FIT_COUNTS``), and a work directory
  that cannot be one (an empty path, a file);
- feature windows beyond the base LM's context and an index factory faiss cannot build for
  its hidden size, where ``gnnlm.pipeline.base_lm_shape`` knows them at load.

A head's config is checked against the retrieval artifacts the pipeline builds once LightningCLI
has parsed it (``gnnlm.pipeline.head_checks``), still before any stage runs.

``check_machine`` (``gnnlm pipeline``) refuses GPU settings on a machine without a GPU, a
trained part on several processes (DDP is ``gnnlm fit``'s alone), an ``hf:<folder>`` base LM
whose folder is not there, and a corpus neither here nor downloadable now. Settings out of
range within one section are each dataclass's own check (``gnnlm.pipeline.settings``).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gnnlm.models.settings import DEFAULT_CONTEXT, check_hf_folder, is_hf, no_context
from gnnlm.pipeline.base_lm_shape import base_lm_shape
from gnnlm.pipeline.config_files import merged_yaml, yaml_list
from gnnlm.pipeline.corpus_checks import check_one_corpus
from gnnlm.pipeline.run_corpus import check_run_corpus
from gnnlm.utils.devices import (
    check_accelerator,
    check_available,
    check_faiss_available,
    trainer_processes,
)
from gnnlm.workdir.layout import check_workdir

if TYPE_CHECKING:
    from gnnlm.pipeline.settings import PipelineSettings

# the stages ``rebuild`` may name, besides the heads' rows and ``base_lm_xl``
# (``gnnlm.pipeline.dependencies``, which also rebuilds the stages reading them)
STAGES = ("tokens", "base_lm", "features", "index", "neighbors", "knn_cache", "pq", "heads",
          "ablations")


def check_contracts(cfg: PipelineSettings, files: Sequence[str] = ()) -> None:
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
    # builds are ``head_checks.check_head``'s, on the parsed config, when the pipeline runs
    for chain in cfg.fit_chains():
        _check_fit_counts(chain, merged_yaml(chain))
    for paths in (yaml_list(cfg.base_lm.config),):
        merged_yaml(paths)
    _check_against_base_lm(cfg)
    check_one_corpus(cfg, files)


# the sizes and counts of a `gnnlm fit` config's model and data sections: each must be >= 1
# when set, or the fit would fail, or run on nothing, only after the stages before it (the
# counts of windows, graph.k, retrieved and eval_ks, are `head_checks.check_head`'s)
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


def _check_against_base_lm(cfg: PipelineSettings) -> None:
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


def check_machine(cfg: PipelineSettings) -> None:
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
        where = f"the `gnnlm fit` config {' + '.join(chain)}"
        check_accelerator(trainer.get("accelerator"), where)
        _check_one_process(trainer, where)
    check_run_corpus(cfg)


def _check_one_process(trainer: dict, where: str) -> None:
    """Refuse a trained part that Lightning would train on several processes. The pipeline
    fits each part inside its own process (``gnnlm.pipeline.training.fit_with_cli``), where
    Lightning's DDP launcher would start the whole ``gnnlm pipeline`` command again on every
    other rank, each running the stages before that fit in the same work directory."""
    try:
        processes = trainer_processes(trainer)
    except ValueError as error:
        raise ValueError(f"{where} sets trainer.devices: {trainer.get('devices')!r}, which "
                         f"Lightning refuses: {' '.join(str(error).split())}") from None
    if processes is not None and processes > 1:
        raise ValueError(f"{where} trains on {processes} processes (trainer.devices × "
                         f"trainer.num_nodes), but the pipeline trains each part in the "
                         f"process that runs it: set trainer.devices: 1 and num_nodes: 1 there. "
                         f"A base LM trained under DDP by `gnnlm fit` (--trainer.strategy=ddp "
                         f"--trainer.devices=N) joins the pipeline as base_lm.ckpt.")
