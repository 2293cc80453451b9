"""kNN-LM maths against direct per-token formulas, and the cache against recomputation."""
from __future__ import annotations

import math

import fakes
import numpy as np
import pytest
import torch

from gnnlm.index import IndexConfig, build_index
from gnnlm.knn import (
    build_knn_cache,
    evaluate,
    fit,
    interpolate,
    knn_lm_logprob,
    knn_logprob,
    open_knn_cache,
    similarity,
    sweep,
)
from gnnlm.neighbors import NeighborsConfig, build_neighbors, open_neighbors


def write_features(path, final, targets, lm_logprob=None, **kw):
    """Features whose ``att`` keys are ``-final`` (so the two key types differ)."""
    return fakes.write_features(path, final, -final, targets, lm_logprob, **kw)


def random_cache(n=500, K=40, seed=0):
    """Sorted similarities with an invalid (-inf) tail on some rows, hits only where valid."""
    rng = np.random.default_rng(seed)
    sims = -np.sort(rng.exponential(1.0, (n, K)), axis=1).astype(np.float32)
    n_valid = rng.integers(0, K + 1, n)
    n_valid[:5] = [0, K, 1, 3, K]
    invalid = np.arange(K)[None] >= n_valid[:, None]
    sims[invalid] = -np.inf
    hits = (rng.random((n, K)) < 0.2) & ~invalid
    hits[1] = False  # a row with neighbours but no hit
    lm = np.log(rng.uniform(0.001, 0.9, n)).astype(np.float32)
    return {"sims": sims, "hits": hits, "lm_logprob": lm}


def loop_knn_logprob(sims, hits, k, temperature):
    """The formula token by token, in float64 (the reference)."""
    out = np.empty(len(sims))
    for t in range(len(sims)):
        s, h = sims[t, :k].astype(np.float64), hits[t, :k]
        weights = np.exp(s / temperature)  # exp(-inf) = 0: invalid neighbours weigh nothing
        num, den = weights[h].sum(), weights.sum()
        out[t] = math.log(num / den) if num > 0 else -math.inf
    return out


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (7, 0.5), (40, 3.0)])
def test_knn_logprob_equals_per_token_formula(k, temperature):
    cache = random_cache()
    got = knn_logprob(cache["sims"], cache["hits"], k, temperature)
    ref = loop_knn_logprob(cache["sims"], cache["hits"], k, temperature)
    assert isinstance(got, np.ndarray) and got.shape == (500,)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-5)
    assert np.isneginf(got[0]) and np.isneginf(got[1])  # no neighbour; no hit
    as_torch = knn_logprob(torch.from_numpy(cache["sims"]), torch.from_numpy(cache["hits"]),
                           k, temperature)
    assert isinstance(as_torch, torch.Tensor)
    np.testing.assert_array_equal(as_torch.numpy(), got)


def test_interpolate_matches_formula_and_edges():
    rng = np.random.default_rng(1)
    a = np.log(rng.uniform(1e-4, 1, 200))
    b = np.log(rng.uniform(1e-4, 1, 200))
    b[:20] = -np.inf
    for lam in (0.0, 0.1, 0.5, 0.9, 1.0):
        got = interpolate(a, b, lam)
        with np.errstate(divide="ignore"):
            ref = np.log((1 - lam) * np.exp(a) + lam * np.exp(b))
        np.testing.assert_allclose(got, ref, rtol=1e-12)
    np.testing.assert_array_equal(interpolate(a, b, 0.0), a)        # λ = 0 is p_LM exactly
    np.testing.assert_array_equal(interpolate(a, b, 1.0), b)        # λ = 1 is p_kNN exactly
    assert np.all(np.isneginf(interpolate(a, b, 1.0)[:20]))
    assert not np.any(np.isnan(interpolate(a, b, 1.0)))
    assert np.isneginf(interpolate(np.array([-np.inf]), np.array([-np.inf]), 0.3)).all()
    lams = np.array([0.0, 0.25, 1.0])[:, None]                       # all λ in one broadcast
    np.testing.assert_allclose(interpolate(a, b, lams)[1], interpolate(a, b, 0.25))


