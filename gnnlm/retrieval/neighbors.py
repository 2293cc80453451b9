"""Neighbours for every position of a split: the retrieval that GNN-LM and kNN-LM build on.

For split s, ``workdir.neighbors(key, metric, s)`` holds, per position t:

- ``ids`` int32 [N, K]: train positions of the K nearest train keys, best first, -1 = none;
- ``sims`` float32 [N, K]: their similarities as the search returned them (the "FAISS scores"
  of Xu et al. §5.1; higher is better, l2 = negative squared distance), -inf where ids is -1.

Queries are the split's features of the index's key type. The datastore holds train positions
only, so train queries would find their own future. A feature at train position p was computed
from the W tokens before its target (W: the features' context length) and predicts target p, so
it has read, or is, the target of every position t with p − W ≤ t ≤ p. For ``split == "train"``
every neighbour p with t ≤ p ≤ t + W is therefore dropped: it has read the query's target
(GNN-LM §3.1, "Data Leakage Prevention"). At most W + 1 keys lie in that window, so train queries
search ``K + W + 1`` candidates and keep the first K unmasked ones: the result never holds a
masked position and never has fewer than K neighbours for lack of width. The manifest records
``masked_fraction`` (dropped / retrieved candidates) and ``masked_fraction_top_k`` (the share of
the unmasked search's top K that leakage removed). Valid/test queries are not masked.

``backend="exact"`` searches exactly in torch over the stored train keys (Xu et al.'s "real
mask"; ``gnnlm.retrieval.exact``: on CUDA a float16 screening, certified, then float32 scores; the
manifest's ``screen`` counts the queries screened in each precision, those widened, those
screened again in float32 and those scored against every key); ``"index"`` uses the FAISS index
("FAISS mask").
The build goes in fixed chunks of positions with progress after each, so a killed build resumes
and ends with the same bytes.
``devices`` > 1 shares the chunks among processes (``gnnlm.workdir.shards``): one per GPU on CUDA,
each with its own copy of the index on its GPU when faiss has GPU support; the same bytes again,
and a killed build resumes with any number of processes. ``shard_index`` instead spreads one index
over every GPU of one process (``gnnlm.retrieval.multi_gpu``).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from gnnlm.retrieval.features import check_key, open_features
from gnnlm.retrieval.multi_gpu import require_faiss_gpu, shard_over_gpus
from gnnlm.retrieval.search import Searcher
from gnnlm.retrieval.settings import NeighborsConfig  # the settings, importable from here too
from gnnlm.utils.devices import faiss_has_gpu
from gnnlm.utils.progress import say
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.fingerprints import canonical_json
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import is_complete, open_array, read_manifest
from gnnlm.workdir.ranks import Rank, run_on_ranks
from gnnlm.workdir.refusals import ArtifactError, check_inputs
from gnnlm.workdir.shards import ShardedJob, totals

# what the leakage mask counts: candidates searched and dropped, in all and in the top K
COUNTS = ("retrieved", "dropped", "retrieved_top_k", "dropped_top_k")


def mask_leakage(sims: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, window: int,
                 K: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Drop candidates p with t ≤ p ≤ t + window (they have read the target t) and keep the
    first K others, order preserved, on the tensors' device (the search's: on a GPU the
    candidates never go to the host, where numpy took 62-65 ms per 2,048 train queries at the
    table's width, 1,537).

    ``sims``/``ids`` [n, width] best first, ``positions`` [n] the query positions t.
    Returns ``(sims [n, K], ids [n, K], counts)``; missing slots are -1 / -inf.
    """
    valid = ids >= 0                                                   # [n, width]
    ahead = ids - positions[:, None]                                   # [n, width]
    masked = valid & (ahead >= 0) & (ahead <= window)
    keep = valid & ~masked
    # a kept candidate's slot is the number kept before it; the rest (and slots beyond K) go
    # to a spare column K, which is cut off
    slot = torch.where(keep, keep.cumsum(dim=1) - 1, K).clamp_(max=K)  # [n, width]
    out_ids = ids.new_full((len(ids), K + 1), -1).scatter_(1, slot, ids)[:, :K]
    out_sims = sims.new_full((len(sims), K + 1), -math.inf).scatter_(1, slot, sims)[:, :K]
    counts = torch.stack([valid.sum(), masked.sum(), valid[:, :K].sum(),
                          masked[:, :K].sum()]).tolist()
    return out_sims, out_ids, dict(zip(COUNTS, counts))


