"""``gnnlm pipeline -c CONFIG``: every stage, in order, each skipped when its artifact is complete.

    tokens → base LM (trained with LightningCLI unless given) → features (train/valid/test)
    → per key type: index → neighbours → kNN-LM caches → (k, T, λ) fitted on valid
    → PQ codes → heads (GNN-LM, SPALM, learned W_ds) → GNN+kNN, W_ds+base;  ablations
    → reports/<name>/results.json, results.md, per-token scores and plots

This module only orders the stages; each lives in its own module (see ARCHITECTURE.md), takes the
``Workdir`` and says which split, key and similarity it means.
"""
from __future__ import annotations

import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import numpy as np

from gnnlm.gnn.pq import build_pq
from gnnlm.models import BaseLM, is_hf, load_base_lm
from gnnlm.models.hf import DEFAULT_CONTEXT
from gnnlm.models.settings import gguf_file, no_context
from gnnlm.pipeline import data_checks
from gnnlm.pipeline.ablations import (
    ABLATIONS_VERSION,
    memory_rows,
    neighbours_label,
    outdated,
    run_ablations,
    scores_label,
)
from gnnlm.pipeline.config import PipelineConfig, load_config
from gnnlm.pipeline.config_files import yaml_list
from gnnlm.pipeline.dependencies import cascade_line, gnn_reads_pq, heads_read_neighbors
from gnnlm.pipeline.fit_configs import check_fit_configs
from gnnlm.pipeline.results import KeyRetrieval, Results
from gnnlm.pipeline.scoring import head_logprobs
from gnnlm.pipeline.settings import CorpusConfig
from gnnlm.pipeline.stage_times import StageTimes, timed
from gnnlm.pipeline.training import fit_with_cli
from gnnlm.retrieval.features import build_all_features
from gnnlm.retrieval.index import build_index
from gnnlm.retrieval.knn import fit_and_score, fit_lambda, interpolate
from gnnlm.retrieval.knn_cache import build_knn_cache, open_knn_cache, search_facts
from gnnlm.retrieval.neighbors import build_neighbors
from gnnlm.retrieval.sanity import retrieval_sanity
from gnnlm.text.tokens import HFTokenizer, TokenizerConfig, TokenStore, build_tokens
from gnnlm.text.words import SUBWORD_KINDS, scored_words
from gnnlm.utils import environment
from gnnlm.utils.metrics import check_finite
from gnnlm.utils.stopping import Stopped
from gnnlm.workdir import rows
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.checkpoints import datamodule_args
from gnnlm.workdir.layout import EVAL_SPLITS, SPLITS, Workdir
from gnnlm.workdir.lock import lock_workdir
from gnnlm.workdir.manifests import is_complete, open_array, read_manifest
from gnnlm.workdir.refusals import changed_hint


def stage_base_lm(cfg: PipelineConfig, workdir: Workdir) -> tuple[BaseLM, TokenStore, dict, str]:
    """The frozen base LM, the tokens it reads (training it first when needed), the trained
    model's manifest, and where the LM is (relative to the work directory when inside it).

    A base LM trained here with the pipeline's ``corpus:`` section is trained on that corpus
    (``CorpusConfig``): the tokens are built first, the section is passed to ``gnnlm fit``, and
    the tokens' fingerprint is an input of the trained model, so another corpus or tokenizer
    is never read with this model's weights."""
    spec = cfg.base_lm
    store = None
    if spec.ckpt is None:
        inputs: dict = {}
        if cfg.corpus is not None:
            store = stage_tokens(cfg, workdir, "")
            inputs = {"tokens": store.manifest["fingerprint"]}
        manifest = fit_with_cli(workdir, "base_lm", yaml_list(spec.config), inputs, predict=False,
                                rebuild=cfg.rebuilds("base_lm"),
                                overrides=cfg.corpus.fit_args() if cfg.corpus else None)
        ckpt = str(workdir.model("base_lm") / manifest["ckpt"])
    else:
        ckpt, manifest = spec.ckpt, {}
    model = load_base_lm(ckpt, spec.options() if is_hf(ckpt) else None)
    existed = is_complete(workdir.tokens)
    store = store or stage_tokens(cfg, workdir, ckpt)
    try:
        check_vocabulary(model, store, ckpt)
    except ValueError:
        if not existed:  # this run's tokens fail validation: leave nothing that looks complete
            shutil.rmtree(workdir.tokens)
        raise
    location = ckpt if ckpt.startswith("hf:") else workdir.relative(ckpt)
    return model, store, manifest, location


