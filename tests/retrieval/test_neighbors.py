"""Neighbours of every position: leakage masking, resumption, and the exact backend."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.neighbors import (
    NeighborsConfig,
    build_neighbors,
    mask_leakage,
    neighbor_hits,
    neighbor_values,
    open_neighbors,
)
from gnnlm.retrieval.search import exact_search
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError
from tests import fakes


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
    wd = Workdir(tmp_path_factory.mktemp("work"))
    train = random_walk(3000, seed=0)
    write_features(wd.features("train"), train)
    valid = random_walk(700, seed=1, start=train[1234])
    write_features(wd.features("valid"), valid, split="valid", seed=1)
    build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=50))
    build_index(wd, "final", "l2", IndexConfig(factory="IVF16,Flat", recall_queries=50))
    return wd, train, valid


def masked_exact(keys, queries, K, metric, window=0):
    """Exact top K in float64 numpy; with ``window`` W, query t skips the keys p that have read
    its target: t <= p <= t + W."""
    keys, queries = keys.astype(np.float64), queries.astype(np.float64)
    if metric == "cos":
        keys = keys / np.linalg.norm(keys, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        sims = queries @ keys.T
    else:
        sims = -((queries ** 2).sum(1)[:, None] - 2 * queries @ keys.T + (keys ** 2).sum(1)[None])
    if window:
        t = np.arange(len(queries))[:, None]
        ahead = np.arange(len(keys))[None] - t
        sims[(ahead >= 0) & (ahead <= window)] = -np.inf
    ids = np.argsort(-sims, axis=1, kind="stable")[:, :K]
    return np.take_along_axis(sims, ids, 1), ids


def fresh(store_wd: Workdir, root) -> Workdir:
    """A work directory sharing the store's features and indexes, with no neighbours yet."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("features", "index"):
        (root / name).symlink_to(store_wd.root / name)
    return Workdir(root)


def test_train_neighbours_never_leak(store, tmp_path):
    wd, train, _ = store
    wd = fresh(wd, tmp_path)
    W, K = 8, 16
    manifest = build_neighbors(wd, "train", "final", "cos", NeighborsConfig(K=K, chunk=1000),
                               leakage_window=W)
    _, arrays = open_neighbors(wd.neighbors("final", "cos", "train"))
    ids, sims = np.asarray(arrays["ids"]), np.asarray(arrays["sims"])
    assert ids.shape == (3000, K) and ids.dtype == np.int32 and sims.dtype == np.float32
    t = np.arange(3000)[:, None]
    assert np.all(ids >= 0)  # K + W + 1 candidates always leave K unmasked ones
    assert not np.any((ids - t >= 0) & (ids - t <= W))   # none has read the target t
    assert np.any((ids - t < 0) & (ids - t >= -W))       # the text just before t may be kept
    assert np.all(np.diff(sims, axis=1) <= 1e-6)  # best first
    assert manifest["masked"] and manifest["leakage_window"] == W
    assert manifest["search_k"] == K + W + 1
    assert (manifest["key"], manifest["metric"], manifest["split"]) == ("final", "cos", "train")
    assert 0 < manifest["masked_fraction"] <= 1 and manifest["masked_fraction_top_k"] > 0.3
    assert manifest["dropped"] <= manifest["retrieved"]
    # The same neighbours as an exact search that skips the window inside the matmul.
    ref_sims, ref_ids = masked_exact(train.astype(np.float16), train.astype(np.float16), K,
                                     "cos", W)
    assert np.mean(ids == ref_ids) > 0.999
    np.testing.assert_allclose(sims, ref_sims, atol=1e-4)


def test_window_from_config_wins_and_is_required_for_train(store, tmp_path):
    wd = fresh(store[0], tmp_path)
    manifest = build_neighbors(wd, "train", "final", "cos",
                               NeighborsConfig(K=4, leakage_window=3), leakage_window=100)
    assert manifest["leakage_window"] == 3 and manifest["search_k"] == 4 + 3 + 1
    with pytest.raises(ValueError, match="leakage window"):
        build_neighbors(fresh(store[0], tmp_path / "b"), "train", "final", "cos",
                        NeighborsConfig(K=4))


