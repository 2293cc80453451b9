"""``gnnlm pipeline -c CONFIG``: every stage, in order, each skipped when its artifact is complete.

    tokens → base LM (trained with LightningCLI unless given) → features (train/valid/test)
    → per key type: index → neighbours → kNN-LM caches → (k, T, λ) fitted on valid
    → PQ codes → GNN-LM head → GNN+kNN;  SPALM head;  learned W_ds head;  ablations
    → reports/<name>/results.json, results.md, per-token scores and plots

Trainable parts (base LM and heads) are ``gnnlm fit`` YAML configs run through LightningCLI with
the pipeline's work directory; each becomes an artifact ``<workdir>/heads/<name>/`` holding its
checkpoint and per-token log-probabilities of the valid and test targets, so that every row of
the report scores exactly the same tokens.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from gnnlm.ablations import AblationStage, memory_rows, run_ablations
from gnnlm.artifacts import ArtifactBuilder, open_array, read_manifest
from gnnlm.datastore import build_all_features, features_dir
from gnnlm.index import IndexConfig, build_index, index_dir
from gnnlm.knn import (
    build_knn_cache,
    check_lambda,
    check_temperature,
    fit,
    interpolate,
    knn_lm_logprob,
)
from gnnlm.models import BaseLM, load_base_lm
from gnnlm.neighbors import NeighborsConfig, build_neighbors, neighbors_dir
from gnnlm.pq import PQConfig, build_pq
from gnnlm.tokens import TokenizerConfig, TokenStore, build_tokens

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")


@dataclass
class BaseLMStage:
    """``ckpt``: a ``gnnlm fit`` checkpoint or ``hf:<name-or-folder>``; when None the base LM is
    trained with ``config`` (a ``gnnlm fit`` YAML) into ``<workdir>/heads/base_lm``."""
    ckpt: Optional[str] = None
    config: Optional[str] = None


@dataclass
class CorpusStage:
    """Where tokens come from when the base LM is not trained here (a trained LM's checkpoint
    already names its corpus and tokenizer). For a Hugging Face base LM use tokenizer kind
    ``hf`` with the model's path."""
    name: str = "wikitext-2"
    path: Optional[str] = None
    data_dir: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class FeaturesStage:
    """Sliding-window protocol (defaults: the base LM's context, stride context/2)."""
    context: Optional[int] = None
    stride: Optional[int] = None
    batch_size: int = 32
    device: str = "auto"
    max_tokens: Optional[dict[str, int]] = None  # per-split prefixes, for quick runs


@dataclass
class KNNStage:
    """Keys to compare (the first is the one the GNN+kNN row and the headline kNN-LM use), the
    similarity, the (k, T, λ) grid fitted on valid, and FAISS or exact recomputed scores.
    ``k``/``temperature``/``lambda_`` pin one value (W&B sweeps set them)."""
    keys: list[str] = field(default_factory=lambda: ["final", "att"])
    metric: str = "cos"
    scores: str = "faiss"
    ks: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])
    temperatures: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                                                               1.0, 2.0])
    lambdas: list[float] = field(default_factory=lambda: [round(0.05 * i, 2) for i in range(20)])
    k: Optional[int] = None
    temperature: Optional[float] = None
    lambda_: Optional[float] = None

    def grid(self) -> tuple[list[int], list[float], list[float]]:
        ks = [self.k] if self.k is not None else list(self.ks)
        ts = [self.temperature] if self.temperature is not None else list(self.temperatures)
        ls = [self.lambda_] if self.lambda_ is not None else list(self.lambdas)
        check_temperature(ts)
        check_lambda(ls)
        return ks, ts, ls


@dataclass
class HeadStage:
    """A head trained with a ``gnnlm fit`` YAML (None: the row is skipped)."""
    config: Optional[str] = None


@dataclass
class LearnedWdsStage:
    """Learned W_ds heads (Xu et al. §4.1–4.2), one row each: ``configs`` are ``gnnlm fit``
    YAMLs of ``LearnedDatastoreLM`` (e.g. n = 1 and n = 3 embeddings per word). The first is
    the ``learned_wds`` row, the others ``learned_wds[n=…]``."""
    configs: list[str] = field(default_factory=list)

    def named(self) -> dict[str, str]:
        rows = {}
        for i, path in enumerate(self.configs):
            n = (yaml.safe_load(Path(path).read_text())["model"].get("init_args") or {}).get(
                "embeddings_per_word", 1)
            rows["learned_wds" if i == 0 else f"learned_wds[n={n}]"] = path
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
    learned_wds: LearnedWdsStage = field(default_factory=LearnedWdsStage)
    ablations: AblationStage = field(default_factory=AblationStage)
    rebuild: bool = False


