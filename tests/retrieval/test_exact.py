"""Exact search (gnnlm/retrieval/exact.py, with exact_scores.py and screening_error.py): a
float16 or float32 screening, certified, returns the definition's neighbours and scores bit for
bit: on near-ties, exact ties and WikiText-2 features, with the leakage mask."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from gnnlm.retrieval import exact, exact_scores, screening_error
from gnnlm.retrieval.exact import ExactSearch
from gnnlm.retrieval.features import open_features
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors, open_neighbors
from gnnlm.retrieval.screening_error import (
    U16,
    half_products_accumulate_in_float32,
    next_down,
    next_up,
)
from gnnlm.retrieval.search import Searcher
from gnnlm.utils import devices
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest

METRICS = ("cos", "ip", "l2")


def crowded_keys(seed=0, n=6000, d=48, nq=200):
    """Clustered float16 keys with exact duplicates and near-duplicates one float16 step apart
    in one component: neighbours whose scores tie, or differ by less than float16 can tell."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, d)) * 2
    keys = (centres[rng.integers(0, 12, n)] + 0.3 * rng.standard_normal((n, d))).astype(
        np.float16)
    keys[100:140] = keys[40]                                        # 41 equal keys
    near = keys[200:260].copy()
    near[:, 3] = np.nextafter(near[:, 3], np.float16(np.inf))       # one step apart
    keys[260:320] = near
    queries = (keys[rng.integers(0, n, nq)].astype(np.float32)
               + 0.05 * rng.standard_normal((nq, d)).astype(np.float32))
    queries[:10] = keys[40]                                         # queries at the ties
    queries[10:20] = keys[200:210]
    return keys, queries


def definition(keys, queries, k, metric):
    """Every key scored by the exact scores' own arithmetic, ties to the lower id."""
    search = ExactSearch(keys, metric, screen="float32", chunk=1000)
    s, i = search._exhaustive(search._queries(queries), k)
    return s.numpy(), i.numpy()


@pytest.mark.parametrize("metric", METRICS)
def test_both_screenings_return_the_definition_bit_for_bit(metric):
    keys, queries = crowded_keys()
    want_s, want_i = definition(keys, queries, 64, metric)
    for screen in ("float16", "float32"):
        search = ExactSearch(keys, metric, screen=screen, chunk=1000)  # several key chunks
        sims, ids = search.search(queries, 64)
        assert np.array_equal(sims, want_s) and np.array_equal(ids, want_i), screen
    # and the definition is the similarity: float64 scores within float32 rounding (of the
    # squared norms, for l2's expansion)
    k64, q64 = keys.astype(np.float64), queries.astype(np.float64)
    if metric == "cos":
        k64 /= np.linalg.norm(k64, axis=1, keepdims=True)
        q64 /= np.linalg.norm(q64, axis=1, keepdims=True)
    every = (-((q64[:, None] - k64[None]) ** 2).sum(-1) if metric == "l2" else q64 @ k64.T)
    tol = 1e-5 * ((q64 ** 2).sum(1).max() + (k64 ** 2).sum(1).max())
    assert np.allclose(want_s, np.take_along_axis(every, want_i, axis=1), rtol=0, atol=tol)
    assert np.allclose(want_s, -np.sort(-every, axis=1)[:, :64], rtol=0, atol=tol)


def test_ties_go_to_the_lower_train_position_whatever_the_batch():
    keys, queries = crowded_keys()
    search = ExactSearch(keys, "cos", screen="float16")
    sims, ids = search.search(queries[:10], 20)                    # 41 keys tie at the top
    assert (sims == sims[:, :1]).all()
    assert (ids == np.r_[40, 100:119]).all()
    one_s, one_i = search.search(queries[:1], 20)                   # one query alone
    assert np.array_equal(one_s, sims[:1]) and np.array_equal(one_i, ids[:1])