def check_vocabulary(model: BaseLM, store: TokenStore, ckpt: str) -> None:
    """Token ids must mean the same to the model and the corpus. A Hugging Face model may have
    more outputs than its tokenizer has tokens (vocabularies padded to a multiple of 64 or 128:
    Pythia, Qwen2, Phi, OPT): the extra rows are never targets, and keeping them in the softmax
    keeps the model's own probabilities. When the model's folder has its own tokenizer, the
    corpus's must be that one, token for token. A ``gnnlm fit`` checkpoint records the
    fingerprint of the vocabulary it was trained on (the ordered token list): the corpus's must
    be the same; equal sizes are not enough (two word vocabularies capped at the same size give
    the same ids to different words). Checkpoints written before it was recorded have none,
    and only their size is compared."""
    hf = is_hf(ckpt)
    if store.vocab_size > model.vocab_size or (not hf and store.vocab_size != model.vocab_size):
        raise ValueError(f"The base LM {model.name} has {model.vocab_size} outputs but the "
                         f"tokenizer of the corpus has {store.vocab_size} types: they must "
                         f"match (for a Hugging Face LM use tokenizer kind 'hf', which without "
                         f"a path is the model's own).")
    corpus = store.vocab_fingerprint
    if not hf:
        recorded = getattr(model, "vocab_fingerprint", None)
        if recorded is not None and recorded != corpus:
            raise ValueError(f"The base LM {ckpt} was trained on another vocabulary "
                             f"(fingerprint {recorded}, recorded in the checkpoint) than the "
                             f"corpus was tokenized with (fingerprint {corpus}, tokens in "
                             f"{store.path}): token ids would mean different words. Read the "
                             f"corpus the base LM was trained on with its tokenizer (leave out "
                             f"the pipeline's corpus section: the checkpoint names them), or "
                             f"train a base LM on this corpus (base_lm.config).")
        return
    folder = Path(ckpt.removeprefix("hf:"))
    if not folder.is_dir() and gguf_file(ckpt) is None:  # a Hub name: no local tokenizer
        return
    if store.manifest.get("tokenizer_path") == str(folder):
        # the tokens are of the model's own tokenizer, read this run by ``build_tokens`` and
        # found to be the one they were made with: a GGUF's is not read a second time
        return
    try:
        own = HFTokenizer.from_path(str(folder))
    except FileNotFoundError:  # the folder has no tokenizer to compare with
        return
    if own.vocab_fingerprint() != corpus:
        raise ValueError(f"The corpus was tokenized with another vocabulary (fingerprint "
                         f"{corpus}, tokens in {store.path}) than the base LM's own tokenizer "
                         f"in {folder} ({own.vocab_fingerprint()}): token ids would mean "
                         f"different words. Use tokenizer kind 'hf' without a path (the "
                         f"model's own).")


def stage_tokens(cfg: PipelineConfig, workdir: Workdir, ckpt: str) -> TokenStore:
    """The corpus's token streams: the pipeline's ``corpus:`` section, or else the corpus and
    tokenizer a ``gnnlm fit`` checkpoint names (``CorpusConfig`` says how the two agree)."""
    corpus = cfg.corpus
    if corpus is None and not is_hf(ckpt):
        data = datamodule_args(ckpt)
        if "corpus" in data:  # a `gnnlm fit` checkpoint names its corpus and tokenizer
            tok = data.get("tokenizer") or TokenizerConfig()
            corpus = CorpusConfig(name=data["corpus"], path=data.get("corpus_path"),
                                 data_dir=data.get("data_dir"), tokenizer=tok)
    if corpus is None:
        raise ValueError(f"Cannot tell which corpus and tokenizer the base LM {ckpt} reads: "
                         f"add a `corpus:` section to the pipeline config.")
    tokenizer = corpus.tokenizer
    if not isinstance(tokenizer, TokenizerConfig):  # as a checkpoint saved it
        tokenizer = TokenizerConfig(**dict(tokenizer))
    if tokenizer.kind == "hf" and not tokenizer.path:  # the Hugging Face model's own (a GGUF's)
        tokenizer = replace(tokenizer, path=ckpt.removeprefix("hf:"))
    return build_tokens(workdir.tokens, corpus.name, corpus.path, corpus.data_dir,
                        tokenizer, rebuild=cfg.rebuilds("tokens"))