def auto_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


# -- trainable stages through LightningCLI ---------------------------------------------------
def fit_with_cli(name: str, config: str, workdir: Path, extra_inputs: dict,
                 predict: bool = True) -> dict:
    """Train ``config`` (a ``gnnlm fit`` YAML) into ``<workdir>/heads/<name>`` unless done.

    The artifact holds ``model.ckpt`` and, with ``predict`` (heads), per-token log-probabilities
    of the valid and test targets. When the config's ``ModelCheckpoint`` monitors a metric, the
    weights are those of its best checkpoint (a base LM trained too long on WikiText-2 overfits:
    the features and the report then come from the best validation step, not the last).
    """
    # LightningCLI is slow to import; only needed here
    from gnnlm.cli import lightning_main

    out = workdir / "heads" / name
    builder = ArtifactBuilder(out, kind="trained_model",
                              config={"name": name, "yaml": Path(config).read_text()},
                              inputs=extra_inputs)
    if builder.is_complete():
        return read_manifest(out)
    t0 = time.perf_counter()
    with builder:
        cli = lightning_main(["fit", "-c", config, f"--data.init_args.workdir={workdir}",
                              f"--trainer.default_root_dir={workdir / 'logs' / name}"])
        restore_best_weights(cli)
        ckpt = builder.file("model.ckpt")
        cli.trainer.save_checkpoint(ckpt)
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        extra = {"ckpt": "model.ckpt", "train_seconds": round(time.perf_counter() - t0, 2),
                 "metrics": metrics, "model_class": type(cli.model).__name__}
        if predict:  # heads: per-token scores on exactly the report's tokens
            for split in EVAL_SPLITS:
                n = read_manifest(features_dir(workdir, split))["n"]
                builder.array(f"{split}_logprob", np.float32, (n,))[...] = predict_logprobs(
                    cli.model, cli.datamodule, split, n, cli.trainer.precision)
            extra.update(predict_extras(cli.model))
        return builder.finish(extra=extra)


def restore_best_weights(cli) -> None:
    """Load the monitored checkpoint callback's best weights into ``cli.model``, if any."""
    callback = cli.trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    if callback is not None and callback.monitor and best:
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
        cli.model.load_state_dict(state)


def predict_logprobs(model, datamodule, split: str, n: int, precision: str = "32-true"
                     ) -> np.ndarray:
    """log p(target) for every position of ``split``, in position order, via ``predict`` (on one
    device, with the training run's precision)."""
    import pytorch_lightning as pl

    datamodule.hparams.predict_split = split
    trainer = pl.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, precision=precision)
    outputs = trainer.predict(model, datamodule=datamodule)
    positions = torch.cat([o["positions"] for o in outputs]).numpy()
    logprob = np.full(n, np.nan, dtype=np.float32)
    logprob[positions] = torch.cat([o["logprob"] for o in outputs]).numpy()
    if len(positions) != n or np.isnan(logprob).any():
        raise RuntimeError(f"predict on {split} scored {len(positions)} positions, expected each "
                           f"of the {n} exactly once: the evaluation data module must partition "
                           f"the split (no eval_tokens limit for reports).")
    return logprob


def predict_extras(model) -> dict:
    """Per-model extras saved beside the scores (SPALM: gate values over the test split)."""
    histogram = getattr(model, "gate_histogram", None)
    if histogram is None:
        return {}
    counts = histogram.numpy()
    centres = (np.arange(len(counts)) + 0.5) / len(counts)
    return {"gate": {"histogram": counts.tolist(),
                     "mean": float((counts * centres).sum() / max(counts.sum(), 1))}}


def head_logprobs(manifest_dir: Path, split: str) -> np.ndarray:
    return np.asarray(open_array(manifest_dir, f"{split}_logprob"))