def test_the_screening_error_bound_holds_for_every_pair():
    keys, queries = crowded_keys(seed=3)
    for metric in ("cos", "ip"):
        search = ExactSearch(keys, metric, screen="float16")
        q = search._queries(queries)
        q16, eps, scale = search._screening_queries(q, "float16")
        exact = torch.cat([search.pair_scores(q[r:r + 32], search._range(0, len(keys)))
                           for r in range(0, len(q), 32)]).double()
        # before the output's rounding: float16 products are exact in float32, so a float32
        # product of the float16 inputs is the float32 accumulation the bound covers
        summed = torch.mm(q16.float(), search._table.float().T).double() / scale
        gap = (summed - exact).abs().max(dim=1).values
        assert (gap <= eps).all() and (gap > 0).any(), metric  # it does round
        # after it: what certifying and widening take from a float16 score s̃
        screened = torch.mm(q16, search._table.T)                          # float16 [n, N]
        upper = (screened.double() + (next_up(screened).double() - screened.double()) / 2)
        assert (exact <= upper / scale + eps[:, None]).all(), metric       # certify
        least = ((exact - eps[:, None]) * scale).half()
        least = torch.where(least.double() > (exact - eps[:, None]) * scale, next_down(least),
                            least)
        assert (screened >= least).all(), metric                           # widen
        # and half a float16 gap is tighter than the output bound of a product of norms
        assert (upper - screened.double()).max() < U16 * float(q16.double().norm(dim=1).max()
                                                              * search.norms.table_largest)


def _truncated(x: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """``x`` rounded toward zero to a multiple of ``unit`` (float64, exact for these sizes)."""
    return np.sign(x) * np.floor(np.abs(x) / unit) * unit


def _last_place(x: np.ndarray) -> np.ndarray:
    """The unit in the last place of a float32 with the exponent of each ``|x|`` (1 for 0)."""
    exponent = np.frexp(np.where(x == 0, 1.0, np.abs(x)))[1] - 1          # floor(log2|x|)
    return np.ldexp(1.0, exponent - 23)


def tensor_core_products(q16: torch.Tensor, k16: torch.Tensor, n: int) -> np.ndarray:
    """``q16 @ k16.T`` as Fasi et al. (2021) model a tensor core summing float16 products in
    float32: n exact products and the running sum added at once, each term truncated to the
    last place of the largest, the sum truncated to float32 (no extra alignment bits: the
    worst case)."""
    products = q16.double().numpy()[:, None, :] * k16.double().numpy()[None]   # exact
    total = np.zeros(products.shape[:2])
    for j in range(0, products.shape[2], n):
        terms = np.concatenate([total[..., None], products[..., j:j + n]], axis=2)
        unit = _last_place(np.abs(terms).max(axis=2))[..., None]
        block = _truncated(terms, unit).sum(axis=2)
        total = _truncated(block, _last_place(block))
    return total


@pytest.mark.parametrize("n", [4, 8, 16])
def test_the_float16_screening_bound_holds_for_tensor_cores_that_truncate(n):
    d = 64
    gamma = screening_error.gamma(d, screening_error.U32)
    # one large product and d - 1 just under its last place: each block drops them all, an
    # error of about twice γ_d·Σ|q_i k_i|, over an IEEE sum's bound, within TENSOR_CORE_GAMMAS
    small = np.float16(2.0 ** -11.5)
    row = torch.tensor(np.r_[np.float16(1.0), np.full(d - 1, small)])[None]
    summed = tensor_core_products(row, row, n)[0, 0]
    true = float((row.double() ** 2).sum())
    assert summed == 1.0 and true - summed > 1.9 * gamma * true
    assert true - summed <= screening_error.TENSOR_CORE_GAMMAS * gamma * true
    # and the screening's ε bounds such sums, on crowded keys and on that row among them
    keys, queries = crowded_keys(seed=5, n=400, d=d, nq=24)
    keys[0], queries[0] = row.numpy()[0], row.numpy()[0]
    for metric in ("cos", "ip"):
        search = ExactSearch(keys, metric, screen="float16")
        q = search._queries(queries)
        q16, eps, scale = search._screening_queries(q, "float16")
        scores = search.pair_scores(q, search._range(0, len(keys))).double().numpy()
        summed = tensor_core_products(q16, search._table, n) / scale
        gap = np.abs(summed - scores).max(axis=1)
        assert (gap <= eps.numpy()).all(), metric


def test_next_float16_up_and_down_by_bits():
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.978, -0.5, 2.0 ** -24, -(2.0 ** -24), 1000.0,
                           65000.0]).half()
    want_up = np.nextafter(values.numpy(), np.float16(np.inf))
    want_down = np.nextafter(values.numpy(), np.float16(-np.inf))
    assert np.array_equal(next_up(values).numpy(), want_up)
    assert np.array_equal(next_down(values).numpy(), want_down)
    f32 = torch.tensor([0.5, -3.0, 0.0])
    assert np.array_equal(next_down(f32).numpy(), np.nextafter(f32.numpy(), -np.inf))