def test_bad_hyperparameters_are_refused():
    cache = random_cache(n=10, K=8)
    with pytest.raises(ValueError, match=r"λ .*\[0, 1\] \(got 1.5\)"):
        interpolate(cache["lm_logprob"], cache["lm_logprob"], 1.5)
    with pytest.raises(ValueError, match=r"\(got -0.1\)"):
        interpolate(cache["lm_logprob"], cache["lm_logprob"], -0.1)
    with pytest.raises(ValueError, match=r"> 0 \(got 0.0\)"):
        knn_logprob(cache["sims"], cache["hits"], 4, 0.0)
    with pytest.raises(ValueError, match=r"between 1 and the K = 8 .*\(got 9\)"):
        knn_logprob(cache["sims"], cache["hits"], 9, 1.0)
    with pytest.raises(ValueError, match=r"\(got 0\)"):
        knn_logprob(cache["sims"], cache["hits"], 0, 1.0)
    with pytest.raises(ValueError, match=r"\(got \[1, 16\]\)"):
        sweep(cache, [1, 16], [1.0], [0.5])
    with pytest.raises(ValueError, match="temperature"):
        sweep(cache, [1], [1.0, -2.0], [0.5])


def test_sweep_equals_pointwise_and_fit_picks_minimum():
    cache = random_cache(n=700, K=32, seed=2)
    ks, temps, lams = [1, 4, 16, 32], [0.3, 1.0, 2.5], [0.0, 0.2, 0.5, 0.8]
    grid = sweep(cache, ks, temps, lams)
    assert grid.shape == (4, 3, 4)
    for i, k in enumerate(ks):
        for j, t in enumerate(temps):
            for l, lam in enumerate(lams):
                knn = loop_knn_logprob(cache["sims"], cache["hits"], k, t)
                ref = np.log((1 - lam) * np.exp(cache["lm_logprob"].astype(np.float64))
                             + lam * np.exp(knn))
                assert grid[i, j, l] == pytest.approx(math.exp(-ref.mean()), rel=1e-5)
                assert evaluate(cache, k, t, lam) == pytest.approx(grid[i, j, l], rel=1e-5)
    base = math.exp(-cache["lm_logprob"].astype(np.float64).mean())
    np.testing.assert_allclose(grid[:, :, 0], base, rtol=1e-6)      # λ = 0: the base LM
    best = fit(cache, ks, temps, lams)
    assert best["ppl"] == grid.min() and best["base_ppl"] == pytest.approx(base)
    i, j, l = np.unravel_index(np.argmin(grid), grid.shape)
    assert (best["k"], best["temperature"], best["lambda"]) == (ks[i], temps[j], lams[l])
    per_token = knn_lm_logprob(cache, best["k"], best["temperature"], best["lambda"])
    assert math.exp(-per_token.astype(np.float64).mean()) == pytest.approx(best["ppl"], rel=1e-5)


