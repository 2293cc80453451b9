"""The retrieval stages' settings and the checks of their values, without faiss or torch: what a
pipeline config names of the index, the neighbours and the kNN-LM grid (Khandelwal et al. 2020;
Xu et al. 2023), checked when the config loads. The stages themselves are ``gnnlm.retrieval.index``,
``neighbors``, ``knn`` and ``knn_cache``, which import these from here."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional, Union

from gnnlm.utils.devices import check_device, check_devices

# -- similarity and scores --------------------------------------------------------------------
METRICS = ("cos", "ip", "l2")
SCORES = ("faiss", "exact")


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS} (got {metric!r}).")


def check_scores(scores: str) -> None:
    if scores not in SCORES:
        raise ValueError(f"scores must be 'faiss' (the search's scores) or 'exact' "
                         f"(recomputed from the stored keys) (got {scores!r}).")


# -- the kNN-LM grid --------------------------------------------------------------------------
DEFAULT_KS = [8, 16, 32, 64, 128, 256, 512, 1024]
DEFAULT_LAMBDAS = [round(0.05 * i, 2) for i in range(20)]


def check_lambda(lam: Any) -> None:
    import numpy as np  # λ may be an array of any shape (``knn.interpolate``)

    values = np.asarray(lam, dtype=np.float64)
    if values.size and (not np.all(np.isfinite(values)) or values.min() < 0 or values.max() > 1):
        raise ValueError(f"λ (knn.lambda_) must lie in [0, 1] (got {lam}).")


def check_temperature(temperature: Any) -> None:
    import numpy as np

    values = np.asarray(temperature, dtype=np.float64)
    if values.size and (not np.all(np.isfinite(values)) or values.min() <= 0):
        raise ValueError(f"The temperature T (knn.temperature) must be a finite number > 0 "
                         f"(got {temperature}).")


def default_temperatures(metric: str) -> list[float]:
    """A T grid that brackets the optimum for the similarity's scale.

    Cosine similarities lie in [-1, 1] and neighbours differ by hundredths, so the optimum is
    near T = 0.01 (measured on WikiText-2); inner products and squared distances of
    transformer features are hundreds of times larger, and so is their T.
    """
    if metric == "cos":
        return [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
    return [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]


def grid_or_point(values: Sequence, pinned: Optional[Any]) -> list:
    """A grid axis, or the one value a W&B agent pins."""
    return [pinned] if pinned is not None else list(values)


# -- the index --------------------------------------------------------------------------------
# faiss warns (and clusters badly) with fewer training points than this per centroid.
MIN_POINTS_PER_CENTROID = 39
# the dimension a factory is parsed for when the keys' is not known yet: a multiple of the
# usual PQ sub-quantizer counts, so that a string valid for some real dimension parses
FACTORY_CHECK_DIM = 3840


@dataclass
class IndexConfig:
    """How the index over train keys is built (``factory="auto"``: see
    ``gnnlm.retrieval.index.auto_factory``). After the build, every search setting (``nprobe`` x
    ``rerank``, see ``gnnlm.retrieval.tuning``) is measured on ``recall_queries`` held-out queries
    (the valid features, which must exist) against exact search; the manifest records the table
    and the fastest setting reaching ``target_recall`` that GPU faiss can run, which the
    neighbours stage uses unless told otherwise. The key type and the similarity are the
    pipeline's (``knn.keys``, ``knn.metric``).

    Args:
        factory: ``auto`` (Flat, IVF-SQ8 or IVF-PQ by the datastore's size) or a faiss
            index_factory string such as ``IVF1024,PQ32``.
        target_recall: the recall@10 against exact search that the chosen search settings
            must reach, in (0, 1].
        code_budget_gb: ``auto`` stores codes of one byte per dimension (SQ8) up to this size,
            PQ codes above it.
        train_sample: keys the index is trained on (a seeded sample).
        seed: the seed of the training sample and of the held-out queries.
        add_chunk: keys added per step; the partial index is saved after each, so a killed
            build resumes.
        exact_below: ``auto`` builds an exact ``Flat`` index below this many keys.
        device: where faiss trains and adds (``auto``: the GPU when faiss has one); the index
            written is a CPU index either way.
        clustering: what runs an IVF index's k-means and assigns keys to its lists: ``faiss``
            (on ``device``), ``torch`` (k-means in torch on torch's device, faiss the rest:
            ``gnnlm.retrieval.torch_ivf``), ``auto`` (torch when torch sees a GPU and faiss
            does not). Not part of the fingerprint, as the device is not.
        recall_queries: held-out queries the search settings are measured on (0 skips the
            measurement).
    """
    factory: str = "auto"
    target_recall: float = 0.9
    code_budget_gb: float = 8.0
    train_sample: int = 131072
    seed: int = 0
    add_chunk: int = 131072
    exact_below: int = 300_000
    device: Literal["auto", "cpu", "cuda"] = "auto"
    recall_queries: int = 1000
    clustering: Literal["auto", "faiss", "torch"] = "auto"

    def __post_init__(self):
        if not isinstance(self.factory, str) or not self.factory:
            raise ValueError(f"index.factory must be 'auto' or a faiss index_factory string "
                             f"such as 'IVF1024,PQ32' (got {self.factory!r}).")
        for name in ("train_sample", "add_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"index.{name} must be >= 1 (got {getattr(self, name)}).")
        if not 0 < self.target_recall <= 1:
            raise ValueError(f"index.target_recall must lie in (0, 1] "
                             f"(got {self.target_recall}).")
        for name in ("exact_below", "recall_queries"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"index.{name} must be >= 0 (got {getattr(self, name)}).")
        check_device(self.device)
        if self.clustering not in ("auto", "faiss", "torch"):
            raise ValueError(f"index.clustering must be 'auto', 'faiss' or 'torch' "
                             f"(got {self.clustering!r}).")
        self.check_factory()

    def check_factory(self, d: int | None = None, metric: str | None = None) -> None:
        """Refuse a ``factory`` that faiss cannot build, before any work: parsed by faiss for
        ``d``-dimensional keys under ``metric`` (the pipeline passes them when it can know them
        at load). Without ``d`` only what holds for every dimension is checked (a stand-in
        dimension that faiss refuses says nothing about the real one). An IVF index needs at
        least one list and a training sample no smaller than its lists (faiss trains k-means on
        ``train_sample`` keys)."""
        if self.factory == "auto":
            return
        import faiss  # only a factory string needs faiss to parse it

        what = f"index.factory = {self.factory!r}"
        advice = ("write a faiss index_factory string such as 'IVF1024,SQ8' or 'IVF1024,PQ32', "
                  "or 'auto' to let the pipeline choose")
        if metric:
            check_metric(metric)
        faiss_metric = faiss.METRIC_INNER_PRODUCT if metric in ("cos", "ip") else faiss.METRIC_L2
        try:
            index = faiss.index_factory(d or FACTORY_CHECK_DIM, self.factory, faiss_metric)
        except RuntimeError as err:
            # faiss's message is its last line, after "Error in <function> at <file:line>: "
            reason = re.sub(r"^Error in .*? at \S+:\d+: (Error: '.*?' failed: (?=.))?", "",
                            str(err).strip().splitlines()[-1]).rstrip(".")
            if "could not parse" in reason:
                raise ValueError(f"{what} is not an index faiss can parse ({reason}): "
                                 f"{advice}.") from None
            if d is None:
                return
            raise ValueError(f"{what} cannot index the base LM's {d}-dimensional keys under "
                             f"knn.metric = {metric!r} ({reason}): {advice}.") from None
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None and ivf.nlist < 1:
            raise ValueError(f"{what} has {ivf.nlist} inverted lists: give IVF<nlist> with "
                             f"nlist >= 1 (e.g. IVF1024), or 'auto'.")
        if ivf is not None and ivf.nlist > self.train_sample:
            raise ValueError(f"{what} has {ivf.nlist} inverted lists but index.train_sample = "
                             f"{self.train_sample} keys train them: lower nlist or raise "
                             f"train_sample (faiss wants >= {MIN_POINTS_PER_CENTROID} keys "
                             f"per list).")

    def fingerprint_config(self) -> dict:
        # The device does not define the artifact (an index built on GPU is used on CPU); the
        # search settings and their measurement are recorded in the manifest, not the bytes.
        cfg = asdict(self)
        for name in ("device", "recall_queries", "target_recall", "clustering"):
            cfg.pop(name)
        return cfg


# -- the neighbours ---------------------------------------------------------------------------
@dataclass
class NeighborsConfig:
    """Retrieval for every position: the top-K train neighbours of each split's queries, those
    of train queries with the leakage window masked (Meng et al. 2022, §3.1). ``devices`` and
    ``shard_index`` do not change the artifact, so neither is part of its fingerprint.

    Args:
        K: neighbours stored per position (the most any k of the kNN-LM grid or a head reads).
        leakage_window: W for train queries, how many tokens back a feature has read (unset:
            the features' context length, as the pipeline sets it); 0 disables masking (an
            ablation only).
        train_queries: retrieve for the first N train positions only (the prefix the heads
            train on; the datastore itself stays whole; unset: every one); valid and test
            always get every position.
        batch_size: queries searched at once.
        backend: ``index`` searches the FAISS index ("FAISS mask" of Xu et al. 2023),
            ``exact`` searches the stored keys exactly in torch ("real mask").
        chunk: positions per resumable build step.
        devices: processes that search the query chunks (one per GPU on CUDA; ``auto``: every
            GPU), with the same bytes as one process.
        shard_index: spread the faiss index over every GPU of one process (an index too large
            for one GPU; needs faiss-gpu).
        nprobe: the IVF lists probed per query (``auto``: what the index stage measured to reach
            its target recall).
        rerank: candidates per neighbour re-ranked by their exact similarity (0: the index's own
            scores; ``auto``: as measured by the index stage).
        screen: the precision of the exact backend's screening product (``auto``: float16 on
            CUDA, float32 on the CPU; ``gnnlm.retrieval.exact``): the time, never the result.
    """
    K: int = 1024
    leakage_window: int | None = None
    train_queries: int | None = None
    batch_size: int = 4096
    backend: Literal["index", "exact"] = "index"
    chunk: int = 65536
    devices: Union[int, Literal["auto"]] = 1
    shard_index: bool = False
    nprobe: Union[int, Literal["auto"]] = "auto"
    rerank: Union[float, Literal["auto"]] = "auto"
    screen: Literal["auto", "float16", "float32"] = "auto"

    def __post_init__(self):
        for name in ("K", "batch_size", "chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"neighbors.{name} must be >= 1 (got {getattr(self, name)}).")
        if self.train_queries is not None and self.train_queries < 1:
            raise ValueError(f"neighbors.train_queries must be >= 1 or None for all "
                             f"(got {self.train_queries}).")
        if self.leakage_window is not None and self.leakage_window < 0:
            raise ValueError(f"neighbors.leakage_window must be >= 0 or None for the base LM's "
                             f"context length (got {self.leakage_window}).")
        if self.backend not in ("index", "exact"):
            raise ValueError(f"neighbors.backend must be 'index' or 'exact' "
                             f"(got {self.backend!r}).")
        check_devices(self.devices, "neighbors.devices")
        if self.screen not in ("auto", "float16", "float32"):
            raise ValueError(f"neighbors.screen must be 'auto', 'float16' or 'float32' "
                             f"(got {self.screen!r}).")
        if self.nprobe != "auto" and int(self.nprobe) < 1:
            raise ValueError(f"neighbors.nprobe must be >= 1 or 'auto' (got {self.nprobe}).")
        if self.rerank != "auto" and not (float(self.rerank) == 0 or float(self.rerank) >= 1):
            raise ValueError(f"neighbors.rerank must be 0 (the index's own scores), >= 1 "
                             f"(candidates per neighbour, re-ranked exactly) or 'auto' "
                             f"(got {self.rerank}).")
        if self.shard_index and (self.backend != "index" or self.devices != 1):
            raise ValueError(f"neighbors.shard_index spreads one faiss index over the GPUs of "
                             f"one process: it needs backend 'index' and devices 1 (got "
                             f"backend={self.backend!r}, devices={self.devices!r}).")

    def fingerprint_config(self) -> dict:
        """The fields that define the neighbours (how many processes searched them, or in what
        precision exact search screened, does not)."""
        cfg = asdict(self)
        for name in ("devices", "shard_index", "nprobe", "rerank", "screen"):  # `search`
            cfg.pop(name)
        return cfg
