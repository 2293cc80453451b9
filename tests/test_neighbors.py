"""Neighbours of every position: leakage masking, resumption, and the exact backend."""
from __future__ import annotations

import fakes
import numpy as np
import pytest

from gnnlm.artifacts import ArtifactError
from gnnlm.index import IndexConfig, build_index, exact_search
from gnnlm.neighbors import NeighborsConfig, build_neighbors, mask_leakage, open_neighbors


def write_features(path, final, lm=("fake-lm", "weights-a"), split="train", seed=0):
    """Features with reversed ``att`` keys and random targets and LM scores."""
    rng = np.random.default_rng(seed)
    n = len(final)
    return fakes.write_features(path, final, final[:, ::-1], rng.integers(0, 50, n),
                                -rng.uniform(0.5, 6, n), lm=lm, split=split)


def random_walk(n, d=16, seed=0, start=None):
    """Neighbouring positions have similar features, as in a text: leakage is likely."""
    rng = np.random.default_rng(seed)
    steps = 0.3 * rng.standard_normal((n, d))
    origin = rng.standard_normal(d) * 3 if start is None else start
    return (origin + np.cumsum(steps, axis=0)).astype(np.float32)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("work")
    train = random_walk(3000, seed=0)
    write_features(root / "features" / "train", train)
    valid = random_walk(700, seed=1, start=train[1234])
    write_features(root / "features" / "valid", valid, split="valid", seed=1)
    build_index(root / "features" / "train", root / "index",
                IndexConfig(metric="cos", factory="Flat", recall_queries=50))
    build_index(root / "features" / "train", root / "index-ivf",
                IndexConfig(metric="l2", factory="IVF16,Flat", nprobe=4, recall_queries=50))
    return root, train, valid


def test_train_neighbours_never_leak(store, tmp_path):
    root, train, _ = store
    W, K = 8, 16
    manifest = build_neighbors("train", root / "features" / "train", root / "features" / "train",
                               root / "index", tmp_path / "nb", NeighborsConfig(K=K, chunk=1000),
                               leakage_window=W)
    _, arrays = open_neighbors(tmp_path / "nb")
    ids, sims = np.asarray(arrays["ids"]), np.asarray(arrays["sims"])
    assert ids.shape == (3000, K) and ids.dtype == np.int32 and sims.dtype == np.float32
    t = np.arange(3000)[:, None]
    assert np.all(ids >= 0)  # K + 2W - 1 candidates always leave K unmasked ones
    assert not np.any(np.abs(ids - t) < W)
    assert np.all(np.diff(sims, axis=1) <= 1e-6)  # best first
    assert manifest["masked"] and manifest["leakage_window"] == W
    assert manifest["search_k"] == K + 2 * W - 1
    assert 0 < manifest["masked_fraction"] <= 1 and manifest["masked_fraction_top_k"] > 0.5
    assert manifest["dropped"] <= manifest["retrieved"]
    # The same neighbours as an exact search that skips the window inside the matmul.
    ref_sims, ref_ids = exact_search(train.astype(np.float16), train.astype(np.float16), K,
                                     "cos", exclude=(np.arange(3000), W))
    assert np.mean(ids == ref_ids) > 0.999
    np.testing.assert_allclose(sims, ref_sims, atol=1e-4)


def test_window_from_config_wins_and_is_required_for_train(store, tmp_path):
    root, _, _ = store
    args = ("train", root / "features" / "train", root / "features" / "train", root / "index")
    manifest = build_neighbors(*args, tmp_path / "nb", NeighborsConfig(K=4, leakage_window=3),
                               leakage_window=100)
    assert manifest["leakage_window"] == 3 and manifest["search_k"] == 4 + 5
    with pytest.raises(ValueError, match="leakage window"):
        build_neighbors(*args, tmp_path / "nb2", NeighborsConfig(K=4))


def test_valid_neighbours_are_not_masked(store, tmp_path):
    root, train, valid = store
    manifest = build_neighbors("valid", root / "features" / "valid", root / "features" / "train",
                               root / "index", tmp_path / "nb", NeighborsConfig(K=12),
                               leakage_window=8)
    assert not manifest["masked"] and manifest["leakage_window"] is None
    assert "masked_fraction" not in manifest and manifest["search_k"] == 12
    _, arrays = open_neighbors(tmp_path / "nb")
    _, ref_ids = exact_search(train.astype(np.float16), valid.astype(np.float16), 12, "cos")
    assert np.mean(np.asarray(arrays["ids"]) == ref_ids) > 0.999
    # The walk starts at train position 1234: its first queries find the positions around it.
    assert np.any(np.abs(np.asarray(arrays["ids"])[0] - 1234) < 8)