def test_rows_the_bound_cannot_settle_are_widened_in_the_same_precision():
    keys, queries = crowded_keys()                                  # 41 keys tie at the top
    want_s, want_i = definition(keys, queries[:10], 30, "cos")
    for screen in ("float16", "float32"):
        search = ExactSearch(keys, "cos", screen=screen)
        sims, ids = search.search(queries[:10], 30, margin=0)       # ties across the 30th
        assert search.stats == {"queries": 10, "widened": 10, "rescreened": 0,
                                "exhaustive": 0}, screen
        assert np.array_equal(sims, want_s) and np.array_equal(ids, want_i), screen


@pytest.mark.parametrize("count_elements", [None, 64])
@pytest.mark.parametrize("tied, settled_by", [(1000, "widened"), (2000, "exhaustive")])
def test_rows_float16_cannot_widen_are_screened_in_float32_then_against_every_key(
        tied, settled_by, count_elements, monkeypatch):
    """Also with each row's count of keys to widen summed over slices of 6 key columns, as a
    GPU step of 2,048 rows by every key sums it."""
    if count_elements:
        monkeypatch.setattr(exact, "COUNT_ELEMENTS", count_elements)
    keys, queries = crowded_keys()
    keys[1000:1000 + tied] = keys[40]            # more ties than float16 widens (16 x 30);
    search = ExactSearch(keys, "cos", screen="float16")   # 2,041 more than float32 (16 x 94)
    sims, ids = search.search(queries[:10], 30, margin=0)           # 30, then 94: all ties
    assert search.stats == {"queries": 10, "rescreened": 10, "widened": 0, "exhaustive": 0,
                            settled_by: 10}
    want_s, want_i = definition(keys, queries[:10], 30, "cos")
    assert np.array_equal(sims, want_s) and np.array_equal(ids, want_i)
    assert (ids == np.r_[40, 100:129]).all()
    untied = ExactSearch(crowded_keys()[0], "cos", screen="float16")
    untied.search(queries[20:], 30)                                 # the default margin
    assert untied.stats["exhaustive"] == 0 and untied.stats["rescreened"] == 0


@pytest.mark.parametrize("metric", METRICS)
def test_batched_re_scoring_gives_each_pair_its_pair_scores_bits(metric):
    """Groups of 32 queries with shared and repeated candidates, a last group of 7, unions of
    one and of several tiles: every score equals ``pair_scores`` of that query alone against
    that key alone, in the host's loop over groups and in a GPU's batched re-scoring."""
    keys, queries = crowded_keys(seed=5, n=9000)
    rng = np.random.default_rng(5)
    cand = np.concatenate([rng.integers(0, 9000, (39, 300)),                 # wide unions
                           np.repeat(rng.integers(0, 50, (1, 300)), 32, 0)])  # one small union
    cand[:, 5] = cand[:, 4]                                                  # repeats in a row
    search = ExactSearch(keys, metric, screen="float32", chunk=1000)
    q, cand = search._queries(queries[:71]), torch.from_numpy(cand)
    k_sq = search._k_sq
    want = torch.stack([search.pair_scores(q[i:i + 1], search._rows(cand[i]),
                                           None if k_sq is None else k_sq[cand[i]])[0]
                        for i in range(len(cand))])
    for batched in (False, True):
        search.batched = batched
        assert torch.equal(search._rescore(q, cand), want), batched


def test_a_batched_product_gives_the_bits_of_one_product_per_tile_on_the_cpu():
    """A GPU's batched product of the exact scores (``TILE_BATCH`` tiles per call, the last
    one zero-padded) against the host's one ``torch.mm`` per [32, d] x [d, 4096] tile, and one
    large product: the same float32 bits on this CPU."""
    gen = torch.Generator().manual_seed(0)
    search = ExactSearch(np.zeros((8, 576), np.float16), "ip", screen="float32")
    q = torch.randn(7, 32, 576, generator=gen)
    k = torch.randn(7, 4096, 576, generator=gen)
    per_tile = search._tile_products(q, k)
    search.batched = True
    assert torch.equal(search._tile_products(q, k), per_tile)
    assert torch.equal(per_tile[0], torch.mm(q[0], torch.cat([k[0], k[1]]).T)[:, :4096])