def test_train_queries_keep_a_prefix(store, tmp_path):
    wd = fresh(store[0], tmp_path)
    manifest = build_neighbors(wd, "train", "final", "cos",
                               NeighborsConfig(K=4, train_queries=250), leakage_window=2)
    assert manifest["n"] == 250
    _, arrays = open_neighbors(wd.neighbors("final", "cos", "train"))
    assert arrays["ids"].shape == (250, 4)
    assert np.asarray(arrays["ids"]).max() >= 250  # the datastore itself stays whole


def test_valid_neighbours_are_not_masked(store, tmp_path):
    wd, train, valid = store
    wd = fresh(wd, tmp_path)
    manifest = build_neighbors(wd, "valid", "final", "cos", NeighborsConfig(K=12),
                               leakage_window=8)
    assert not manifest["masked"] and manifest["leakage_window"] is None
    assert "masked_fraction" not in manifest and manifest["search_k"] == 12
    _, arrays = open_neighbors(wd.neighbors("final", "cos", "valid"))
    _, ref_ids = masked_exact(train.astype(np.float16), valid.astype(np.float16), 12, "cos")
    assert np.mean(np.asarray(arrays["ids"]) == ref_ids) > 0.999
    # The walk starts at train position 1234: its first queries find the positions around it.
    assert np.any(np.abs(np.asarray(arrays["ids"])[0] - 1234) < 8)


@pytest.mark.parametrize("split", ["train", "valid"])
def test_killed_build_resumes_to_identical_bytes(store, tmp_path, split):
    a, b = fresh(store[0], tmp_path / "a"), fresh(store[0], tmp_path / "b")
    cfg = NeighborsConfig(K=10, chunk=128, batch_size=50, nprobe=4)
    whole = build_neighbors(a, split, "final", "l2", cfg, leakage_window=5)
    assert build_neighbors(b, split, "final", "l2", cfg, leakage_window=5,
                           stop_after_chunks=2) == {}
    assert build_neighbors(b, split, "final", "l2", cfg, leakage_window=5,
                           stop_after_chunks=1) == {}
    resumed = build_neighbors(b, split, "final", "l2", cfg, leakage_window=5)
    for name in ("ids.bin", "sims.bin"):
        assert (a.neighbors("final", "l2", split) / name).read_bytes() == \
            (b.neighbors("final", "l2", split) / name).read_bytes()
    assert resumed.get("masked_fraction") == whole.get("masked_fraction")
    assert resumed["metric"] == "l2" and resumed["nprobe"] == 4
    assert resumed["fingerprint"] == whole["fingerprint"]
    _, arrays = open_neighbors(b.neighbors("final", "l2", split))
    sims = np.asarray(arrays["sims"])
    assert np.all(sims[np.asarray(arrays["ids"]) >= 0] <= 0)  # l2: negative squared distances


@pytest.mark.parametrize("split", ["train", "valid"])
def test_exact_backend_equals_exact_search(store, tmp_path, split):
    wd, train, valid = store
    wd = fresh(wd, tmp_path)
    queries = train if split == "train" else valid
    W = 6
    manifest = build_neighbors(wd, split, "final", "l2",
                               NeighborsConfig(K=9, backend="exact", batch_size=333),
                               leakage_window=W, device="cpu")
    assert manifest["backend"] == "exact" and manifest["factory"] == "exact"
    _, arrays = open_neighbors(wd.neighbors("final", "l2", split))
    ref_sims, ref_ids = masked_exact(train.astype(np.float16), queries.astype(np.float16), 9,
                                     "l2", W if split == "train" else 0)
    ids, sims = np.asarray(arrays["ids"]), np.asarray(arrays["sims"])
    # Equal up to float32 rounding of -|q|^2 + 2q·k - |k|^2 (norms² in the hundreds here): only
    # near-ties may swap places, and the scores agree.
    assert np.mean(ids == ref_ids) > 0.999
    np.testing.assert_allclose(sims, ref_sims, rtol=1e-5, atol=5e-3)
    swapped = ids != ref_ids
    assert np.all(np.abs(sims[swapped] - ref_sims[swapped]) < 5e-3)


