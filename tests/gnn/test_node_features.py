"""Window-node features read on the model's device: the resident tables (a GPU's) decode the bits
the host decodes, and a device without room for them falls back to the host in one line."""
from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

from gnnlm.gnn.node_features import NodeFeatureReader, ResidentPQ, ResidentRows
from gnnlm.gnn.pq import PQConfig, PQFeatures, RawFeatures, build_pq
from gnnlm.utils import devices
from tests.gnn.test_pq import D, N, low_rank, workdir_with_features

pytestmark = pytest.mark.usefixtures("one_faiss_thread")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """PQ codes (``final``) and OPQ codes (``att``) of low-rank features."""
    wd = workdir_with_features(tmp_path_factory.mktemp("node_features"), low_rank())
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for key, opq in (("final", False), ("att", True)):
            build_pq(wd, key, PQConfig(m=2, opq=opq, train_sample=2000, chunk=1000))
    finally:
        faiss.omp_set_num_threads(before)
    return wd


def positions() -> np.ndarray:
    """Every position, shuffled, with repeats (a position retrieved by several tokens)."""
    rng = np.random.default_rng(0)
    return np.concatenate([rng.permutation(N), rng.integers(0, N, 500)])


def test_resident_pq_codes_decode_the_bits_of_the_host_decoder(stored):
    host = PQFeatures(stored.pq("final"))
    assert host.rotation is None
    p = positions()
    got = host.on_device(CPU)(torch.from_numpy(p))
    assert got.dtype == torch.float32 and got.shape == (len(p), D)
    np.testing.assert_array_equal(got.numpy(), host(p))          # a gather: bit for bit
    assert host.on_device(CPU)(torch.zeros(0, dtype=torch.long)).shape == (0, D)


def test_resident_opq_codes_undo_the_rotation_as_the_host_does(stored):
    host = PQFeatures(stored.pq("att"))
    assert host.rotation is not None
    p = positions()
    got = host.on_device(CPU)(torch.from_numpy(p)).numpy()
    # a matrix product: the same up to its rounding, which depends on the device
    np.testing.assert_allclose(got, host(p), rtol=1e-5, atol=1e-6)


def test_the_resident_rotation_stays_float32_under_the_trainer_s_autocast(stored):
    """Under bf16-mixed the model reads window features inside autocast: the inverse rotation
    must not run in bf16 (the window nodes' residual stream would become bf16)."""
    resident = PQFeatures(stored.pq("att")).on_device(CPU)
    p = torch.from_numpy(positions())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = resident(p)
    assert got.dtype == torch.float32
    assert torch.equal(got, resident(p))


def test_resident_raw_features_are_the_stored_float16_widened(stored):
    host = RawFeatures(stored.features("train"), "final")
    p = positions()
    resident = host.on_device(CPU)
    assert isinstance(resident, ResidentRows) and host.resident_bytes == N * D * 2
    got = resident(torch.from_numpy(p))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), host(p))


def test_a_device_without_room_reads_on_the_host_and_says_so_once(stored, monkeypatch,
                                                                  capsys):
    host = PQFeatures(stored.pq("final"))
    reader = NodeFeatureReader(host)
    nbytes = host.resident_bytes
    assert nbytes == N * 2 + host.centroids.nbytes            # 2 code bytes per position
    monkeypatch.setattr(devices, "free_memory", lambda device: 2 * nbytes - 1)
    assert reader._on(CPU) is None
    assert reader._on(CPU) is None                                # decided once per device
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "do not fit in half of cpu's free memory" in said[0]
    monkeypatch.setattr(devices, "free_memory", lambda device: 2 * nbytes)
    assert isinstance(NodeFeatureReader(host)._on(CPU), ResidentPQ)
    # a function of positions has no resident form: read on the host
    assert NodeFeatureReader(lambda q: np.zeros((len(q), D), np.float32))._on(CPU) is None


def test_a_refused_device_is_asked_again_after_reconsider(stored, monkeypatch, capsys):
    """A stage that starts may find the memory an earlier one held free; a device the features
    were placed on keeps them."""
    host = PQFeatures(stored.pq("final"))
    reader = NodeFeatureReader(host)
    nbytes = host.resident_bytes
    monkeypatch.setattr(devices, "free_memory", lambda device: 2 * nbytes - 1)
    assert reader._on(CPU) is None
    monkeypatch.setattr(devices, "free_memory", lambda device: 2 * nbytes)
    assert reader._on(CPU) is None                                # until reconsidered
    reader.reconsider()
    resident = reader._on(CPU)
    assert isinstance(resident, ResidentPQ)
    reader.reconsider()
    assert reader._on(CPU) is resident                            # not copied again
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_on_the_cpu_the_reader_decodes_on_the_host(stored):
    host = RawFeatures(stored.features("train"), "final")
    p = positions()
    got = NodeFeatureReader(host)(torch.from_numpy(p))
    np.testing.assert_array_equal(got.numpy(), host(p))
    table = np.random.default_rng(0).standard_normal((N, D))      # float64 references keep it
    assert NodeFeatureReader(lambda q: table[q])(torch.from_numpy(p)).dtype == torch.float64