def test_row_norms_are_taken_over_at_least_32_rows_so_no_row_depends_on_how_many_came():
    """CUDA sums fewer than 16 rows in another order than 16 or more: the last queries of a
    split, a prompt's or a widened row's would round otherwise than in a full block."""
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    reduced = []

    def sums(t):
        reduced.append(t.shape[0])
        return (t * t).sum(1)

    for r in (1, 3, 31, 32, 40):
        assert torch.equal(exact_scores._row_by_row(sums, x[:r]), (x[:r] * x[:r]).sum(1))
        assert reduced.pop() == max(r, exact.ROWS)
        assert torch.equal(exact_scores.unit_rows(x[:r]), exact_scores.unit_rows(x)[:r])
        assert torch.equal(exact_scores.squared_norms(x[:r]), exact_scores.squared_norms(x)[:r])


def test_k_beyond_the_datastore_pads_with_minus_one():
    keys, queries = crowded_keys()
    keys, queries = keys[:50], queries[20:]
    sims, ids = ExactSearch(keys, "cos", screen="float16").search(queries[:4], 60)
    assert (ids[:, 50:] == -1).all() and np.isneginf(sims[:, 50:]).all()
    assert sorted(ids[0, :50]) == list(range(50))


def test_half_products_summed_in_half_precision_are_caught_and_screened_in_float32(
        monkeypatch, capsys):
    real_mm = torch.mm

    def summed_in_float16(a, b, **kwargs):
        if a.dtype != torch.float16:
            return real_mm(a, b, **kwargs)
        parts = (a[:, None, :].float() * b.T[None].float()).half()   # [n, m, d]
        while parts.shape[-1] > 1:                                   # a pairwise float16 sum
            parts = (parts[..., 0::2].float() + parts[..., 1::2].float()).half()
        return parts[..., 0]

    # the rehearsal's and the table's widths, and one where random rows would pass
    for d in (64, 512, 1024):
        assert half_products_accumulate_in_float32(torch.device("cpu"), d)
        with monkeypatch.context() as patch:
            patch.setattr(torch, "mm", summed_in_float16)
            assert not half_products_accumulate_in_float32(torch.device("cpu"), d), d
    monkeypatch.setattr(torch, "mm", summed_in_float16)
    keys = crowded_keys()[0][:300]
    assert ExactSearch(keys, "cos", screen="float16").screen == "float32"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "screening in float32" in err[0]


@pytest.mark.parametrize("setting", ["torch.set_float32_matmul_precision('highest')",
                                     "torch.set_float32_matmul_precision('high')",
                                     "torch.set_float32_matmul_precision('medium')",
                                     "torch.backends.cuda.matmul.allow_tf32 = True"])
def test_full_precision_turns_tf32_off_and_leaves_the_setting_readable_after(setting):
    """As a user sets TF32 before a run (Lightning suggests 'medium' on tensor cores): inside,
    float32 products in float32 and float16 ones summed in float32; after, the setting as it
    was, which Lightning reads again when the next stage starts on a GPU."""
    matmul = torch.backends.cuda.matmul
    before = torch.get_float32_matmul_precision()
    try:
        exec(setting)
        was = torch.get_float32_matmul_precision()
        with screening_error.full_precision():
            assert not matmul.allow_fp16_reduced_precision_reduction
            if hasattr(matmul, "fp32_precision"):
                assert matmul.fp32_precision == "ieee"
            else:
                assert not matmul.allow_tf32
            if hasattr(matmul, "allow_fp16_accumulation"):
                assert not matmul.allow_fp16_accumulation
        assert torch.get_float32_matmul_precision() == was
        assert matmul.allow_tf32 == (was != "highest")
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("n", [50_000, 2_088_628, 103_000_000])
@pytest.mark.parametrize("free_gib", [139, 20, 3])
def test_a_gpu_screening_step_scores_every_key_for_as_many_queries_as_fit(n, free_gib,
                                                                          monkeypatch):
    """The steps an H200 (or a GPU with less free memory) would take, planned on the CPU:
    fewer than 2^31 scores a step, every key at once for a block of queries wherever 32 fit,
    and the table's 2.09M keys in blocks of 1,028 queries on an H200."""
    plan = types.SimpleNamespace(device=torch.device("cuda"), chunk=65536, n=n)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gib << 30, 141 << 30))
    budget = min(exact.GPU_SCORE_BYTES, (free_gib << 30) // 4) // 2   # float16 scores
    for b in (10, 2048, 300_000):
        span, rows = ExactSearch._steps(plan, b, 2, resident_table=True)
        assert rows * span <= min(budget, exact.GPU_SCORE_ELEMENTS) and rows >= exact.ROWS
        assert (span == n) == (exact.ROWS * n <= min(budget, exact.GPU_SCORE_ELEMENTS))
    if n == 2_088_628 and free_gib == 139:
        assert ExactSearch._steps(plan, 2048, 2, resident_table=True) == (n, 1028)
    span, rows = ExactSearch._steps(plan, 2048, 4, resident_table=False)   # float32, streamed
    assert span == min(65536, n) and rows * span <= exact.GPU_SCORE_ELEMENTS


def test_keys_too_large_for_the_gpu_stream_from_the_host_with_one_line(monkeypatch, capsys):
    keys = crowded_keys()[0][:300]
    search = ExactSearch(keys, "cos", screen="float16")
    monkeypatch.setattr(devices, "free_memory", lambda device: 40_000)
    assert search._to_gpu(keys, search.device) is keys and search.screen == "float32"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stream from the host" in err[0] and "0.0 GiB" in err[0]


def test_a_screening_precision_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="neighbors.screen must be"):
        NeighborsConfig(screen="bfloat16")
    with pytest.raises(ValueError, match="screen must be one of"):
        ExactSearch(np.zeros((4, 8), np.float16), "cos", screen="half")
    assert "screen" not in NeighborsConfig(screen="float16").fingerprint_config()


