"""PQ-compressed node features (GNN-LM §3.1 "Feature Quantization").

The graph's neighbour nodes take their features from the train datastore. GNN-LM stores them
product-quantized (1,024 dims → 128 bytes) and decodes batches on the fly; we do the same with a
faiss codec (``OPQ{m},PQ{m}`` or ``PQ{m}``, 8 bits per sub-quantizer), trained on a seeded sample,
and keep raw float16 features as an alternative (``RawFeatures``). The build reports the relative
reconstruction error ``‖x − x̂‖² / ‖x‖²`` on held-out train features: a seeded sample of the
positions the codec was not trained on (``held_out_sample``), so the error is not flattered by
vectors the codebooks were fitted to (None when the codec was trained on every feature).

The codebooks' k-means is most of a build's time, and faiss-cpu runs it on one core (a 64-byte
codec for 512-d features trained on 65,536 of them: 12 s, two threads no faster than one, on a
2-core AMD EPYC). On a GPU torch's
k-means trains them (``PQConfig.clustering``, ``train_codebooks``) and faiss encodes, so the
codec written is an ordinary faiss codec either way.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import faiss
import numpy as np
import torch

from gnnlm.gnn.node_features import ResidentPQ, ResidentRows
from gnnlm.gnn.settings import PQConfig  # the settings, without faiss: importable from here too
from gnnlm.retrieval.features import check_key, open_features
from gnnlm.retrieval.kmeans import batched_kmeans
from gnnlm.utils.devices import torch_device
from gnnlm.utils.progress import format_seconds, say
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest


def codec_factory(d: int, m: int, opq: bool) -> str:
    if m <= 0 or d % m:
        raise ValueError(f"PQ needs m dividing the feature dimension {d} (got m={m}).")
    # np: no polysemous training (it only serves Hamming-threshold search, unused here)
    return f"OPQ{m},PQ{m}x8np" if opq else f"PQ{m}x8np"


HELD_OUT = 8192  # train features the reconstruction error is measured on


def _sample(n: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(size, n), replace=False))


def held_out_sample(n: int, config: PQConfig, size: int = HELD_OUT) -> np.ndarray:
    """Sorted positions, seeded (``config.seed + 1``), among the ``n`` train features that the
    codec's training sample (``_sample(n, config.train_sample, config.seed)``) left out: at most
    ``size``, none when the codec was trained on every feature."""
    trained = _sample(n, config.train_sample, config.seed)
    if n - len(trained) <= size:  # few left: every one of them
        rest = np.ones(n, dtype=bool)
        rest[trained] = False
        return np.flatnonzero(rest)
    # rejection sampling, not a list of the untrained positions: n reaches 10⁸ (WikiText-103)
    rng = np.random.default_rng(config.seed + 1)
    picked = np.zeros(0, dtype=np.int64)
    while len(picked) < size:
        draw = rng.integers(0, n, size=2 * size)
        picked = np.concatenate([picked, draw[~np.isin(draw, trained)]])
        _, first = np.unique(picked, return_index=True)
        picked = picked[np.sort(first)]                                # drawn order, no repeats
    return np.sort(picked[:size])


def clustering_of(config: PQConfig) -> str:
    """What trains the codebooks (``PQConfig.clustering``): ``auto`` is torch when torch sees a
    GPU, and faiss for an OPQ codec (faiss trains its rotation with the codebooks)."""
    if config.clustering != "auto":
        return config.clustering
    return "torch" if torch.cuda.is_available() and not config.opq else "faiss"


def train_codebooks(codec: faiss.Index, sample: np.ndarray, device: torch.device) -> None:
    """Train a ``PQ{m}x8np`` codec on ``sample`` float32 [n, d] with torch's k-means on
    ``device``: each of the m sub-spaces clustered on its own into 256 centroids, with faiss's
    iterations and seed (``codec.pq.cp``), as ``ProductQuantizer.train`` runs them. The
    codebooks go into the codec, which faiss then encodes and decodes with as ever."""
    codec = faiss.downcast_index(codec)
    if not isinstance(codec, faiss.IndexPQ) or codec.pq.nbits != 8:
        raise ValueError(f"train_codebooks trains 8-bit PQ codecs, not {type(codec).__name__}: "
                         f"let faiss train it (pq.clustering: faiss).")
    pq = codec.pq
    x = torch.from_numpy(np.ascontiguousarray(sample, dtype=np.float32)).to(device)
    subspaces = x.view(len(x), pq.M, pq.dsub).transpose(0, 1).contiguous()   # [M, n, dsub]
    codebooks = batched_kmeans(subspaces, pq.ksub, pq.cp.niter, seed=pq.cp.seed)
    faiss.copy_array_to_vector(codebooks.cpu().numpy().ravel(), pq.centroids)  # [M, ksub, dsub]
    codec.is_trained = True


def build_pq(workdir: Workdir, key: str, config: PQConfig | None = None, rebuild: bool = False,
             stop_after_chunks: int | None = None) -> dict:
    """Train the codec on a seeded sample and encode all train ``key`` features in resumable
    chunks into ``workdir.pq(key)``."""
    config = config or PQConfig()
    feat_manifest, arrays = open_features(workdir.features("train"))
    check_key(feat_manifest, key)
    keys = arrays[key]                                                 # [N, d] float16
    n, d = keys.shape
    m = config.m or max(1, d // 4)
    factory = codec_factory(d, m, config.opq)
    out_dir = workdir.pq(key)
    builder = ArtifactBuilder(out_dir, kind="pq",
                              config={**config.fingerprint_config(), "key": key, "m": m,
                                      "factory": factory},
                              inputs={"features": feat_manifest["fingerprint"]}, rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    t0 = time.perf_counter()
    with builder:
        codec_path = builder.file("codec.faiss")
        if codec_path.exists():  # resuming: never retrain, the codes written so far depend on it
            codec = faiss.read_index(str(codec_path))
        else:
            # the codec's k-means is most of the stage's time (minutes for m = 64 on 1,024-d
            # features), before the chunk loop whose progress line counts only the encoding:
            # say when it starts and what it took, so a log does not read "0s elapsed" after it
            sample = np.ascontiguousarray(keys[_sample(n, config.train_sample, config.seed)],
                                          dtype=np.float32)
            clustering = clustering_of(config)
            say(f"  PQ codec {key}: training {factory} on {len(sample)} of {n} features "
                f"(k-means: {clustering})")
            t_codec = time.perf_counter()
            codec = faiss.index_factory(d, factory)
            if clustering == "torch":
                train_codebooks(codec, sample, torch_device("auto"))
            else:
                codec.train(sample)  # faiss k-means is seeded by default (seed 1234)
            faiss.write_index(codec, str(codec_path))
            builder.save_progress(codec_seconds=round(time.perf_counter() - t_codec, 2),
                                  clustering=clustering)
            say(f"  PQ codec {key}: trained in {format_seconds(time.perf_counter() - t_codec)}")
        codes = builder.array("codes", np.uint8, (n, codec.sa_code_size()))
        n_chunks = -(-n // config.chunk)
        for chunk in builder.chunks(n_chunks, f"PQ codes {key}", stop_after_chunks):
            rows = slice(chunk * config.chunk, min((chunk + 1) * config.chunk, n))
            codes[rows] = codec.sa_encode(np.ascontiguousarray(keys[rows], dtype=np.float32))
        if builder.interrupted:
            return {}
        held_out = held_out_sample(n, config)
        rel_error = None  # trained on every feature: nothing held out to measure on
        if len(held_out):
            x = np.asarray(keys[held_out], dtype=np.float32)
            x_hat = codec.sa_decode(np.ascontiguousarray(codes[held_out]))
            rel_error = float(((x - x_hat) ** 2).sum() / max((x ** 2).sum(), 1e-12))
        return builder.finish(extra={
            "n": n, "dim": d, "code_bytes": int(codec.sa_code_size()), "factory": factory,
            "relative_reconstruction_error": rel_error, "held_out": int(len(held_out)),
            "compression": float(d * 2 / codec.sa_code_size()),  # vs float16
            "base_lm": feat_manifest["base_lm"], "seconds": round(time.perf_counter() - t0, 2),
            "codec_seconds": builder.progress.get("codec_seconds"),
            # what trained the codebooks (a build from before this was recorded: faiss)
            "clustering": builder.progress.get("clustering", "faiss")})


def decoding_tables(codec: Any) -> tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
    """The codec's decoder as arrays: PQ centroids ``[m, 256, d/m]`` and, for ``OPQ``, its
    rotation ``A [d, d]`` and bias ``b [d]`` (``y = A x + b``; None without OPQ)."""
    rotation = bias = None
    if isinstance(codec, faiss.IndexPreTransform):
        chain: Any = codec.chain  # a SWIG vector (typed as a list)
        transform: Any = faiss.downcast_VectorTransform(chain.at(0))
        rotation = faiss.vector_to_array(transform.A).reshape(transform.d_out, transform.d_in)
        bias = faiss.vector_to_array(transform.b) if transform.have_bias else None
        codec = faiss.downcast_index(codec.index)
    pq = codec.pq
    if pq.nbits != 8:
        raise ValueError(f"PQ node features decode 8-bit codes (the codec has {pq.nbits}).")
    centroids = faiss.vector_to_array(pq.centroids).reshape(pq.M, pq.ksub, pq.dsub)
    return centroids, rotation, bias


class PQFeatures:
    """Decodes train features at given datastore positions from PQ codes.

    Decoding is a table lookup (each code byte picks its sub-quantizer's centroid) and, for
    OPQ, the rotation's inverse, in numpy rather than faiss: the same lookup as the gather that
    decodes on a GPU (``gnnlm.gnn.node_features``), so both give the same bits, and safe in a
    forked DataLoader worker, where a faiss call can wait forever on the OpenMP threads of its
    parent (GNU libgomp is not fork-safe). The tables are read once, here."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(path, kind="pq")
        self.codes = open_array(path, "codes", self.manifest)          # [N, bytes] uint8
        self.dim = self.manifest["dim"]
        self.centroids, self.rotation, self.bias = decoding_tables(
            faiss.read_index(str(self.path / "codec.faiss")))
        self._subquantizer = np.arange(len(self.centroids))[None, :]   # [1, m]

    def __getstate__(self):
        return {**self.__dict__, "codes": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.codes = open_array(self.path, "codes", self.manifest)

    @property
    def resident_bytes(self) -> int:
        """What ``on_device`` places on a device: the codes and the codebooks."""
        return self.codes.nbytes + self.centroids.nbytes

    def on_device(self, device: torch.device) -> ResidentPQ:
        """The codes and codebooks copied to ``device``: positions there → the same features."""
        return ResidentPQ(self.codes, self.centroids, self.rotation, self.bias, device)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        codes = np.asarray(self.codes[positions])                       # [n, m] uint8
        x = self.centroids[self._subquantizer, codes].reshape(len(codes), self.dim)   # [n, d]
        if self.rotation is not None:  # y = A x + b with A orthonormal: x = Aᵀ (y − b)
            x = (x - self.bias if self.bias is not None else x) @ self.rotation
        return x


class RawFeatures:
    """Float16 features read straight from a features artifact (no compression)."""

    def __init__(self, features_dir: str | Path, key: str = "final"):
        manifest, arrays = open_features(features_dir)
        check_key(manifest, key)
        self.features_dir, self.key = Path(features_dir), key
        self.values = arrays[key]                                       # [N, d] float16
        self.dim = manifest["dim"]

    def __getstate__(self):
        return {**self.__dict__, "values": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.values = open_features(self.features_dir)[1][self.key]

    @property
    def resident_bytes(self) -> int:
        return self.values.nbytes

    def on_device(self, device: torch.device) -> ResidentRows:
        """The features copied to ``device``: positions there → the same float32 rows."""
        return ResidentRows(self.values, device)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        # np.take on a plain ndarray view, float16 -> float32 in torch (vectorised): through
        # the memmap subclass and numpy's conversion, 400k rows took several times longer
        rows = np.take(self.values.view(np.ndarray), positions, axis=0)
        return torch.from_numpy(rows).float().numpy()