def stage_features(cfg: PipelineConfig, model: BaseLM, store: TokenStore, workdir: Workdir,
                   location: str) -> dict:
    """Features of every split with the sliding-window protocol. The windows were checked at
    load where the base LM's shape was known there (``base_lm_shape.base_lm_shape``); the
    checks here are the backstop for a model only loading tells (a Hub name not in the local cache).
    The Hugging Face default context (at most ``DEFAULT_CONTEXT``) is said here, once, and each
    features manifest records the context and stride used (``config``, ``protocol``)."""
    fc = cfg.features
    limit = model.context_length
    if fc.context is not None and limit is not None and fc.context > limit:
        raise ValueError(f"features.context = {fc.context} exceeds the base LM's context "
                         f"({model.name}: {limit} positions): lower it.")
    context = fc.context or limit
    if context is None:
        raise ValueError(no_context(f"the base LM {model.name}"))
    if fc.context is None and is_hf(location) and context > DEFAULT_CONTEXT:
        context = DEFAULT_CONTEXT
        print(f"features.context not set: windows of {context} tokens (the model allows "
              f"{model.context_length}; set features.context to use more).", flush=True)
    stride = fc.stride or max(1, context // 2)
    if fc.stride is not None and fc.stride > context:
        raise ValueError(f"features.stride = {fc.stride} exceeds the context ({context} "
                         f"tokens): lower it, or leave it unset for half the context.")
    return build_all_features(model, store, workdir, context, stride, batch_size=fc.batch_size,
                              device=fc.device, max_tokens=fc.max_tokens, location=location,
                              rebuild=cfg.rebuilds("features"), devices=fc.devices)


def index_use(cfg: PipelineConfig, key: str) -> Optional[str]:
    """What the FAISS index of ``key`` is built for, or None when nothing reads one: the
    neighbours search it (``neighbors.backend: index``), or the ablations' approximate-search
    rows read the primary key's (Xu et al.'s FAISS mask and score). Exact neighbours without
    those rows need no index: none is built (on the GPU table, minutes saved)."""
    if cfg.neighbors.backend == "index":
        return "neighbours"
    if cfg.ablations.enabled and key == cfg.knn.primary:
        return "ablations (approximate search)"
    return None


def stage_retrieval(cfg: PipelineConfig, workdir: Workdir, key: str, leakage_window: int
                    ) -> KeyRetrieval:
    """Index (where one is read: ``index_use``), neighbours, and kNN caches of valid/test for
    one key type. Train queries (masked for leakage) are searched for the primary key only, and
    only when a head reads neighbours (``heads_read_neighbors``): the heads' graphs and
    memories read them; kNN-LM reads valid and test only."""
    metric = cfg.knn.metric
    # the index measures its search settings at the depth the neighbours search: K, and K + W
    # + 1 wide for the train queries masked for leakage (``gnnlm.retrieval.neighbors``)
    K = cfg.neighbors.K
    width = K + leakage_window + 1 if key == cfg.knn.primary and leakage_window else K
    use = index_use(cfg, key)
    index = None
    if use is not None:
        with timed(f"index[{key}]"):
            index = build_index(workdir, key, metric, cfg.index,
                                rebuild=cfg.rebuilds("index"), search_k=K, search_width=width)
    splits = SPLITS if key == cfg.knn.primary and heads_read_neighbors(cfg) else EVAL_SPLITS
    with timed(f"neighbors[{key}]"):
        neighbors = {split: build_neighbors(workdir, split, key, metric, cfg.neighbors,
                                            leakage_window=leakage_window,
                                            rebuild=cfg.rebuilds("neighbors"))
                     for split in splits}
    with timed(f"knn_cache[{key}]"):
        caches = {split: build_knn_cache(workdir, split, key, metric, cfg.knn.scores,
                                         rebuild=cfg.rebuilds("knn_cache"))
                  for split in EVAL_SPLITS}
    return KeyRetrieval(index=index, neighbors=neighbors, knn_caches=caches, index_use=use)


def search_label(workdir: Workdir, retrieval: KeyRetrieval) -> dict:
    """What a kNN-LM row's neighbours and scores are, from its test cache's manifest (an index
    searched with re-ranking gives exact scores whatever ``knn.scores`` says)."""
    manifest = retrieval.knn_caches["test"]
    facts = search_facts(manifest, workdir)
    return {"neighbours": neighbours_label(facts),
            "scores": scores_label(facts),
            # the cache's own setting: what `gnnlm.load` searches new text with
            "knn_scores": manifest["scores"]}


def knn_caches(cfg: PipelineConfig, workdir: Workdir, key: str,
               lm_logprob: Optional[dict] = None) -> dict:
    """The valid/test caches of ``key``; ``lm_logprob`` swaps in another model's scores."""
    return {s: open_knn_cache(workdir.knn_cache(key, cfg.knn.metric, cfg.knn.scores, s),
                              None if lm_logprob is None else lm_logprob[s])[1]
            for s in EVAL_SPLITS}


def head_inputs(workdir: Workdir) -> dict:
    """Fingerprints of the artifacts heads read (so a rebuilt datastore retrains them)."""
    inputs = {f"features_{s}": read_manifest(workdir.features(s))["fingerprint"] for s in SPLITS}
    for nb in workdir.train_neighbors():
        inputs[f"neighbors_{nb.parent.name}"] = read_manifest(nb)["fingerprint"]
    return inputs


def stage_heads(cfg: PipelineConfig, workdir: Workdir) -> tuple[dict[str, dict], Optional[dict]]:
    """Every configured head, trained once, by row, and the PQ codes' manifest when GNN-LM
    reads them (built first)."""
    heads, pq = {}, None
    for row, configs in cfg.heads().items():
        if row == rows.GNN and gnn_reads_pq(configs):
            with timed("pq"):
                pq = build_pq(workdir, cfg.knn.primary, cfg.pq, rebuild=cfg.rebuilds("pq"))
        with timed(row):  # training and scoring (the manifest has each: train/predict_seconds)
            heads[row] = fit_with_cli(workdir, rows.model_folder(row), configs,
                                      head_inputs(workdir), rebuild=cfg.rebuilds(row))
    return heads, pq


def stage_ablations(cfg: PipelineConfig, workdir: Workdir, retrieval: dict[str, KeyRetrieval]
                    ) -> Optional[dict]:
    """The Xu et al. table and, with ``ablations.memory_lm``, Transformer-XL memory on/off."""
    stage = cfg.ablations
    if not stage.wanted:
        return None
    inputs = {key: r.knn_caches["test"]["fingerprint"] for key, r in retrieval.items()}
    if stage.memory_lm:
        memory = fit_with_cli(workdir, "base_lm_xl", yaml_list(stage.memory_lm), {},
                              predict=False, rebuild=cfg.rebuilds("base_lm_xl"))
        inputs["memory_lm"] = memory["fingerprint"]
    builder = ArtifactBuilder(workdir.ablations, kind="ablations",
                              config={**asdict(stage), "grid": cfg.knn.grid(),
                                      "metric": cfg.knn.metric, "keys": cfg.knn.keys,
                                      "version": ABLATIONS_VERSION},
                              inputs=inputs,
                              rebuild=cfg.rebuilds("ablations") or outdated(workdir.ablations))
    if builder.is_complete():
        return read_manifest(workdir.ablations)["result"]
    with builder:
        result = {}
        if stage.enabled:
            result = run_ablations(stage, workdir, cfg.knn.keys, cfg.knn.metric, cfg.knn.scores,
                                   cfg.knn.grid(), builder.partial)
        if stage.memory_lm:
            result["memory"] = memory_rows(workdir, "base_lm_xl")
        builder.finish(extra={"result": result})
    return result


def run(cfg: PipelineConfig) -> dict:
    """Run every stage; return the results dict also written to ``reports/<name>/``, beside
    ``stage_times.json`` (this run's wall time of each stage); with ``copy_report_to``, copy
    that folder there too."""
    workdir = Workdir(cfg.root)
    workdir.check_layout()
    check_fit_configs(cfg)  # every trained part's config parses and fits, before any work
    workdir.root.mkdir(parents=True, exist_ok=True)
    # one run per work directory, released when the run ends however it ends (a stop signal)
    with lock_workdir(workdir.root, "pipeline"):
        cascade = cascade_line(cfg, workdir)
        if cascade:  # before any work: what --rebuild discards besides what it names
            print(cascade, flush=True)
        times = StageTimes()
        try:
            with times.running():
                report = run_stages(cfg, workdir)
        except Stopped as stop:  # told to stop (a time limit): where it got, for the record
            times.write(workdir.report(cfg.name), environment.describe(), stopped=str(stop))
            if cfg.copy_report_to:
                Path(cfg.copy_report_to).mkdir(parents=True, exist_ok=True)
                shutil.copy2(workdir.report(cfg.name) / "stage_times.json", cfg.copy_report_to)
            raise
        times.write(workdir.report(cfg.name), report["environment"])
        if cfg.copy_report_to:
            shutil.copytree(workdir.report(cfg.name), cfg.copy_report_to, dirs_exist_ok=True)
        return report


def run_stages(cfg: PipelineConfig, workdir: Workdir) -> dict:
    """Every stage in order, each timed (``stage_times.timed``); returns the report's dict."""
    from gnnlm.pipeline.report import write_report

    with timed("base_lm"):
        model, store, base_manifest, location = stage_base_lm(cfg, workdir)
    with timed("features"):
        features = stage_features(cfg, model, store, workdir, location)
    results = Results(name=cfg.name, dataset=store.manifest["config"]["corpus"],
                      level=store.level, base_lm=model.identity(),
                      base_lm_manifest=base_manifest, features=features)
    if store.level in SUBWORD_KINDS:  # the words valid's and test's scored tokens cover
        results.words = {s: scored_words(store, s, int(features[s]["n"])) for s in EVAL_SPLITS}
    results.scores[rows.BASE] = base_scores(workdir)
    score_knn_rows(cfg, workdir, results)
    results.heads, results.pq = stage_heads(cfg, workdir)
    for name, manifest in results.heads.items():
        results.scores[name] = {s: head_logprobs(workdir, manifest["config"]["name"], s)
                                for s in EVAL_SPLITS}
    with timed("interpolations"):
        score_head_interpolations(cfg, workdir, results)
    for name, row in results.scores.items():  # the report's perplexities are never inf or nan
        for s, values in row.items():
            check_finite(values, f"the {name} row's {s} log p(target)",
                         f"that token gets probability 0 or NaN (λ = 1 leaves the LM no share "
                         f"of it); check the row's inputs with `gnnlm verify {workdir.root}`.")
    if cfg.ablations.wanted:
        with timed("ablations"):
            results.ablations = stage_ablations(cfg, workdir, results.retrieval)
    with timed("data_checks"):
        results.data_checks = data_checks.measure(workdir, cfg.knn.primary, cfg.knn.metric,
                                                  store)
    results.environment = environment.describe()  # after the stages: CUDA has started
    with timed("report"):
        return write_report(workdir, results)


def base_scores(workdir: Workdir) -> dict[str, np.ndarray]:
    """The base LM's log p(target) of valid and test, from the features."""
    scores = {s: np.asarray(open_array(workdir.features(s), "lm_logprob")) for s in EVAL_SPLITS}
    for s in EVAL_SPLITS:  # a perplexity over these is never inf or nan
        check_finite(scores[s], f"{workdir.features(s) / 'lm_logprob.bin'}",
                     changed_hint(workdir.features(s), "features"))
    return scores


def score_knn_rows(cfg: PipelineConfig, workdir: Workdir, results: Results) -> None:
    """Retrieval of every key type, and its kNN-LM row: (k, T, λ) fitted on valid, test scored
    (Khandelwal et al. 2020); the primary key's R(c_t) for the report's recall buckets."""
    # a train feature has read this many tokens back: the leakage rule's window
    leakage_window = (cfg.neighbors.leakage_window if cfg.neighbors.leakage_window is not None
                      else results.features["train"]["config"]["context"])  # 0: no masking
    for key in cfg.knn.keys:
        retrieval = results.retrieval[key] = stage_retrieval(cfg, workdir, key, leakage_window)
        with timed(f"knn_fit[{key}]"):  # (k, T, λ) on valid, test scored
            caches = knn_caches(cfg, workdir, key)
            result = fit_and_score(caches["valid"], caches["test"], *cfg.knn.grid())
            results.retrieval_sanity[key] = retrieval_sanity(caches["valid"], cfg.knn.metric,
                                                             result, cfg.knn.grid())
        results.add_interpolation(rows.knn_row(key, cfg.knn.primary), result.pop("test_logprob"),
                                  {**result, "similarity": cfg.knn.metric, "key": key,
                                   **search_label(workdir, retrieval)},
                                  valid_tokens=len(caches["valid"]["lm_logprob"]))
        if key == cfg.knn.primary:
            results.knn_recall = np.asarray(caches["test"]["hits"]).sum(1)


def score_head_interpolations(cfg: PipelineConfig, workdir: Workdir, results: Results) -> None:
    """GNN+kNN: the GNN's distribution interpolated with kNN-LM's (Meng et al. 2022 eq. 5); each
    Transformer-XL row of the SPALM comparison with kNN-LM, (k, T, λ) fitted and with SPALM's k
    (the ceiling of what its retrieval adds); each learned W_ds interpolated with the base LM
    (Xu et al. 2023 §4.1)."""
    scores, grid = results.scores, cfg.knn.grid()
    with_knn = [(rows.GNN_KNN, rows.GNN, grid)] if rows.GNN in results.heads else []
    for head in rows.KNN_CEILING_HEADS:
        if head in results.heads:
            with_knn += [(rows.with_knn(head), head, grid),
                         (rows.with_knn(head, rows.SPALM_K), head, ([rows.SPALM_K], *grid[1:]))]
    primary = cfg.knn.primary
    for name, head, head_grid in with_knn:
        caches = knn_caches(cfg, workdir, primary, scores[head])
        result = fit_and_score(caches["valid"], caches["test"], *head_grid)
        results.add_interpolation(name, result.pop("test_logprob"),
                                  {**result, "similarity": cfg.knn.metric, "key": primary,
                                   **search_label(workdir, results.retrieval[primary])},
                                  valid_tokens=len(caches["valid"]["lm_logprob"]))
    for name in cfg.learned_wds.named():
        lam, valid_ppl = fit_lambda(scores[rows.BASE]["valid"], scores[name]["valid"], grid[2])
        results.add_interpolation(rows.with_base(name),
                                  interpolate(scores[rows.BASE]["test"], scores[name]["test"],
                                              lam),
                                  {"lambda": lam, "valid_ppl": valid_ppl},
                                  valid_tokens=len(scores[rows.BASE]["valid"]))


def main(args: list[str]) -> None:
    """``gnnlm pipeline``: runs every stage and writes its artifacts under ``workdir`` (tokens,
    features, index, neighbors, knn_cache, pq, heads, ablations) and the report
    ``reports/<name>/`` (results.json, results.md, per-token scores, plots); prints the table."""
    from gnnlm.pipeline.report import print_table

    cfg = load_config(args, description=main.__doc__, machine=True)
    print_table(run(cfg), Workdir(cfg.root))