def test_similarity_conventions():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((5, 1, 8)), rng.standard_normal((5, 6, 8))
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    np.testing.assert_allclose(similarity(q, k, "cos"), (qn * kn).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(similarity(q, k, "ip"), (q * k).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(similarity(q, k, "l2"), -((q - k) ** 2).sum(-1), rtol=1e-5)
    assert similarity(q, k, "l2").shape == (5, 6)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Train/valid features, an IVF-PQ index (approximate scores, some -1 slots), neighbours,
    and both kinds of cache for valid."""
    root = tmp_path_factory.mktemp("knn")
    rng = np.random.default_rng(4)
    train = rng.standard_normal((2000, 16)).astype(np.float32)
    valid = (train[rng.integers(0, 2000, 300)] + 0.3 * rng.standard_normal((300, 16))
             ).astype(np.float32)
    train_targets = rng.integers(0, 20, 2000).astype(np.int32)
    valid_targets = rng.integers(0, 20, 300).astype(np.int32)
    write_features(root / "train", train, train_targets)
    write_features(root / "valid", valid, valid_targets,
                   lm_logprob=np.log(rng.uniform(0.01, 0.5, 300)), split="valid")
    build_index(root / "train", root / "index",
                IndexConfig(metric="l2", factory="IVF8,PQ4x4np", nprobe=1, recall_queries=50))
    build_neighbors("valid", root / "valid", root / "train", root / "index", root / "nb",
                    NeighborsConfig(K=300), leakage_window=None)
    for scores in ("faiss", "exact"):
        build_knn_cache("valid", root / "valid", root / "train", root / "nb",
                        root / f"cache-{scores}", scores=scores, chunk=64)
    return root, train, valid, train_targets, valid_targets


def test_cache_hits_scores_and_logprob(caches):
    root, train, valid, train_targets, valid_targets = caches
    _, nb = open_neighbors(root / "nb")
    ids = np.asarray(nb["ids"]).astype(np.int64)
    assert np.any(ids < 0)  # one probed list of ~250 keys cannot fill K = 300
    manifest, faiss_cache = open_knn_cache(root / "cache-faiss")
    assert (manifest["key"], manifest["metric"], manifest["K"], manifest["scores"],
            manifest["n"]) == ("final", "l2", 300, "faiss", 300)
    expected_hits = (ids >= 0) & (train_targets[np.maximum(ids, 0)] == valid_targets[:, None])
    np.testing.assert_array_equal(faiss_cache["hits"], expected_hits)
    np.testing.assert_array_equal(faiss_cache["sims"], nb["sims"])
    _, valid_arrays = open_knn_cache(root / "cache-exact")
    np.testing.assert_array_equal(valid_arrays["hits"], expected_hits)
    np.testing.assert_array_equal(valid_arrays["lm_logprob"], faiss_cache["lm_logprob"])
    # Exact scores: recomputed from the stored float16 keys, in the neighbours' order.
    keys = train.astype(np.float16).astype(np.float64)
    q = valid.astype(np.float16).astype(np.float64)
    ref = -((q[:, None, :] - keys[np.maximum(ids, 0)]) ** 2).sum(-1)
    ref[ids < 0] = -np.inf
    np.testing.assert_allclose(valid_arrays["sims"], ref, rtol=1e-5, atol=1e-5)
    valid_slots = ids >= 0
    assert not np.allclose(faiss_cache["sims"][valid_slots], ref[valid_slots], atol=1e-3)
    assert 0 < manifest["hit_coverage"] <= 1


def test_cache_resumes_to_identical_bytes(caches, tmp_path):
    root = caches[0]
    args = ("valid", root / "valid", root / "train", root / "nb")
    assert build_knn_cache(*args, tmp_path / "c", scores="exact", chunk=64,
                           stop_after_chunks=2) == {}
    resumed = build_knn_cache(*args, tmp_path / "c", scores="exact", chunk=64)
    for name in ("sims.bin", "hits.bin", "lm_logprob.bin"):
        assert (tmp_path / "c" / name).read_bytes() == (root / "cache-exact" / name).read_bytes()
    assert resumed["hit_coverage"] == open_knn_cache(root / "cache-exact")[0]["hit_coverage"]
    with pytest.raises(ValueError, match=r"\(got 'real'\)"):
        build_knn_cache(*args, tmp_path / "d", scores="real")


def test_sweep_is_exact_where_float32_weights_underflow():
    # Hits 200 and 120 below the best score: exp underflows in float32, the answer must not.
    sims = np.array([[0.0, -200.0, -300.0], [-5.0, -125.0, -np.inf]], dtype=np.float32)
    hits = np.array([[False, True, False], [False, True, False]])
    cache = {"sims": sims, "hits": hits, "lm_logprob": np.array([-1.0, -2.0], np.float32)}
    grid = sweep(cache, [1, 2, 3], [1.0, 0.5], [1.0, 0.5])
    for i, k in enumerate([1, 2, 3]):
        for j, t in enumerate([1.0, 0.5]):
            for l, lam in enumerate([1.0, 0.5]):
                assert grid[i, j, l] == pytest.approx(evaluate(cache, k, t, lam), rel=1e-5)
    assert np.isinf(grid[0, 0, 0]) and np.isfinite(grid[1, 0, 0])  # k=1: no hit; k=2: e^-200
    assert knn_logprob(sims, hits, 2, 1.0)[0] == pytest.approx(-200.0)


def test_recall_buckets_never_split_a_recall_value():
    from gnnlm.report import recall_buckets
    hits = np.array([0] * 45 + [1] * 10 + [2] * 20 + [7] * 25)
    base = -np.arange(100, dtype=float)
    rows = recall_buckets(hits, base, base + 1.0)
    ranges = [tuple(r["recall_range"]) for r in rows]
    assert ranges == [(0, 0), (1, 2), (7, 7)], ranges
    assert sum(r["tokens"] for r in rows) == 100
    assert rows[0]["base_logprob"] == pytest.approx(base[:45].mean())
    assert all(r["absolute_improvement"] == pytest.approx(1.0) for r in rows)
    spread = recall_buckets(np.arange(100), base, base, n_buckets=5)
    assert [r["tokens"] for r in spread] == [20] * 5