def test_the_exact_backend_reads_no_index(store, tmp_path):
    wd, train, valid = store
    alone = Workdir(tmp_path)
    (tmp_path / "features").symlink_to(wd.root / "features")       # features, and no index
    manifest = build_neighbors(alone, "valid", "final", "cos",
                               NeighborsConfig(K=9, backend="exact"), device="cpu")
    assert set(manifest["inputs"]) == {"features", "train_features"}
    assert manifest["screen"] == {"float16": 0, "float32": len(valid), "widened": 0,
                                  "rescreened": 0, "exhaustive": 0}
    sims, ids = exact_search(train.astype(np.float16), valid.astype(np.float16), 9, "cos")
    _, arrays = open_neighbors(alone.neighbors("final", "cos", "valid"))
    assert np.array_equal(arrays["ids"], ids) and np.array_equal(arrays["sims"], sims)
    with pytest.raises(ArtifactError, match="No complete index"):       # the index backend
        build_neighbors(alone, "valid", "final", "cos", NeighborsConfig(K=9), device="cpu")


def test_exact_neighbours_made_when_the_index_was_listed_are_reused(store, tmp_path, capsys):
    """Exact neighbours from before exact search stopped listing the index among its inputs:
    the same neighbours, reused (not refused, which would rebuild every stage reading them)."""
    wd, _, _ = store
    wd = fresh(wd, tmp_path)
    config = NeighborsConfig(K=9, backend="exact")
    built = build_neighbors(wd, "valid", "final", "cos", config, device="cpu")
    path = wd.neighbors("final", "cos", "valid")
    older = fakes.as_older_code_wrote_it(
        path, lambda m: m["inputs"].update(index=read_manifest(wd.index("final", "cos"))[
            "fingerprint"]))
    capsys.readouterr()
    again = build_neighbors(wd, "valid", "final", "cos", config, device="cpu")
    assert again["inputs"] == older["inputs"] != built["inputs"]
    assert "made when exact search listed the index" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="other settings"):       # other settings still are
        build_neighbors(wd, "valid", "final", "cos", NeighborsConfig(K=8, backend="exact"),
                        device="cpu")


def test_refuses_other_base_lm_and_bad_k(store, tmp_path):
    wd, _, valid = store
    other = Workdir(tmp_path)
    other.features("train").parent.mkdir(parents=True)
    other.features("train").symlink_to(wd.features("train"))
    (tmp_path / "index").symlink_to(wd.root / "index")
    write_features(other.features("valid"), valid, lm=("other-lm", "weights-b"), split="valid")
    with pytest.raises(ArtifactError, match=r"other-lm.*weights-b.*fake-lm.*weights-a"):
        build_neighbors(other, "valid", "final", "cos", NeighborsConfig(K=4), leakage_window=4)
    with pytest.raises(ValueError, match=r"datastore size 3000 \(got 5000\)"):
        build_neighbors(fresh(wd, tmp_path / "b"), "valid", "final", "cos",
                        NeighborsConfig(K=5000), leakage_window=4)
    with pytest.raises(ValueError, match=r"backend must be 'index' or 'exact' \(got 'hnsw'\)"):
        NeighborsConfig(backend="hnsw")
    with pytest.raises(ArtifactError, match="No complete index"):
        build_neighbors(fresh(wd, tmp_path / "c"), "valid", "att", "cos", NeighborsConfig(K=4))


def test_index_over_other_train_features_is_refused(store, tmp_path):
    """Train features rebuilt after the index: neighbour ids would point at other positions."""
    wd, train, valid = store
    other = Workdir(tmp_path)
    write_features(other.features("train"), train + 1)                # same base LM
    other.features("valid").symlink_to(wd.features("valid"))
    (tmp_path / "index").symlink_to(wd.root / "index")
    with pytest.raises(ArtifactError, match=r"features: \w+ → \w+.*rebuild the index"):
        build_neighbors(other, "valid", "final", "cos", NeighborsConfig(K=4))


def test_mask_leakage_keeps_order_and_pads():
    ids = torch.tensor([[5, 6, 9, 1, -1], [0, 1, 2, 3, 4]])
    sims = torch.tensor([[5., 4., 3., 2., -np.inf], [5., 4., 3., 2., 1.]])
    # t = 5, W = 2 drops 5 and 6 (5 <= p <= 7); t = 2 drops 2, 3, 4
    out_sims, out_ids, counts = mask_leakage(sims, ids, torch.tensor([5, 2]), 2, K=3)
    np.testing.assert_array_equal(out_ids, [[9, 1, -1], [0, 1, -1]])
    np.testing.assert_array_equal(out_sims, [[3., 2., -np.inf], [5., 4., -np.inf]])
    assert counts == {"retrieved": 9, "dropped": 5, "retrieved_top_k": 6, "dropped_top_k": 3}