@pytest.mark.parametrize("split", ["train", "valid"])
def test_killed_build_resumes_to_identical_bytes(store, tmp_path, split):
    root, _, _ = store
    cfg = NeighborsConfig(K=10, chunk=128, batch_size=50)
    args = (split, root / "features" / split, root / "features" / "train", root / "index-ivf")
    whole = build_neighbors(*args, tmp_path / "a", cfg, leakage_window=5)
    assert build_neighbors(*args, tmp_path / "b", cfg, leakage_window=5,
                           stop_after_chunks=2) == {}
    assert build_neighbors(*args, tmp_path / "b", cfg, leakage_window=5,
                           stop_after_chunks=1) == {}
    resumed = build_neighbors(*args, tmp_path / "b", cfg, leakage_window=5)
    for name in ("ids.bin", "sims.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert resumed.get("masked_fraction") == whole.get("masked_fraction")
    assert resumed["metric"] == "l2" and resumed["nprobe"] == 4
    _, arrays = open_neighbors(tmp_path / "b")
    sims = np.asarray(arrays["sims"])
    assert np.all(sims[np.asarray(arrays["ids"]) >= 0] <= 0)  # l2: negative squared distances


@pytest.mark.parametrize("split", ["train", "valid"])
def test_exact_backend_equals_exact_search(store, tmp_path, split):
    root, train, valid = store
    queries = train if split == "train" else valid
    W = 6
    manifest = build_neighbors(split, root / "features" / split, root / "features" / "train",
                               root / "index-ivf", tmp_path / "nb",
                               NeighborsConfig(K=9, backend="exact", batch_size=333),
                               leakage_window=W, device="cpu")
    assert manifest["backend"] == "exact" and manifest["factory"] == "exact"
    _, arrays = open_neighbors(tmp_path / "nb")
    exclude = (np.arange(len(queries)), W) if split == "train" else None
    ref_sims, ref_ids = exact_search(train.astype(np.float16), queries.astype(np.float16), 9,
                                     "l2", exclude=exclude)
    ids, sims = np.asarray(arrays["ids"]), np.asarray(arrays["sims"])
    # Equal up to float32 rounding of -|q|^2 + 2q·k - |k|^2 (which depends on the batch shape):
    # only near-ties may swap places, and the scores agree.
    assert np.mean(ids == ref_ids) > 0.999
    np.testing.assert_allclose(sims, ref_sims, rtol=1e-5, atol=2e-3)
    swapped = ids != ref_ids
    assert np.all(np.abs(sims[swapped] - ref_sims[swapped]) < 2e-3)


def test_refuses_other_base_lm_and_bad_k(store, tmp_path):
    root, _, valid = store
    write_features(tmp_path / "valid-b", valid, lm=("other-lm", "weights-b"), split="valid")
    with pytest.raises(ArtifactError, match=r"other-lm.*weights-b.*fake-lm.*weights-a"):
        build_neighbors("valid", tmp_path / "valid-b", root / "features" / "train",
                        root / "index", tmp_path / "nb", NeighborsConfig(K=4), leakage_window=4)
    with pytest.raises(ValueError, match=r"datastore size 3000 \(got 5000\)"):
        build_neighbors("valid", root / "features" / "valid", root / "features" / "train",
                        root / "index", tmp_path / "nb", NeighborsConfig(K=5000),
                        leakage_window=4)
    with pytest.raises(ValueError, match=r"backend must be 'index' or 'exact' \(got 'hnsw'\)"):
        NeighborsConfig(backend="hnsw")


def test_mask_leakage_keeps_order_and_pads():
    ids = np.array([[5, 6, 9, 1, -1], [0, 1, 2, 3, 4]])
    sims = np.array([[5., 4., 3., 2., -np.inf], [5., 4., 3., 2., 1.]], dtype=np.float32)
    out_sims, out_ids, counts = mask_leakage(sims, ids, np.array([5, 2]), 2, K=3)
    np.testing.assert_array_equal(out_ids, [[9, 1, -1], [0, 4, -1]])
    np.testing.assert_array_equal(out_sims, [[3., 2., -np.inf], [5., 1., -np.inf]])
    assert counts == {"retrieved": 9, "dropped": 5, "retrieved_top_k": 6, "dropped_top_k": 4}
