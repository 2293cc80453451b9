"""The per-token kNN-LM cache that every (k, T, λ) of ``gnnlm.retrieval.knn`` reads.

``workdir.knn_cache(key, metric, scores, split)`` holds, per position of a valid/test split:
``lm_logprob`` [N] (the base LM's log p(target)), ``sims`` float32 [N, K] and ``hits`` bool
[N, K] (neighbour i's value is the target). Every (k, T, λ) is then a cheap vectorised pass.

``scores="faiss"`` keeps the search's scores; ``scores="exact"`` recomputes them from the stored
float keys in float32, in the same neighbour order ("FAISS mask, real score" of Xu et al. §5.1
when the neighbours came from the index; "real mask, real score" when they came from the exact
backend).

What the neighbours and scores of a cache are is not what ``scores`` says alone: an index searched
with re-ranking (``rerank`` > 0) returns exact similarities already, and so do exact search and an
index that stores the keys uncompressed. The manifest therefore records the neighbours' search
(``backend``, ``factory``, ``nprobe``, ``rerank``) and ``scores_are_exact``; ``search_facts``
tells them for any cache, also one built before the manifest recorded them.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import torch

from gnnlm.retrieval.features import open_features
from gnnlm.retrieval.knn import CACHE_ARRAYS
from gnnlm.retrieval.neighbors import neighbor_hits, open_neighbors
from gnnlm.retrieval.search import exhaustive_index, rescore  # noqa: F401  (importable from here)
from gnnlm.retrieval.settings import SCORES, check_scores  # noqa: F401  (importable from here)
from gnnlm.utils.devices import torch_device
from gnnlm.utils.metrics import check_finite, perplexity
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.refusals import ArtifactError, changed_hint, check_inputs

# What a cache manifest records of its neighbours' search (``search_facts``).
SEARCH_FACTS = ("backend", "factory", "nprobe", "rerank", "scores_are_exact")
# factories whose index holds the keys uncompressed: the distances it returns are exact, whatever
# lists or graph nodes it visits.
_UNCOMPRESSED = re.compile(r"(IDMap2?,)?((IVF\d+(_HNSW\d+)?|HNSW\d+),)?Flat|HNSW\d+")


def exact_score_index(factory: str | None) -> bool:
    """True when an index of this faiss factory returns exact similarities (``Flat``,
    ``IVF<n>,Flat``, ``HNSW<m>``: the keys are stored uncompressed): its scores are Xu et al.'s
    "real score" (§5.1) already."""
    return factory is not None and _UNCOMPRESSED.fullmatch(factory) is not None


def neighbors_facts(nb_manifest: dict, scores: str) -> dict:
    """What a cache of these neighbours with ``scores`` scores holds (Xu et al. §5.1): the
    neighbours' ``backend``, ``factory``, ``nprobe`` and ``rerank`` as their manifest records
    them, and ``scores_are_exact``: recomputed (``scores="exact"``), re-ranked exactly by the
    search (``rerank`` > 0), searched exactly, or returned by an index with uncompressed keys."""
    check_scores(scores)
    facts = {name: nb_manifest.get(name) for name in SEARCH_FACTS[:-1]}
    facts["scores_are_exact"] = bool(
        scores == "exact" or facts["backend"] == "exact" or float(facts["rerank"] or 0) > 0
        or exact_score_index(facts["factory"]))
    return facts


def search_facts(manifest: dict, workdir: Workdir) -> dict:
    """``SEARCH_FACTS`` of the kNN cache with this manifest (``backend``, ``factory``, ``nprobe``,
    ``rerank``, ``scores_are_exact``).

    A cache built before its manifest recorded them takes them from its neighbours' manifest,
    which must be the one it was built from: existing work directories need no rebuild.
    """
    if "scores_are_exact" in manifest:
        return {name: manifest.get(name) for name in SEARCH_FACTS}
    key, metric, scores, split = (manifest[name] for name in ("key", "metric", "scores", "split"))
    nb_path = workdir.neighbors(key, metric, split)
    nb_manifest = read_manifest(nb_path, kind="neighbors")
    check_inputs(manifest, workdir.knn_cache(key, metric, scores, split),
                 {"neighbors": nb_manifest["fingerprint"]},
                 "Rebuild the kNN caches (--rebuild knn_cache).")
    return neighbors_facts(nb_manifest, scores)


def build_knn_cache(workdir: Workdir, split: str, key: str, metric: str, scores: str = "faiss",
                    rebuild: bool = False, chunk: int = 16384,
                    stop_after_chunks: int | None = None) -> dict:
    """The cache of ``split`` from its neighbours among the train ``key`` keys under ``metric``.

    ``hits[t, i]`` = (train targets[ids[t, i]] == targets[t]), False where ids is -1.
    """
    check_scores(scores)
    nb_path = workdir.neighbors(key, metric, split)
    nb_manifest, nb = open_neighbors(nb_path)
    query_manifest, query = open_features(workdir.features(split))
    train_manifest, train = open_features(workdir.features("train"))
    check_inputs(nb_manifest, nb_path, {"features": query_manifest["fingerprint"],
                                        "train_features": train_manifest["fingerprint"]},
                 "Rebuild the neighbours (--rebuild neighbors).")
    if "lm_logprob" not in query:
        raise ArtifactError(f"The features at {workdir.features(split)} have no lm_logprob (the "
                            f"base LM's log p(target)); build them with with_logprob.")
    K, n = nb_manifest["K"], nb_manifest["n"]
    out_dir = workdir.knn_cache(key, metric, scores, split)
    builder = ArtifactBuilder(
        out_dir, kind="knn_cache", config={"split": split, "scores": scores, "chunk": chunk},
        inputs={"neighbors": nb_manifest["fingerprint"], "features": query_manifest["fingerprint"],
                "train_features": train_manifest["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    # The train targets are read at random positions: hold them where the hits are gathered,
    # the GPU when there is one (8 bytes per token)
    train_targets = torch.from_numpy(np.asarray(train["targets"], dtype=np.int64)).to(
        torch_device("auto"))                                          # [N_train]
    n_chunks = -(-n // chunk)
    t0 = time.perf_counter()
    with builder:
        lm_out = builder.array("lm_logprob", np.float32, (n,))
        sims_out = builder.array("sims", np.float32, (n, K))
        hits_out = builder.array("hits", np.bool_, (n, K))
        state = builder.progress
        for c in builder.chunks(n_chunks, f"kNN cache {split}", stop_after_chunks):
            rows = slice(c * chunk, min((c + 1) * chunk, n))
            ids = np.asarray(nb["ids"][rows])                         # [b, K]
            hits = neighbor_hits(ids, train_targets, query["targets"][rows])
            hits_out[rows] = hits
            if scores == "faiss":
                sims_out[rows] = nb["sims"][rows]
            else:
                sims_out[rows] = rescore(query[key][rows], ids, train[key], metric)
            lm = np.asarray(query["lm_logprob"][rows], dtype=np.float32)
            check_finite(lm, str(workdir.features(split) / "lm_logprob.bin"),
                         changed_hint(workdir.features(split), "features"), start=rows.start)
            lm_out[rows] = lm
            state["lm_sum"] = state.get("lm_sum", 0.0) + float(np.sum(lm, dtype=np.float64))
            state["covered"] = state.get("covered", 0) + int(hits.any(axis=1).sum())
        if builder.interrupted:
            return {}
        return builder.finish(extra={
            "split": split, "n": n, "K": K, "key": key, "metric": metric, "scores": scores,
            # what the neighbours and scores are: "faiss" scores may be exact (re-ranked)
            **neighbors_facts(nb_manifest, scores),
            "base_lm": query_manifest["base_lm"],
            "base_ppl": perplexity(-state.get("lm_sum", 0.0), n),
            # the share of tokens whose target is among the values of their K neighbours
            "hit_coverage": state.get("covered", 0) / max(n, 1),
            "seconds": round(time.perf_counter() - t0, 3)})


def open_knn_cache(path, lm_logprob: np.ndarray | None = None) -> tuple[dict, dict]:
    """``(manifest, {"lm_logprob", "sims", "hits"})`` of a kNN cache folder (memmaps);
    ``lm_logprob`` swaps in another model's log p(target) (GNN+kNN)."""
    manifest = read_manifest(path, kind="knn_cache")
    arrays: dict[str, np.ndarray] = {name: open_array(path, name, manifest)
                                     for name in CACHE_ARRAYS}
    check_finite(arrays["lm_logprob"], str(Path(path) / manifest["arrays"]["lm_logprob"]["file"]),
                 changed_hint(path, "knn_cache"))
    if lm_logprob is not None:
        if len(lm_logprob) != manifest["n"]:
            raise ValueError(f"lm_logprob has {len(lm_logprob)} tokens but the cache at {path} "
                             f"has {manifest['n']}.")
        arrays["lm_logprob"] = lm_logprob
    return manifest, arrays
