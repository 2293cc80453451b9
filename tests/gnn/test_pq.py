"""PQ-compressed node features: codes, reconstruction error (on held-out rows), resumption, and
the decoders that DataLoader workers receive by pickling."""
from __future__ import annotations

import dataclasses
import pickle
import shutil

import faiss
import numpy as np
import pytest
import torch

from gnnlm.gnn.pq import (
    PQConfig,
    PQFeatures,
    RawFeatures,
    _sample,
    build_pq,
    clustering_of,
    codec_factory,
    held_out_sample,
    train_codebooks,
)
from gnnlm.retrieval.kmeans import batched_kmeans
from gnnlm.utils.devices import torch_device
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.refusals import ArtifactError
from tests.fakes import write_features

N, D = 3000, 32


pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def low_rank(n=N, d=D, rank=2, seed=0):
    """Features on a 2-dimensional subspace plus a little noise: PQ reconstructs them well."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, d))
    return (x + 0.01 * rng.standard_normal((n, d))).astype(np.float32)


def workdir_with_features(root, x) -> Workdir:
    wd = Workdir(root)
    write_features(wd.features("train"), x, att=x[:, ::-1].copy())
    return wd


# Two 16-dimensional sub-quantizers: faiss trains each PQ codebook for about a second however
# few the points, so tests keep m small.
CFG = PQConfig(m=2, opq=False, train_sample=2000, chunk=1000)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    x = low_rank()
    wd = workdir_with_features(tmp_path_factory.mktemp("pq"), x)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        manifest = build_pq(wd, "final", CFG)
    finally:
        faiss.omp_set_num_threads(before)
    return wd, x, manifest


def test_codes_shape_dtype_and_small_reconstruction_error(built):
    wd, x, manifest = built
    codes = open_array(wd.pq("final"), "codes")
    assert codes.shape == (N, 2) and codes.dtype == np.uint8
    assert manifest["code_bytes"] == 2 and manifest["factory"] == "PQ2x8np"
    assert manifest["compression"] == pytest.approx(D * 2 / 2)
    assert manifest["n"] == N and manifest["dim"] == D
    assert manifest["base_lm"]["fingerprint"] == "weights-a"
    error = manifest["relative_reconstruction_error"]
    assert 0 < error < 0.05, error
    decoded = PQFeatures(wd.pq("final"))(np.arange(N))
    keys = x.astype(np.float16).astype(np.float32)
    measured = ((decoded - keys) ** 2).sum() / (keys ** 2).sum()
    # recorded on held-out rows: the 2,000 rows the 256 centroids were fitted to reconstruct
    # better, so the error over every row (two thirds of them fitted) is the smaller
    assert error / 2 < measured < error
    # far better than the best constant (the mean), whose relative error is about 1 here
    mean_error = ((keys - keys.mean(0)) ** 2).sum() / (keys ** 2).sum()
    assert mean_error > 0.9 and error < mean_error / 20


def test_the_error_is_measured_on_rows_the_codec_was_not_trained_on(built):
    wd, x, manifest = built
    trained = _sample(N, CFG.train_sample, CFG.seed)                  # the codec's sample
    held = held_out_sample(N, CFG)
    assert len(np.intersect1d(held, trained)) == 0
    # fewer than 8,192 untrained rows: every one of them, once
    np.testing.assert_array_equal(held, np.setdiff1d(np.arange(N), trained))
    assert manifest["held_out"] == N - CFG.train_sample
    # the recorded error is that of those rows exactly
    keys = x.astype(np.float16).astype(np.float32)[held]
    decoded = PQFeatures(wd.pq("final"))(held)
    assert manifest["relative_reconstruction_error"] == pytest.approx(
        ((decoded - keys) ** 2).sum() / (keys ** 2).sum(), rel=1e-5)


@pytest.mark.parametrize("n,train_sample", [(50_000, 20_000), (30_000, 20_000), (9_000, 8_999),
                                            (8_000, 8_000)])
def test_held_out_rows_are_disjoint_from_the_training_sample(n, train_sample):
    cfg = PQConfig(train_sample=train_sample, seed=3)
    trained = _sample(n, train_sample, cfg.seed)
    held = held_out_sample(n, cfg)
    assert len(np.intersect1d(held, trained)) == 0
    assert len(held) == min(8192, n - min(train_sample, n))
    assert np.all(np.diff(held) > 0) and (len(held) == 0 or 0 <= held[0] <= held[-1] < n)
    np.testing.assert_array_equal(held_out_sample(n, cfg), held)      # seeded: the same rows
    other = held_out_sample(n, PQConfig(train_sample=train_sample, seed=4))
    assert len(held) < 8192 or not np.array_equal(other, held)        # and the seed draws them


def test_a_codec_trained_on_every_row_records_no_error(tmp_path):
    x = low_rank(n=300)
    manifest = build_pq(workdir_with_features(tmp_path, x), "final",
                        PQConfig(m=2, opq=False, train_sample=300))
    assert manifest["held_out"] == 0 and manifest["relative_reconstruction_error"] is None


def test_the_key_picks_the_features(built):
    wd, x, _ = built
    att = build_pq(wd, "att", CFG)
    assert wd.pq("att").is_dir() and att["config"]["key"] == "att"
    decoded = PQFeatures(wd.pq("att"))(np.arange(N))
    att = x[:, ::-1]
    assert ((decoded - att) ** 2).sum() / (att ** 2).sum() < 0.05
    assert ((decoded - x) ** 2).sum() / (x ** 2).sum() > 0.5        # not the final keys


def test_a_stopped_build_resumes_to_the_same_bytes(built, tmp_path):
    wd, x, _ = built
    other = workdir_with_features(tmp_path, x)
    assert build_pq(other, "final", CFG, stop_after_chunks=1) == {}
    partial = other.pq("final").with_name("final.partial")
    assert (partial / "codec.faiss").is_file()
    resumed = build_pq(other, "final", CFG)
    for name in ("codes.bin", "codec.faiss"):
        assert (other.pq("final") / name).read_bytes() == (wd.pq("final") / name).read_bytes()
    assert resumed["fingerprint"] == read_manifest(wd.pq("final"))["fingerprint"]
    assert resumed["relative_reconstruction_error"] == \
        read_manifest(wd.pq("final"))["relative_reconstruction_error"]
    # the codes belong to these features: rebuilt features are encoded again
    shutil.rmtree(other.features("train"))
    write_features(other.features("train"), x + 1)
    again = build_pq(other, "final", CFG)
    assert again["inputs"]["features"] == read_manifest(other.features("train"))["fingerprint"]
    assert (other.pq("final") / "codes.bin").read_bytes() != (wd.pq("final") / "codes.bin"
                                                              ).read_bytes()


def test_decoders_survive_pickling(built):
    wd, x, _ = built
    positions = np.array([5, 0, 2999, 17, 17])
    pq = PQFeatures(wd.pq("final"))
    expected = pq(positions)                                         # codec loaded
    assert expected.shape == (5, D) and expected.dtype == np.float32
    copy = pickle.loads(pickle.dumps(pq))
    np.testing.assert_array_equal(copy(positions), expected)
    assert pq(np.array([], dtype=np.int64)).shape == (0, D)
    raw = RawFeatures(wd.features("train"), "final")
    np.testing.assert_array_equal(raw(positions), x[positions].astype(np.float16).astype(
        np.float32))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(raw))(positions), raw(positions))
    assert raw.dim == pq.dim == D
    # what a DataLoader worker receives holds no open memmap or faiss object
    state = pq.__getstate__()
    assert state["codes"] is None and not any(isinstance(v, faiss.Index) for v in state.values())
    assert raw.__getstate__()["values"] is None


def test_bad_settings_are_refused(built):
    wd, x, _ = built
    with pytest.raises(ValueError, match=r"m dividing the feature dimension 32 \(got m=5\)"):
        build_pq(wd, "final", PQConfig(m=5))
    with pytest.raises(ValueError, match=r"\(got m=0\)"):
        codec_factory(32, 0, opq=False)
    assert codec_factory(32, 8, opq=True) == "OPQ8,PQ8x8np"
    with pytest.raises(ValueError, match=r"key must be one of .*\(got 'mid'\)"):
        build_pq(wd, "mid", CFG)
    with pytest.raises(ArtifactError, match=r"config\.m: 2 → 4"):
        build_pq(wd, "final", PQConfig(m=4, opq=False, train_sample=2000, chunk=1000))


def test_the_log_accounts_for_the_codec_training(tmp_path, monkeypatch, capsys):
    """The codec's k-means comes before the chunk loop, whose line counts only the encoding: the
    log says when training starts and what it took, so it never reads "0s elapsed" after a
    silent wait of minutes."""
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    wd = workdir_with_features(tmp_path, low_rank())
    manifest = build_pq(wd, "final", CFG)
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    start = lines.index("PQ codec final: training PQ2x8np on 2000 of 3000 features "
                        "(k-means: faiss)")
    trained = next(i for i, line in enumerate(lines) if line.startswith("PQ codec final: "
                                                                         "trained in "))
    codes = next(i for i, line in enumerate(lines) if line.startswith("PQ codes final: 3/3"))
    assert start < trained < codes
    assert 0 < manifest["codec_seconds"] <= manifest["seconds"]


@pytest.mark.parametrize("opq", [False, True])
def test_the_numpy_decoder_is_faiss_s(tmp_path, opq):
    """The table lookup (and OPQ's inverse rotation) gives faiss's own ``sa_decode``."""
    x = low_rank(n=1200)
    wd = workdir_with_features(tmp_path, x)
    build_pq(wd, "final", PQConfig(m=4, opq=opq, train_sample=1000, chunk=500))
    codec = faiss.read_index(str(wd.pq("final") / "codec.faiss"))
    assert isinstance(codec, faiss.IndexPreTransform) == opq
    positions = np.array([7, 1199, 0, 7, 300])
    codes = np.ascontiguousarray(open_array(wd.pq("final"), "codes")[positions])
    decoded = PQFeatures(wd.pq("final"))(positions)
    assert decoded.dtype == np.float32 and decoded.shape == (5, D)
    if opq:  # one matrix product in another order: float32 rounding apart
        np.testing.assert_allclose(decoded, codec.sa_decode(codes), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(decoded, codec.sa_decode(codes))


def test_torch_s_k_means_trains_the_codebooks_faiss_encodes_with(built, tmp_path):
    """``pq.clustering: torch`` (what a GPU runs): the codec's codebooks are torch's k-means of
    each sub-space of the same sample, with faiss's iterations and seed, in faiss's layout; faiss
    encodes with them, and they reconstruct the held-out rows as well as faiss's k-means does."""
    wd, x, by_faiss = built
    other = workdir_with_features(tmp_path, x)
    manifest = build_pq(other, "final", dataclasses.replace(CFG, clustering="torch"))
    assert (manifest["clustering"], by_faiss["clustering"]) == ("torch", "faiss")
    assert manifest["config"] == by_faiss["config"]          # what ran it names nothing
    codec = faiss.read_index(str(other.pq("final") / "codec.faiss"))
    sample = x.astype(np.float16).astype(np.float32)[_sample(N, CFG.train_sample, CFG.seed)]
    subspaces = torch.from_numpy(sample).view(len(sample), 2, D // 2).transpose(0, 1)
    expected = batched_kmeans(subspaces.contiguous().to(torch_device("auto")), 256,
                              codec.pq.cp.niter, seed=codec.pq.cp.seed).cpu()  # where it ran
    np.testing.assert_array_equal(
        faiss.vector_to_array(codec.pq.centroids).reshape(2, 256, D // 2), expected.numpy())
    codes = np.ascontiguousarray(open_array(other.pq("final"), "codes"))
    np.testing.assert_array_equal(codes, codec.sa_encode(x.astype(np.float16).astype(
        np.float32)))
    error, faiss_error = (m["relative_reconstruction_error"] for m in (manifest, by_faiss))
    assert 0 < error < 1.25 * faiss_error, (error, faiss_error)


def test_what_trains_the_codebooks(monkeypatch):
    assert clustering_of(PQConfig(opq=False)) == (
        "torch" if torch.cuda.is_available() else "faiss")
    assert clustering_of(PQConfig(opq=False, clustering="torch")) == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert clustering_of(PQConfig(opq=False)) == "torch"
    assert clustering_of(PQConfig(opq=True)) == "faiss"           # OPQ: faiss trains it whole
    assert clustering_of(PQConfig(opq=False, clustering="faiss")) == "faiss"
    with pytest.raises(ValueError, match=r"pq.clustering must be 'auto', 'faiss' or 'torch' "
                                         r"\(got 'gpu'\)"):
        PQConfig(clustering="gpu")
    with pytest.raises(ValueError, match=r"pq.opq: true learns a rotation .* set pq.opq: "
                                         r"false, or pq.clustering: auto or faiss"):
        PQConfig(opq=True, clustering="torch")
    with pytest.raises(ValueError, match=r"8-bit PQ codecs, not IndexPreTransform: let "
                                         r"faiss train it \(pq.clustering: faiss\)"):
        train_codebooks(faiss.index_factory(D, "OPQ4,PQ4x8np"), low_rank(n=300),
                        torch.device("cpu"))


FORKED_DECODE = """
import multiprocessing, sys
import faiss, numpy as np
from gnnlm.gnn.pq import PQFeatures
faiss.omp_set_num_threads(2)
pq = PQFeatures(sys.argv[1])
x = np.random.default_rng(0).standard_normal((20000, 32)).astype("float32")
index = faiss.IndexFlatL2(32); index.add(x); index.search(x[:2000], 4)  # OpenMP threads start
def decode(queue):
    queue.put(pq(np.arange(1000)).shape)
ctx = multiprocessing.get_context("fork")   # what DataLoader workers are on Linux
queue = ctx.Queue()
child = ctx.Process(target=decode, args=(queue,))
child.start()
print(queue.get(timeout=60))
child.join()
"""


def test_a_forked_dataloader_worker_decodes_after_the_parent_ran_faiss_threads(built, tmp_path):
    """GNN-LM's GPU config decodes PQ features in 8 forked DataLoader workers, after the parent
    has run faiss (index, search, PQ training) on OpenMP threads: the workers must not wait on
    those threads (a faiss decode there hung the first run of that config)."""
    import subprocess
    import sys

    wd, _, _ = built
    result = subprocess.run([sys.executable, "-c", FORKED_DECODE, str(wd.pq("final"))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"(1000, {D})"