def build_neighbors(workdir: Workdir, split: str, key: str, metric: str,
                    config: NeighborsConfig | None = None, leakage_window: int | None = None,
                    rebuild: bool = False, stop_after_chunks: int | None = None,
                    device: str = "auto", strategy: str = "ddp_spawn") -> dict:
    """Neighbours of every position of ``split`` among the train ``key`` keys under ``metric``
    (skips a complete build; resumes a partial one).

    ``config.backend`` picks the FAISS index ``workdir.index(key, metric)`` or exact search over
    the train keys themselves (no index is read). ``config.devices`` > 1 searches on that many
    processes (``gnnlm.workdir.ranks``), each writing its query chunks: the same bytes as one
    process, and the manifest's counts and search seconds summed over them.
    ``stop_after_chunks`` stops each rank after that many chunks without completing (used to
    test resumption).
    """
    config = config or NeighborsConfig()
    query_manifest, query_arrays = open_features(workdir.features(split))
    train_manifest, _ = open_features(workdir.features("train"))
    check_key(query_manifest, key)
    check_key(train_manifest, key)
    inputs = {"features": query_manifest["fingerprint"],
              "train_features": train_manifest["fingerprint"]}
    if config.backend == "index":
        index_path = workdir.index(key, metric)
        index_manifest = read_manifest(index_path, kind="index")
        made, holds = index_manifest["base_lm"], f"the index at {index_path}"
        check_inputs(index_manifest, index_path, {"features": train_manifest["fingerprint"]},
                     "Neighbour ids would point at other positions: rebuild the index over "
                     "these train features (--rebuild).")
        ntotal = int(index_manifest["n"])
        inputs["index"] = index_manifest["fingerprint"]
        index_facts = {"factory": index_manifest["factory"],
                       "recall": index_manifest.get("recall")}
        search = {"nprobe": int(index_manifest.get("nprobe", 1) if config.nprobe == "auto"
                                else config.nprobe),
                  "rerank": float(index_manifest.get("rerank", 0.0) if config.rerank == "auto"
                                  else config.rerank)}
    else:  # exact search reads the train keys themselves: no index
        made, holds = train_manifest["base_lm"], f"the train keys at {workdir.features('train')}"
        ntotal = int(train_manifest["arrays"][key]["shape"][0])
        index_facts, search = {"factory": "exact", "recall": None}, {}
    asked = query_manifest["base_lm"]
    if made["fingerprint"] != asked["fingerprint"]:
        raise ArtifactError(
            f"The {split} features at {workdir.features(split)} come from base LM "
            f"{asked['name']} (weights {asked['fingerprint']}), but {holds} are keys of base LM "
            f"{made['name']} (weights {made['fingerprint']}): their vectors live in different "
            f"spaces. Encode {split} with the model that made the datastore, or rebuild it.")
    masked = split == "train"
    given = config.leakage_window if config.leakage_window is not None else leakage_window
    if masked and given is None:
        raise ValueError("Train queries need a leakage window W (neighbors.leakage_window, "
                         "default: the base LM's context length) (got None).")
    window = int(given) if masked and given is not None else 0
    n = int(query_arrays[key].shape[0])
    if split == "train" and config.train_queries is not None:
        n = min(n, config.train_queries)  # heads train on this prefix; the datastore stays whole
    if config.K > ntotal:
        raise ValueError(f"neighbors.K must not exceed the datastore size {ntotal} "
                         f"(got {config.K}): lower K or build a larger datastore.")
    width = min(config.K + window + 1, ntotal) if masked and window > 0 else config.K
    job = NeighborsJob(
        out_dir=workdir.neighbors(key, metric, split), workdir=workdir, split=split, key=key,
        metric=metric, config=config, masked=masked, window=window, n=n, width=width,
        inputs=inputs, index_facts=index_facts, search=search,
        base_lm=asked, device=device, rebuild=rebuild, stop_after=stop_after_chunks)
    reused = _made_with_the_index_listed(job)
    if reused is not None:
        return reused
    if job.builder().is_complete():
        return read_manifest(job.out_dir)
    if config.shard_index:
        require_faiss_gpu("A sharded multi-GPU index (neighbors.shard_index)")
    return run_on_ranks(job, config.devices, device, strategy)


