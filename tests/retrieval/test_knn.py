"""kNN-LM maths against direct per-token formulas (the cache is tested in test_knn_cache.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gnnlm.retrieval.knn import (
    DEFAULT_KS,
    DEFAULT_LAMBDAS,
    base_perplexity,
    default_temperatures,
    evaluate,
    fit,
    fit_and_score,
    fit_lambda,
    interpolate,
    knn_lm_logprob,
    knn_logprob,
    sweep,
)


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
            for m, lam in enumerate(lams):
                knn = loop_knn_logprob(cache["sims"], cache["hits"], k, t)
                ref = np.log((1 - lam) * np.exp(cache["lm_logprob"].astype(np.float64))
                             + lam * np.exp(knn))
                assert grid[i, j, m] == pytest.approx(math.exp(-ref.mean()), rel=1e-5)
                assert evaluate(cache, k, t, lam) == pytest.approx(grid[i, j, m], rel=1e-5)
    base = math.exp(-cache["lm_logprob"].astype(np.float64).mean())
    np.testing.assert_allclose(grid[:, :, 0], base, rtol=1e-6)      # λ = 0: the base LM
    best = fit(cache, ks, temps, lams)
    assert best["ppl"] == grid.min() and best["base_ppl"] == pytest.approx(base)
    i, j, m = np.unravel_index(np.argmin(grid), grid.shape)
    assert (best["k"], best["temperature"], best["lambda"]) == (ks[i], temps[j], lams[m])
    per_token = knn_lm_logprob(cache, best["k"], best["temperature"], best["lambda"])
    assert math.exp(-per_token.astype(np.float64).mean()) == pytest.approx(best["ppl"], rel=1e-5)


def test_a_gpu_s_larger_blocks_give_the_same_grid(monkeypatch):
    """A GPU sweeps blocks 16 times larger (``_GPU_BLOCK``): the grid is the same up to the
    order of the float64 sums (the CPU stands in for the GPU's block size here)."""
    from gnnlm.retrieval import knn

    cache = random_cache(n=3000, K=2048, seed=5)
    grid = [1, 8, 64, 2048], [0.1, 1.0], [0.0, 0.3, 0.9]
    small = sweep(cache, *grid, device="cpu")
    assert knn._row_step(2048) < 3000                    # several blocks...
    monkeypatch.setattr(knn, "_CPU_BLOCK", knn._GPU_BLOCK)
    assert knn._row_step(2048, knn._CPU_BLOCK) > 3000    # ...against one
    np.testing.assert_allclose(sweep(cache, *grid, device="cpu"), small, rtol=1e-6)


def test_sweep_is_exact_where_float32_weights_underflow():
    # Hits 200 and 120 below the best score: exp underflows in float32, the answer must not.
    sims = np.array([[0.0, -200.0, -300.0], [-5.0, -125.0, -np.inf]], dtype=np.float32)
    hits = np.array([[False, True, False], [False, True, False]])
    cache = {"sims": sims, "hits": hits, "lm_logprob": np.array([-1.0, -2.0], np.float32)}
    grid = sweep(cache, [1, 2, 3], [1.0, 0.5], [1.0, 0.5])
    for i, k in enumerate([1, 2, 3]):
        for j, t in enumerate([1.0, 0.5]):
            for m, lam in enumerate([1.0, 0.5]):
                assert grid[i, j, m] == pytest.approx(evaluate(cache, k, t, lam), rel=1e-5)
    assert np.isinf(grid[0, 0, 0]) and np.isfinite(grid[1, 0, 0])  # k=1: no hit; k=2: e^-200
    assert knn_logprob(sims, hits, 2, 1.0)[0] == pytest.approx(-200.0)


def test_sweep_is_exact_where_float32_weights_are_denormal():
    # Hits 100 below the best score: exp(-100) is a float32 denormal with 5 significant bits.
    sims = np.array([[0.0, -100.0, -101.0], [0.0, -1.0, -100.5]], dtype=np.float32)
    hits = np.array([[False, True, False], [True, False, True]])
    cache = {"sims": sims, "hits": hits, "lm_logprob": np.array([-1.0, -2.0], np.float32)}
    grid = sweep(cache, [2, 3], [1.0], [1.0])
    for i, k in enumerate([2, 3]):
        assert grid[i, 0, 0] == pytest.approx(evaluate(cache, k, 1.0, 1.0), rel=1e-5), k
    assert knn_logprob(sims, hits, 2, 1.0)[0] == pytest.approx(-100.0, abs=1e-4)


@pytest.mark.parametrize("gap", [200.0, 100.0], ids=["far-200T", "denormal-100T"])
def test_sweep_equals_evaluate_on_unsorted_scores_with_a_far_best_at_the_end(gap):
    """Exact scores come in FAISS order, not sorted: a row's best score may sit last, far above
    its first k (at T = 1: 200·T, where float32 weights underflow to 0, and about 100·T, where
    they are denormal and keep only a few bits). Every prefix k must still be as precise as
    ``knn_logprob``."""
    rng = np.random.default_rng(7)
    n, K = 90, 24
    sims = rng.normal(0.0, 1.0, (n, K)).astype(np.float32)           # unsorted
    hits = rng.random((n, K)) < 0.3
    hits[:, 0] = True                                                 # every prefix has a hit
    far = np.arange(n) % 4 != 3                                       # 3 rows in 4
    sims[far, -1] = sims[far, :-1].max(axis=1) + gap + rng.uniform(-2, 2, far.sum())
    hits[far, -1] = np.arange(n)[far] % 2 == 0                        # the far key a hit or not
    cache = {"sims": sims, "hits": hits,
             "lm_logprob": np.log(rng.uniform(0.01, 0.5, n)).astype(np.float32)}
    ks, temps, lams = [1, 4, 8, 23, 24], [0.5, 1.0], [0.0, 0.3, 1.0]
    grid = sweep(cache, ks, temps, lams)
    wrong = []
    for i, k in enumerate(ks):
        for j, t in enumerate(temps):
            for m, lam in enumerate(lams):
                expected = evaluate(cache, k, t, lam)
                assert np.isfinite(expected)
                if grid[i, j, m] != pytest.approx(expected, rel=1e-5):
                    wrong.append((k, t, lam, float(grid[i, j, m]), expected))
    assert not wrong, wrong
    # the reference itself is the per-token formula in float64
    ref = loop_knn_logprob(sims, hits, 24, 1.0)
    np.testing.assert_allclose(knn_logprob(sims, hits, 24, 1.0), ref, rtol=1e-5, atol=1e-5)
    # ks in any order give the same grid rows
    shuffled = sweep(cache, [24, 1, 8], temps, lams)
    np.testing.assert_allclose(shuffled, grid[[4, 0, 2]], rtol=1e-5)


def test_fit_and_score_chooses_on_valid_and_only_scores_test():
    valid, test = random_cache(n=400, K=16, seed=2), random_cache(n=300, K=16, seed=5)
    ks, temps, lams = [1, 4, 16], [0.5, 1.0, 2.0], [0.0, 0.25, 0.5]
    result = fit_and_score(valid, test, ks, temps, lams)
    best = fit(valid, ks, temps, lams)
    point = (result["k"], result["temperature"], result["lambda"])
    assert point == (best["k"], best["temperature"], best["lambda"])
    assert result["valid_ppl"] == best["ppl"]
    assert result["test_ppl"] == pytest.approx(evaluate(test, *point), rel=1e-9)
    np.testing.assert_array_equal(result["test_logprob"], knn_lm_logprob(test, *point))
    # test chooses nothing: another test set is scored at the same point
    other = fit_and_score(valid, random_cache(n=300, K=16, seed=9), ks, temps, lams)
    assert (other["k"], other["temperature"], other["lambda"]) == point
    assert other["test_ppl"] != result["test_ppl"]


def test_fit_lambda_mixes_two_models_and_never_takes_the_other_alone():
    rng = np.random.default_rng(8)
    lm = np.log(rng.uniform(0.01, 0.2, 300))
    other = lm + 0.5                                                   # better at every token
    lam, ppl = fit_lambda(lm, other, [0.0, 0.5, 0.9, 1.0])
    assert lam == 0.9                                                  # λ = 1 is not a mixture
    assert ppl == pytest.approx(math.exp(-interpolate(lm, other, 0.9).mean()))
    assert fit_lambda(lm, lm - 1.0, [0.0, 0.5])[0] == 0.0              # a worse one is not used
    assert base_perplexity({"lm_logprob": lm, "sims": np.zeros((300, 1)),
                            "hits": np.zeros((300, 1), bool)}) == pytest.approx(
        math.exp(-lm.mean()))


def test_default_grids():
    cos = default_temperatures("cos")
    assert 0.01 in cos and max(cos) <= 1.0
    for metric in ("ip", "l2"):
        grid = default_temperatures(metric)
        assert min(grid) > max(cos[:3]) and max(grid) >= 50          # scores hundreds larger
    for grid in (cos, default_temperatures("l2"), DEFAULT_KS, DEFAULT_LAMBDAS):
        assert list(grid) == sorted(grid) and min(grid) >= 0
    assert DEFAULT_LAMBDAS[0] == 0.0 and max(DEFAULT_LAMBDAS) < 1
    with pytest.raises(ValueError, match="missing"):
        sweep({"sims": np.zeros((2, 2))}, [1], [1.0], [0.5])