# -- the stages ------------------------------------------------------------------------------
def stage_base_lm(cfg: PipelineConfig, workdir: Path) -> tuple[BaseLM, TokenStore, dict]:
    """The frozen base LM and the tokens it reads (training it first when needed)."""
    spec = cfg.base_lm
    if spec.ckpt is None:
        if spec.config is None:
            raise ValueError("base_lm needs `ckpt` (a checkpoint or hf:<name>) or `config` (a "
                             "`gnnlm fit` YAML to train one).")
        manifest = fit_with_cli("base_lm", spec.config, workdir, {}, predict=False)
        ckpt = str(workdir / "heads" / "base_lm" / manifest["ckpt"])
    else:
        ckpt, manifest = spec.ckpt, {}
    model = load_base_lm(ckpt)
    store = stage_tokens(cfg, workdir, ckpt)
    if store.vocab_size != model.vocab_size:
        raise ValueError(f"The base LM {model.name} has {model.vocab_size} outputs but the "
                         f"tokenizer of {store.path} has {store.vocab_size} types: they must "
                         f"match (for a Hugging Face LM use tokenizer kind 'hf' with its path).")
    return model, store, manifest


def stage_tokens(cfg: PipelineConfig, workdir: Path, ckpt: str) -> TokenStore:
    corpus = cfg.corpus
    if corpus is None and not ckpt.startswith("hf:"):
        from gnnlm.training import datamodule_args

        data = datamodule_args(ckpt)
        if "corpus" in data:  # a `gnnlm fit` checkpoint names its corpus and tokenizer
            tok = data.get("tokenizer") or TokenizerConfig()
            corpus = CorpusStage(name=data["corpus"], path=data.get("corpus_path"),
                                 data_dir=data.get("data_dir"), tokenizer=tok)
    if corpus is None:
        raise ValueError(f"Cannot tell which corpus and tokenizer the base LM {ckpt} reads: "
                         f"add a `corpus:` section to the pipeline config.")
    return build_tokens(workdir / "tokens", corpus.name, corpus.path, corpus.data_dir,
                        corpus.tokenizer)