def _made_with_the_index_listed(job: NeighborsJob) -> dict | None:
    """Exact neighbours built when the exact backend still listed the index among its inputs
    (it never read it): the same neighbours for the same settings, reused as they are rather
    than refused, so their kNN caches and heads stay too. None for anything else."""
    if job.config.backend != "exact" or job.rebuild or not is_complete(job.out_dir):
        return None
    found = read_manifest(job.out_dir, kind="neighbors")
    builder = job.builder()
    recorded = dict(found.get("inputs") or {})
    if (recorded.pop("index", None) is None or recorded != builder.inputs
            or canonical_json(found.get("config")) != canonical_json(builder.config)):
        return None
    builder.check_files(found)
    say(f"[gnnlm] neighbors {job.out_dir}: skipped (complete; made when exact search listed "
        f"the index among its inputs)")
    return found


SCREEN_COUNTS = ("widened", "rescreened", "exhaustive")


@dataclass
class NeighborsJob(ShardedJob):
    """The neighbours of one split on one rank: chunk c holds query positions
    ``[c * chunk, (c + 1) * chunk)``, searched in the same batches by any rank."""
    out_dir: Path
    workdir: Workdir
    split: str
    key: str
    metric: str
    config: NeighborsConfig
    masked: bool
    window: int
    n: int
    width: int
    inputs: dict
    index_facts: dict
    search: dict
    base_lm: dict
    device: str
    rebuild: bool
    stop_after: int | None

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.config.chunk)

    @property
    def desc(self) -> str:
        return f"neighbours {self.split}"

    def builder(self) -> ArtifactBuilder:
        return ArtifactBuilder(
            self.out_dir, kind="neighbors",
            config={**self.config.fingerprint_config(), "search": self.search,
                    "leakage_window": self.window if self.masked else None, "split": self.split},
            inputs=self.inputs, rebuild=self.rebuild)

    def setup(self, builder: ArtifactBuilder) -> None:
        builder.array("ids", np.int32, (self.n, self.config.K))
        builder.array("sims", np.float32, (self.n, self.config.K))

    def searcher(self, rank: Rank) -> Searcher:
        """The search of one rank: the caller's device in-process; otherwise the rank's own
        GPU (faiss-gpu, or exact search in torch), or the CPU."""
        if rank.world == 1:
            device = self.device
        elif rank.device.type == "cuda":
            device = f"cuda:{rank.device.index or 0}"
        else:
            device = "cpu"
            faiss.omp_set_num_threads(torch.get_num_threads())  # the cores shared among ranks
        if self.config.backend == "exact":
            return Searcher.exact(self.workdir, self.key, self.metric, device=device,
                                  screen=self.config.screen)
        if self.config.shard_index:
            return shard_over_gpus(Searcher.for_workdir(self.workdir, self.key, self.metric,
                                                        device="cpu", **self.search), self.width)
        if device.startswith("cuda") and not faiss_has_gpu():
            device = "cpu"
            if rank.rank == 0:
                say("[gnnlm] neighbours: this faiss has no GPU support: the index is searched "
                    "on the CPU (neighbors.backend: exact searches on the GPUs)")
        return Searcher.for_workdir(self.workdir, self.key, self.metric, device=device,
                                    **self.search)

    def work(self, rank: Rank, chunks: Iterator[tuple[int, dict]],
             arrays: dict[str, np.ndarray]) -> None:
        searcher = self.searcher(rank)
        queries = open_features(self.workdir.features(self.split))[1][self.key]  # [N, d] fp16
        K, size, batch = self.config.K, self.config.chunk, self.config.batch_size
        exact = searcher.exact_search
        for chunk, stats in chunks:
            before = dict(exact.stats) if exact is not None else {}
            stop = min((chunk + 1) * size, self.n)
            for start in range(chunk * size, stop, batch):
                end = min(start + batch, stop)
                sims, ids = searcher.search_tensors(
                    np.asarray(queries[start:end], dtype=np.float32), self.width)  # [b, width]
                if self.masked and self.window > 0:
                    positions = torch.arange(start, end, device=ids.device)
                    sims, ids, c = mask_leakage(sims, ids, positions, self.window, K)
                    for name in COUNTS:
                        stats[name] = stats.get(name, 0) + c[name]
                else:
                    sims, ids = sims[:, :K], ids[:, :K]
                arrays["ids"][start:end] = ids.cpu().numpy()
                arrays["sims"][start:end] = sims.cpu().numpy()
            if exact is not None:  # queries screened in each precision; widened; again;
                # against every key
                for name in SCREEN_COUNTS:
                    stats[f"screen_{name}"] = exact.stats[name] - before[name]
                stats[f"screen_{exact.screen}"] = exact.stats["queries"] - before["queries"]

    def extra(self, rank: Rank, done: dict[int, dict], wall_seconds: float) -> dict:
        summed = totals(done)
        seconds = float(summed.get("seconds", 0.0))
        stats: dict[str, Any] = {}
        if self.masked:
            counts = {name: int(summed.get(name, 0)) for name in COUNTS}
            stats = {**counts,
                     "masked_fraction": counts["dropped"] / max(counts["retrieved"], 1),
                     "masked_fraction_top_k": (counts["dropped_top_k"]
                                               / max(counts["retrieved_top_k"], 1))}
        index_backend = self.config.backend == "index"
        if not index_backend:  # how the exact search went: queries screened in each
            # precision, and those it widened, screened again or scored against every key
            stats["screen"] = {name: int(summed.get(f"screen_{name}", 0))
                               for name in ("float16", "float32", *SCREEN_COUNTS)}
        return {
            "split": self.split, "n": self.n, "K": self.config.K, "key": self.key,
            "metric": self.metric, "backend": self.config.backend,
            "factory": self.index_facts["factory"] if index_backend else "exact",
            "nprobe": self.search.get("nprobe"), "rerank": self.search.get("rerank"),
            "leakage_window": self.window if self.masked else None, "search_k": self.width,
            "masked": self.masked, **stats,
            "base_lm": self.base_lm, "index_recall": self.index_facts["recall"],
            "search_seconds": round(seconds, 3),
            "queries_per_s": round(self.n / seconds, 1) if seconds > 0 else None,
            "devices": rank.world, "wall_seconds": wall_seconds}


