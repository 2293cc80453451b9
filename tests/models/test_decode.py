"""Incremental decoding against computing from scratch, on small synthetic models: the GPT's
key/value cache (with and without Transformer-XL memory) and a Hugging Face model's, the
sliding windows of text that grows (gnnlm.models.decode), GNN-LM's context nodes appended token
by token (gnnlm.gnn.incremental), kNN-LM as a distribution over the vocabulary, re-ranking rows
prepared on the fly, and sampling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gnnlm.gnn.dense import context_layout
from gnnlm.gnn.graph import METADATA, GraphConfig
from gnnlm.gnn.incremental import ContextStates
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.window_states import WindowStates
from gnnlm.inference.generation import check_sampling, choose
from gnnlm.inference.served import NotServed
from gnnlm.models.decode import StreamDecoder, stream_features, window_start
from gnnlm.models.encode import sliding_windows
from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.retrieval.knn import (
    interpolate,
    interpolate_support,
    knn_distribution,
    knn_logprob,
    knn_support,
)
from gnnlm.retrieval.search import RerankKeys, prepare_keys
from tests.fakes import randomise


def gpt(memory: int = 0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, context_length=16, n_layer=2, n_head=2, d_model=16,
                         d_ff=32, dropout=0.0, memory_length=memory)).eval()


def test_the_gpt_cache_reads_a_window_as_the_forward_pass_does():
    model = gpt()
    tokens = torch.randint(0, 50, (3, 12))
    whole = model(tokens)
    features, cache = model.step(tokens[:, :5])
    parts = [features]
    for t in range(5, 12):
        features, cache = model.step(tokens[:, t:t + 1], cache)
        parts.append(features)
    assert cache.length == 12
    for key in ("final", "att"):
        got = torch.cat([getattr(p, key) for p in parts], dim=1)
        torch.testing.assert_close(got, getattr(whole, key), atol=1e-5, rtol=0)


def test_a_segment_started_from_memory_reads_as_forward_with_that_memory():
    model = gpt(memory=6)
    first, second = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(first)
        reference = model(second, memory=before.memory)
        cache = model.memory_cache(before.memory)
        finals = []
        for t in range(9):
            features, cache = model.step(second[:, t:t + 1], cache)
            finals.append(features.final)
    torch.testing.assert_close(torch.cat(finals, 1), reference.final, atol=1e-5, rtol=0)
    for mine, theirs in zip(model.next_memory(cache), reference.memory):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert model.memory_cache(None) is None


def test_window_starts_are_the_scoring_protocol_s_but_for_the_last_window():
    n, C, S = 100, 16, 6
    starts, score_from = sliding_windows(n, C, S)
    for w in range(len(starts) - 1):  # the split's last window is shifted to stay full
        for t in range(score_from[w], score_from[w + 1]):
            assert window_start(t, C, S) == starts[w]
    assert all(C - S <= t - window_start(t, C, S) < C for t in range(C, 200))


@pytest.mark.parametrize("bos_each_window", [False, True])
def test_the_stream_decoder_equals_reading_each_window_from_scratch(bos_each_window):
    model, C, S = gpt(), 16, 6
    stream = torch.randint(1, 50, (2, 61))
    stream[:, 0] = 0
    decoder = StreamDecoder(model, C, S, 0, bos_each_window)
    parts = [decoder.append(stream[:, :9]).final]
    for t in range(9, 61):
        parts.append(decoder.append(stream[:, t:t + 1]).final)
    reference = stream_features(model, stream, range(61), C, S, 0, bos_each_window).final
    torch.testing.assert_close(torch.cat(parts, 1), reference, atol=1e-5, rtol=0)
    assert decoder.slid == (61 - C) // S + 1  # the window moved on every S tokens past C
    # a long prompt at once: only the positions asked for, the same numbers
    again = StreamDecoder(model, C, S, 0, bos_each_window)
    tail = again.append(stream, features_from=50).final
    torch.testing.assert_close(tail, reference[:, 50:], atol=1e-5, rtol=0)
    if bos_each_window:  # the window that reads position 40 opens with BOS, not stream[36]
        window = stream[:, window_start(40, C, S):41].clone()
        window[:, 0] = 0
        torch.testing.assert_close(model(window).final[:, -1], reference[:, 40], atol=1e-5,
                                   rtol=0)


def test_a_hugging_face_model_decodes_with_its_own_cache():
    from transformers import GPT2Config, GPT2LMHeadModel

    from gnnlm.models.hf import HFCausalLM

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=2,
                                    n_head=2)).eval()
    model = HFCausalLM(hf)
    stream = torch.randint(0, 40, (2, 30))
    decoder = StreamDecoder(model, 12, 4, 0)
    parts = [decoder.append(stream[:, :3])]
    for t in range(3, 30):
        parts.append(decoder.append(stream[:, t:t + 1]))
    reference = stream_features(model, stream, range(30), 12, 4, 0)
    for key in ("final", "att"):
        got = torch.cat([getattr(p, key) for p in parts], dim=1)
        torch.testing.assert_close(got, getattr(reference, key), atol=1e-5, rtol=0)


@pytest.mark.parametrize("inter,norm,ctx_window", [("window", "none", None),
                                                    ("retrieved", "pre", 3),
                                                    ("window", "post", None)])
def test_context_nodes_appended_one_by_one_equal_the_evaluation_of_the_block(inter, norm,
                                                                               ctx_window):
    rng = np.random.default_rng(0)
    train = rng.standard_normal((60, 16))
    stack = randomise(GNNStack(16, METADATA, num_layers=3, heads=4, norm=norm, edge_aggr="mean",
                               zero_init_output=False, readout=("ctx",)).double()).eval()
    config = GraphConfig(left=1, right=1, k=5, inter=inter, ctx_window=ctx_window)
    states = WindowStates(stack, lambda p: train[p], 60, config)
    block = 7
    ctx = torch.from_numpy(rng.standard_normal((2, 10, 16)))
    retrieved = torch.from_numpy(rng.integers(-1, 60, (2, 10, 5)))
    retrieved[0, 3] = -1                                               # a token with no window
    context = ContextStates(states, block)
    outputs = [context.append(ctx[:, :3], retrieved[:, :3])]
    for t in range(3, 10):
        if t % block == 0:
            context.new_block()
        outputs.append(context.append(ctx[:, t:t + 1], retrieved[:, t:t + 1]))
    got = torch.cat(outputs, dim=1)
    for start, end in ((0, block), (block, 10)):  # evaluation: each block at once
        mask = torch.ones(2, end - start, dtype=torch.bool)
        expected = states(ctx[:, start:end], context_layout(mask, retrieved[:, start:end],
                                                            config))
        torch.testing.assert_close(got[:, start:end], expected, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="do not fit in the block"):
        context.append(ctx[:, :5], retrieved[:, :5])


def test_the_knn_distribution_sums_to_one_and_is_the_cached_path_at_the_target():
    g = torch.Generator().manual_seed(0)
    N, K, V = 40, 16, 30
    sims = torch.rand(N, K, generator=g) * 0.4 + 0.6
    values = torch.randint(0, V, (N, K), generator=g)
    sims[0, 5:], values[0, 5:] = -math.inf, -1                        # few neighbours
    targets = torch.randint(0, V, (N,), generator=g)
    for k, temperature in ((16, 0.005), (4, 1.0)):
        dist = knn_distribution(sims, values, k, temperature, V)
        torch.testing.assert_close(dist.exp().sum(1), torch.ones(N), atol=1e-5, rtol=0)
        hits = (values == targets[:, None]) & (values >= 0)
        cached = knn_logprob(sims, hits, k, temperature)
        at_target = dist.gather(1, targets[:, None])[:, 0]
        assert torch.equal(torch.isinf(cached), torch.isinf(at_target))
        finite = torch.isfinite(cached)
        torch.testing.assert_close(at_target[finite], cached[finite], atol=1e-6, rtol=0)
    nothing = knn_distribution(torch.full((1, 4), -math.inf), torch.full((1, 4), -1), 4, 1.0, V)
    assert torch.isneginf(nothing).all()                               # λ < 1: the LM's share


def test_interpolating_at_the_knn_support_is_interpolating_the_whole_distribution():
    g = torch.Generator().manual_seed(1)
    N, K, V = 30, 12, 20
    sims = torch.rand(N, K, generator=g)
    values = torch.randint(0, 3, (N, K), generator=g)                  # words repeat, 0 often
    sims[:5, 6:], values[:5, 6:] = -math.inf, -1                       # missing neighbours
    lm = torch.log_softmax(torch.randn(N, V, generator=g), -1)
    words, knn = knn_support(sims, values, 12, 0.1)
    for lam in (0.0, 0.3, 1.0):
        dense = interpolate(lm, knn_distribution(sims, values, 12, 0.1, V), lam)
        sparse = interpolate_support(lm, words, knn, lam)
        assert torch.equal(torch.isinf(dense), torch.isinf(sparse))
        torch.testing.assert_close(sparse[torch.isfinite(dense)], dense[torch.isfinite(dense)],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("metric", ["cos", "ip", "l2"])
def test_rerank_rows_prepared_one_by_one_are_the_same_bits_as_in_ram(metric):
    rng = np.random.default_rng(0)
    keys = (rng.standard_normal((5000, 24)) * 3).astype(np.float16)
    ids = rng.integers(0, 5000, 777)
    in_ram = RerankKeys(keys, metric, in_ram=True).rows(ids)
    assert np.array_equal(RerankKeys(keys, metric, in_ram=False).rows(ids), in_ram)
    assert np.array_equal(in_ram, prepare_keys(keys, metric)[ids])


def test_sampling_is_seeded_and_cut_by_top_k_and_top_p():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4), -1)
    draw = [choose(logprobs, False, 1.0, None, None, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(draw[0], draw[1])
    assert choose(logprobs, True, None, None, None, torch.Generator()).tolist() == [0] * 4
    generator = torch.Generator().manual_seed(0)
    many = torch.cat([choose(logprobs, False, 2.0, 2, None, generator) for _ in range(200)])
    assert set(many.tolist()) == {0, 1}                                # top_k = 2
    p = logprobs[0].exp()
    many = torch.cat([choose(logprobs, False, None, None, float(p[0] + p[1] / 2), generator)
                      for _ in range(200)])
    assert set(many.tolist()) == {0, 1}                                # the mass reaching top_p
    only = choose(logprobs, False, None, None, 1e-6, generator)
    assert only.tolist() == [0] * 4                                    # at least the best


def test_the_smallest_temperature_samples_the_most_likely_token():
    """Dividing log-probabilities of -2.4 by 1e-38 overflows to -inf for every token; from the
    best one's 0 down, the best stays and the others go (the limit T -> 0: greedy)."""
    from gnnlm.inference.sampling import MIN_TEMPERATURE

    assert MIN_TEMPERATURE == torch.finfo(torch.float32).tiny
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, -1.0], [5.0, 0.0, 0.0, 0.0]]), -1)
    for temperature in (MIN_TEMPERATURE, 1e-30, 1e-3):
        drawn = choose(logprobs, False, temperature, None, None, torch.Generator())
        assert drawn.tolist() == [1, 0]
    top = choose(logprobs, False, MIN_TEMPERATURE, 2, 0.9, torch.Generator())
    assert top.tolist() == [1, 0]


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be a positive integer"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    # below the smallest normal float32 the division gave NaN, and torch's multinomial then
    # "probability tensor contains either inf, nan or element < 0"
    ({"temperature": 1e-40}, r"temperature must be at least 1.18e-38, the smallest float32 "),
    ({"greedy": True, "top_k": 5}, "greedy decoding takes the most likely token"),
])
def test_bad_sampling_settings_are_refused_in_one_line(kwargs, message):
    settings = {"max_new_tokens": 5, "greedy": False, "temperature": None, "top_k": None,
                "top_p": None, **kwargs}
    with pytest.raises(NotServed, match=message):
        check_sampling(**settings)