# -- on WikiText-2 features -------------------------------------------------------------------
def _linked_workdir(source: Workdir, folder) -> Workdir:
    """A work directory that reads ``source``'s features and index and writes its own
    neighbours."""
    wd = Workdir(folder)
    wd.root.mkdir(parents=True, exist_ok=True)
    for name in ("features", "index"):
        (wd.root / name).symlink_to(source.root / name)
    return wd


@pytest.mark.integration
def test_float16_screening_gives_the_float32_neighbours_of_wikitext2_with_the_leakage_mask(
        workdir, tmp_path):
    source = Workdir(workdir)
    context = int(read_manifest(source.features("train"))["config"]["context"])
    built = {}
    for screen in ("float16", "float32"):
        wd = _linked_workdir(source, tmp_path / screen)
        config = NeighborsConfig(K=64, backend="exact", train_queries=3000, chunk=1024,
                                 batch_size=512, screen=screen)
        manifest = build_neighbors(wd, "train", "final", "cos", config, leakage_window=context,
                                   device="cpu")
        assert manifest["screen"][screen] == 3000 and manifest["masked_fraction"] > 0
        if screen == "float16":  # the bound leaves many rows to widening, few to float32
            assert manifest["screen"]["widened"] > 0, manifest["screen"]
            assert manifest["screen"]["rescreened"] < 0.05 * 3000, manifest["screen"]
        built[screen] = open_neighbors(wd.neighbors("final", "cos", "train"))[1]
    for name in ("ids", "sims"):
        assert np.array_equal(built["float16"][name], built["float32"][name]), name
    ids = np.asarray(built["float16"]["ids"])
    t = np.arange(len(ids))[:, None]
    assert not ((ids >= t) & (ids <= t + context)).any()           # the mask held

    # valid queries: the same as every key scored, and near-ties the float16 screening cannot
    # tell apart are among them
    keys = open_features(source.features("train"))[1]["final"]
    queries = np.asarray(open_features(source.features("valid"))[1]["final"][:512])
    fast = ExactSearch(keys, "cos", screen="float16")
    sims, ids = fast.search(queries, 64)
    want_s, want_i = definition(keys, queries[:96], 64, "cos")
    assert np.array_equal(sims[:96], want_s) and np.array_equal(ids[:96], want_i)
    slow_s, slow_i = Searcher.exact(source, "final", "cos", device="cpu",
                                    screen="float32").search(queries, 64)
    assert np.array_equal(sims, slow_s) and np.array_equal(ids, slow_i)
    eps = fast._screening_queries(fast._queries(queries), "float16")[1].numpy()
    gaps = -np.diff(sims, axis=1)
    assert (gaps < eps[:, None]).mean() > 0.5   # most neighbours sit closer than float16 sees
