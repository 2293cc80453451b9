"""Retrieval for new text, done the way the pipeline retrieved for its valid and test splits.

A trained work directory scores and generates text it has never seen: each new position's
feature queries the train keys. For its numbers to be the pipeline's, the query must be searched
exactly as the neighbours stage searched a split (``gnnlm.retrieval.neighbors``): the same index
or exact search, the same ``nprobe`` and re-ranking (as the test neighbours' manifest records
them), the same width K, and the query as the datastore stores it (float16). The similarities
that kNN-LM then reads are those of its kNN cache (``gnnlm.retrieval.knn_cache``): the search's
own (``scores="faiss"``) or recomputed exactly from the stored keys (``"exact"``).

Nothing large is loaded: the index is read once, the train keys and targets stay memory-mapped,
and re-ranking prepares only the candidate rows it reads (``gnnlm.retrieval.search.RerankKeys``,
the same bits as the pipeline's keys prepared in RAM).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gnnlm.retrieval.features import open_features
from gnnlm.retrieval.neighbors import neighbor_values
from gnnlm.retrieval.search import Searcher, rescore
from gnnlm.retrieval.settings import check_scores
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest


def stored(features: Any) -> np.ndarray:
    """Features as the datastore stores them: rounded to float16, then float32 [n, d]."""
    return np.asarray(features, dtype=np.float32).astype(np.float16).astype(np.float32)


class Lookup:
    """The K neighbours of new queries among the train ``key`` keys under ``metric``.

    Args:
        workdir: a work directory whose neighbours of ``key``/``metric`` are built.
        key: the feature type the queries are (``final`` or ``att``).
        metric: the similarity of the index (``cos``, ``ip``, ``l2``).
        device: where exact search runs (``auto``: a GPU when there is one).
    """

    def __init__(self, workdir: Workdir, key: str, metric: str, device: str = "cpu"):
        self.workdir, self.key, self.metric = workdir, key, metric
        # how the test split's queries were searched: the protocol every new query follows
        self.manifest = read_manifest(workdir.neighbors(key, metric, "test"), kind="neighbors")
        config = self.manifest["config"]
        self.K = int(self.manifest["K"])
        self.batch_size, self.chunk = int(config["batch_size"]), int(config["chunk"])
        if self.manifest["backend"] == "exact":
            self.searcher = Searcher.exact(workdir, key, metric, device=device)
        else:
            search = config.get("search") or {}
            self.searcher = Searcher.for_workdir(
                workdir, key, metric, device=device, nprobe=search.get("nprobe"),
                rerank=search.get("rerank"), keys_in_ram=False)
        train = open_features(workdir.features("train"))[1]
        self.train_keys, self.train_targets = train[key], train["targets"]

    def search(self, queries: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(sims float32 [n, K], ids int64 [n, K])`` of ``queries`` [n, d] (rounded to float16
        here, as stored), as the neighbours file would hold them: in the neighbours stage's
        batches (chunks of ``chunk`` positions, each searched ``batch_size`` queries at a time),
        so even a search whose floating-point sums depend on how many queries go together
        gives the pipeline's bits."""
        queries = stored(queries)
        n = len(queries)
        sims = np.empty((n, self.K), dtype=np.float32)
        ids = np.empty((n, self.K), dtype=np.int64)
        for chunk_start in range(0, n, self.chunk):
            chunk_end = min(chunk_start + self.chunk, n)
            for start in range(chunk_start, chunk_end, self.batch_size):
                end = min(start + self.batch_size, chunk_end)
                sims[start:end], ids[start:end] = self.searcher.search(queries[start:end], self.K)
        return sims, ids

    def knn_sims(self, queries: Any, sims: np.ndarray, ids: np.ndarray, scores: str
                 ) -> np.ndarray:
        """The similarities a kNN cache of ``scores`` holds for these neighbours: the search's
        (``faiss``), or recomputed exactly from the stored keys (``exact``)."""
        check_scores(scores)
        if scores == "faiss":
            return sims
        return rescore(stored(queries), ids, self.train_keys, self.metric)

    def values(self, ids: np.ndarray) -> np.ndarray:
        """The values of neighbour ids (the train token after each), int64, -1 where there is
        none."""
        return neighbor_values(ids, self.train_targets).astype(np.int64)

    def describe(self) -> dict:
        """How the queries are searched: backend, index, nprobe, re-ranking, K."""
        return {"key": self.key, "metric": self.metric, "backend": self.manifest["backend"],
                "factory": self.manifest.get("factory"), "nprobe": self.manifest.get("nprobe"),
                "rerank": self.manifest.get("rerank"), "K": self.K}