def stable_sort_mask(sims, ids, positions, window, K):
    """The leakage mask as a stable sort of "not kept" (what the neighbours used to run on the
    host, in numpy): the reference."""
    valid = ids >= 0
    ahead = ids - positions[:, None]
    keep = valid & ~((ahead >= 0) & (ahead <= window))
    order = np.argsort(~keep, axis=1, kind="stable")[:, :K]
    out_ids = np.where(np.take_along_axis(keep, order, 1), np.take_along_axis(ids, order, 1), -1)
    out_sims = np.where(np.take_along_axis(keep, order, 1), np.take_along_axis(sims, order, 1),
                        -np.inf)
    return out_sims, out_ids


def test_mask_leakage_at_the_table_s_width_is_the_stable_sort_s():
    """2,048 train queries searched K + W + 1 = 1,537 wide (K = 1,024, W = 512): the first K
    kept candidates of each, bits and order as the reference selects them, rows left short of
    K by invalid ids or by a crowded window included."""
    rng = np.random.default_rng(0)
    n, K, window = 2048, 1024, 512
    positions = np.arange(100_000, 100_000 + n)
    ids = rng.integers(0, 2_088_628, (n, K + window + 1))
    ids[:, :5] = positions[:, None] + rng.integers(0, window + 1, (n, 5))  # itself and after
    ids[:3, -700:] = -1                                        # a datastore smaller than wide
    ids[5, :600] = positions[5] + np.arange(600) % (window + 1)   # more masked than W + 1
    sims = -np.sort(rng.random(ids.shape, dtype=np.float32), axis=1)
    sims[ids < 0] = -np.inf
    out_sims, out_ids, counts = mask_leakage(torch.from_numpy(sims), torch.from_numpy(ids),
                                             torch.from_numpy(positions), window, K)
    ref_sims, ref_ids = stable_sort_mask(sims, ids, positions, window, K)
    np.testing.assert_array_equal(out_ids.numpy(), ref_ids)
    np.testing.assert_array_equal(out_sims.numpy(), ref_sims)
    assert (out_ids[:3] == -1).any(1).all() and (out_ids[5] == -1).any()  # both short cases
    assert counts["dropped"] >= n * 5 and counts["retrieved"] == (ids >= 0).sum()


def test_neighbor_values_and_hits():
    train_targets = np.array([10, 11, 12, 13, 11], dtype=np.int32)
    ids = np.array([[0, 4, -1], [3, 1, 2], [-1, -1, -1]], dtype=np.int32)
    values = neighbor_values(ids, train_targets)
    np.testing.assert_array_equal(values, [[10, 11, -1], [13, 11, 12], [-1, -1, -1]])
    hits = neighbor_hits(ids, train_targets, np.array([11, 12, 10]))
    np.testing.assert_array_equal(hits, [[False, True, False], [False, False, True],
                                         [False, False, False]])
    # a -1 slot is never a hit, even for a target that equals the padding value
    assert not neighbor_hits(np.array([[-1]]), train_targets, np.array([-1])).any()
    # any leading shape: values of [B, T, K] ids
    np.testing.assert_array_equal(neighbor_values(ids[None], train_targets)[0], values)


def test_hits_gathered_from_a_tensor_are_those_from_an_array():
    """The kNN cache holds the train targets as a tensor (gathered by torch on every core, or
    on the GPU), scoring as an array: the same booleans, -1 ids included, from int32 ids as the
    neighbours file stores them."""
    rng = np.random.default_rng(0)
    train_targets = rng.integers(0, 50, 1000)
    ids = rng.integers(-1, 1000, (300, 64)).astype(np.int32)
    ids[:3] = -1                                          # rows with no neighbour at all
    targets = rng.integers(-1, 50, 300)                   # -1: a padding target never hits
    values = np.where(ids >= 0, train_targets[np.maximum(ids, 0)], -1)
    expected = (values == targets[:, None]) & (values >= 0)
    assert 0 < expected.sum() < expected.size
    np.testing.assert_array_equal(neighbor_hits(ids, train_targets, targets), expected)
    np.testing.assert_array_equal(
        neighbor_hits(ids, torch.from_numpy(train_targets), targets), expected)