def neighbor_values(ids: np.ndarray, train_targets: np.ndarray) -> np.ndarray:
    """The values (the train tokens that followed) of neighbour ids [..., K]; -1 where id is -1."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.where(ids >= 0, np.asarray(train_targets)[np.maximum(ids, 0)], -1)


def neighbor_hits(ids: np.ndarray, train_targets: np.ndarray | torch.Tensor,
                  targets: np.ndarray) -> np.ndarray:
    """Bool [n, K]: does neighbour i's value equal the query's target (False where id is -1).
    Train targets held as a tensor are gathered by torch on its device, every core or the GPU:
    numpy gathers on one core, which for a WikiText-2 split at K = 1,024 (222M random reads)
    takes seconds."""
    if isinstance(train_targets, torch.Tensor):
        # a memmap's rows are read-only, which torch will not wrap: those are copied
        ids_t = torch.from_numpy(np.require(ids, requirements=("C", "W"))).to(
            train_targets.device, torch.int64)
        values = torch.where(ids_t >= 0, train_targets[ids_t.clamp(min=0)], -1)
    else:
        values = torch.from_numpy(neighbor_values(ids, train_targets))
    targets_t = torch.from_numpy(np.asarray(targets, dtype=np.int64)).to(values.device)
    return ((values == targets_t[:, None]) & (values >= 0)).cpu().numpy()


def open_neighbors(path: str | Path) -> tuple[dict, dict]:
    """``(manifest, {"ids": memmap [N, K], "sims": memmap [N, K]})`` of a neighbours folder
    (``workdir.neighbors(key, metric, split)``)."""
    manifest = read_manifest(path, kind="neighbors")
    return manifest, {name: open_array(path, name, manifest) for name in ("ids", "sims")}