def stage_features(cfg: PipelineConfig, model: BaseLM, store: TokenStore, workdir: Path) -> dict:
    fc = cfg.features
    context = fc.context or model.context_length
    stride = fc.stride or max(1, context // 2)
    limits = fc.max_tokens or {}
    return {split: build_all_features(
        model, store, workdir, [split], context, stride, batch_size=fc.batch_size,
        device=auto_device(fc.device), max_tokens=limits.get(split), rebuild=cfg.rebuild)[split]
        for split in SPLITS}


def retrieval_tag(key: str, metric: str) -> str:
    return f"{key}-{metric}"


def stage_retrieval(cfg: PipelineConfig, key: str, workdir: Path, leakage_window: int) -> dict:
    """Index, neighbours, and kNN caches of valid/test for one key type. Train queries (masked
    for leakage) are searched for the first key only: the one the heads' graphs and memories
    read (``<key>-<metric>``); the other keys serve the kNN-LM comparison."""
    tag = retrieval_tag(key, cfg.knn.metric)
    index_cfg = IndexConfig(**{**asdict(cfg.index), "key": key, "metric": cfg.knn.metric})
    build_index(features_dir(workdir, "train"), index_dir(workdir, tag), index_cfg,
                rebuild=cfg.rebuild)
    neighbors, caches = {}, {}
    for split in SPLITS if key == cfg.knn.keys[0] else EVAL_SPLITS:
        neighbors[split] = build_neighbors(
            split, features_dir(workdir, split), features_dir(workdir, "train"),
            index_dir(workdir, tag), neighbors_dir(workdir, split, tag), cfg.neighbors,
            leakage_window=leakage_window, rebuild=cfg.rebuild, device=auto_device("auto"))
    for split in EVAL_SPLITS:
        caches[split] = cache_dir(workdir, tag, cfg.knn.scores, split)
        build_knn_cache(split, features_dir(workdir, split), features_dir(workdir, "train"),
                        neighbors_dir(workdir, split, tag), caches[split], scores=cfg.knn.scores,
                        rebuild=cfg.rebuild)
    return {"tag": tag, "index": read_manifest(index_dir(workdir, tag)),
            "neighbors": neighbors, "caches": caches}


def cache_dir(workdir: Path, tag: str, scores: str, split: str) -> Path:
    return workdir / "knn_cache" / f"{tag}-{scores}" / split


def fit_interpolation(valid: dict, test: dict, knn: KNNStage) -> dict:
    """Fit (k, T, λ) on valid, score test: returns hparams, valid/test ppl and test log-probs.

    ``valid``/``test`` map ``lm_logprob`` (any model's log p(target)), ``sims`` and ``hits``.
    """
    ks, ts, ls = knn.grid()
    K = valid["sims"].shape[1]
    ks = sorted({min(k, K) for k in ks})
    best = fit(valid, ks, ts, ls)
    test_logprob = knn_lm_logprob(test, best["k"], best["temperature"], best["lambda"])
    return {"k": int(best["k"]), "temperature": float(best["temperature"]),
            "lambda": float(best["lambda"]), "valid_ppl": float(best["ppl"]),
            "test_logprob": test_logprob}


def load_cache(path: Path, lm_logprob: Optional[np.ndarray] = None) -> dict:
    """A kNN cache as arrays; ``lm_logprob`` swaps in another model's log p(target)."""
    manifest = read_manifest(path, kind="knn_cache")
    arrays = {name: open_array(path, name, manifest) for name in ("lm_logprob", "sims", "hits")}
    if lm_logprob is not None:
        arrays["lm_logprob"] = lm_logprob
    return arrays


def head_inputs(workdir: Path) -> dict:
    """Fingerprints of the artifacts heads read (so a rebuilt datastore retrains them)."""
    inputs = {f"features_{s}": read_manifest(features_dir(workdir, s))["fingerprint"]
              for s in SPLITS}
    for tag_dir in sorted((workdir / "neighbors").glob("*/train")):
        inputs[f"neighbors_{tag_dir.parent.name}"] = read_manifest(tag_dir)["fingerprint"]
    return inputs


def run(cfg: PipelineConfig) -> dict:
    """Run every stage; return the results dict also written to ``reports/<name>/``."""
    from gnnlm.report import write_report

    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, store, base_manifest = stage_base_lm(cfg, workdir)
    feature_manifests = stage_features(cfg, model, store, workdir)
    leakage_window = cfg.neighbors.leakage_window or model.context_length
    scores: dict[str, dict[str, np.ndarray]] = {
        "base": {s: np.asarray(open_array(features_dir(workdir, s), "lm_logprob"))
                 for s in EVAL_SPLITS}}
    hparams: dict[str, dict] = {}
    retrieval = {}
    for key in cfg.knn.keys:
        retrieval[key] = stage_retrieval(cfg, key, workdir, leakage_window)
        caches = {s: load_cache(retrieval[key]["caches"][s]) for s in EVAL_SPLITS}
        result = fit_interpolation(caches["valid"], caches["test"], cfg.knn)
        name = "knn" if key == cfg.knn.keys[0] else f"knn[{key}]"
        scores[name] = {"test": result.pop("test_logprob")}
        hparams[name] = {**result, "similarity": cfg.knn.metric, "key": key,
                         "scores": cfg.knn.scores}
    primary = retrieval[cfg.knn.keys[0]]
    heads = {}
    if cfg.gnn.config:
        build_pq(features_dir(workdir, "train"), workdir / "pq" / cfg.pq.key, cfg.pq,
                 rebuild=cfg.rebuild)
        heads["gnn"] = fit_with_cli("gnn", cfg.gnn.config, workdir, head_inputs(workdir))
    if cfg.spalm.config:
        heads["spalm"] = fit_with_cli("spalm", cfg.spalm.config, workdir, head_inputs(workdir))
    if cfg.spalm_finetune.config:  # SPALM with the base LM's last block trained too
        heads["spalm_ft"] = fit_with_cli("spalm_ft", cfg.spalm_finetune.config, workdir,
                                         head_inputs(workdir))
    for name, config in cfg.learned_wds.named().items():
        heads[name] = fit_with_cli(name.replace("[n=", "_n").rstrip("]"), config, workdir,
                                   head_inputs(workdir))
    for name in heads:
        head_dir = workdir / "heads" / heads[name]["config"]["name"]
        scores[name] = {s: head_logprobs(head_dir, s) for s in EVAL_SPLITS}
    if "gnn" in heads:  # GNN+kNN: the GNN's distribution interpolated with kNN-LM's (eq. 5)
        caches = {s: load_cache(primary["caches"][s], scores["gnn"][s]) for s in EVAL_SPLITS}
        result = fit_interpolation(caches["valid"], caches["test"], cfg.knn)
        scores["gnn+knn"] = {"test": result.pop("test_logprob")}
        hparams["gnn+knn"] = {**result, "similarity": cfg.knn.metric, "key": cfg.knn.keys[0]}
    for name in cfg.learned_wds.named():  # Xu et al. §4.1: interpolated with the base LM
        lam, valid_ppl = fit_lambda(scores["base"]["valid"], scores[name]["valid"],
                                    cfg.knn.grid()[2])
        scores[f"{name}+base"] = {"test": interpolate(scores["base"]["test"],
                                                      scores[name]["test"], lam)}
        hparams[f"{name}+base"] = {"lambda": lam, "valid_ppl": valid_ppl}
    ablations = stage_ablations(cfg, workdir, retrieval)
    return write_report(cfg, workdir, model, store, scores, hparams, retrieval, heads,
                        base_manifest, feature_manifests, ablations)


def fit_lambda(lm_valid: np.ndarray, other_valid: np.ndarray, lambdas: list[float]
               ) -> tuple[float, float]:
    """The λ of (1 − λ)·p_LM + λ·p_other minimising valid perplexity, and that perplexity."""
    lams = [lam for lam in lambdas if lam < 1] or [0.0]
    ppl = [float(np.exp(-np.mean(interpolate(lm_valid, other_valid, lam)))) for lam in lams]
    best = int(np.argmin(ppl))
    return float(lams[best]), ppl[best]


def stage_ablations(cfg: PipelineConfig, workdir: Path, retrieval: dict) -> Optional[dict]:
    """The Xu et al. table and, with ``ablations.memory_lm``, Transformer-XL memory on/off."""
    stage = cfg.ablations
    if not stage.enabled and not stage.memory_lm:
        return None
    out = workdir / "ablations"
    inputs = {key: read_manifest(r["caches"]["test"])["fingerprint"]
              for key, r in retrieval.items()}
    if stage.memory_lm:
        memory = fit_with_cli("base_lm_xl", stage.memory_lm, workdir, {}, predict=False)
        inputs["memory_lm"] = memory["fingerprint"]
    builder = ArtifactBuilder(out, kind="ablations",
                              config={**asdict(stage), "grid": cfg.knn.grid(),
                                      "metric": cfg.knn.metric, "keys": cfg.knn.keys},
                              inputs=inputs, rebuild=cfg.rebuild)
    if builder.is_complete():
        return read_manifest(out)["result"]
    with builder:
        result = {}
        if stage.enabled:
            tag = retrieval_tag(cfg.knn.keys[0], cfg.knn.metric)
            result = run_ablations(
                stage, workdir, cfg.knn.keys, cfg.knn.metric, cfg.knn.grid(),
                {key: r["caches"] for key, r in retrieval.items()},
                {s: neighbors_dir(workdir, s, tag) for s in EVAL_SPLITS}, builder.partial)
        if stage.memory_lm:
            result["memory"] = memory_rows(workdir / "heads" / "base_lm_xl", workdir)
        builder.finish(extra={"result": result})
    return result


def config_parser(prog: str = "gnnlm pipeline"):
    """The jsonargparse parser of a pipeline YAML (``-c``) and ``--section.field=value`` flags."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action=ActionConfigFile)
    parser.add_class_arguments(PipelineConfig)
    return parser


def to_config(parser, namespace) -> PipelineConfig:
    init = parser.instantiate_classes(namespace)
    return PipelineConfig(**{name: init[name] for name in PipelineConfig.__dataclass_fields__})


def load_config(args: list[str]) -> PipelineConfig:
    """Parse ``-c CONFIG [--section.field=value ...]`` into a PipelineConfig."""
    parser = config_parser()
    return to_config(parser, parser.parse_args(args))


def main(args: list[str]) -> None:
    from gnnlm.report import row_name

    cfg = load_config(args)
    results = run(cfg)
    print(f"\n{results['dataset']}: test {results['tokens']:,} tokens ({results['protocol']})")
    print(f"  {'model':<36} {'valid ppl':>10} {'test ppl':>10}")
    for name, ppl in results["ppl"].items():
        valid = results["valid_ppl"].get(name)
        print(f"  {row_name(name):<36} {'' if valid is None else f'{valid:.2f}':>10} {ppl:10.2f}")
    print(f"written to {Path(cfg.workdir) / 'reports' / results['name']}")
