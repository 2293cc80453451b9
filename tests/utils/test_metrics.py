"""Perplexity is token-weighted everywhere, and every model's NLL goes through one function."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gnnlm.utils.metrics import (
    TokenNLL,
    bits_per_token,
    perplexity,
    ppl_from_logprobs,
    target_nll,
    unigram_logprobs,
)


def test_perplexity_weights_tokens_not_batches():
    # Two batches: 4 tokens with NLL 1 each, 1 token with NLL 5.
    batches = [(4.0, 4), (5.0, 1)]
    nll, tokens = sum(b[0] for b in batches), sum(b[1] for b in batches)
    assert perplexity(nll, tokens) == pytest.approx(math.exp(9 / 5))
    mean_of_batch_ppl = np.mean([math.exp(s / n) for s, n in batches])
    assert perplexity(nll, tokens) != pytest.approx(mean_of_batch_ppl)
    assert bits_per_token(nll, tokens) == pytest.approx(9 / 5 / math.log(2))


def test_perplexity_overflow_is_inf_and_no_tokens_is_an_error():
    assert perplexity(1e6, 1) == math.inf
    assert perplexity(math.inf, 3) == math.inf                     # a token of probability 0
    assert perplexity(0.0, 10) == 1.0
    with pytest.raises(ValueError, match=r"at least one scored token \(got 0\)"):
        perplexity(1.0, 0)


def test_ppl_from_logprobs_sums_in_float64():
    rng = np.random.default_rng(0)
    logprobs = np.log(rng.uniform(0.01, 1, 1000))
    assert ppl_from_logprobs(logprobs) == pytest.approx(math.exp(-logprobs.mean()), rel=1e-12)
    assert ppl_from_logprobs(torch.from_numpy(logprobs)) == pytest.approx(
        ppl_from_logprobs(logprobs), rel=1e-12)
    # a million float32 values: a float32 running sum would drift, the float64 one does not
    many = np.full(1_000_000, -2.3, dtype=np.float32)
    assert ppl_from_logprobs(many) == pytest.approx(math.exp(-float(np.float32(-2.3))), rel=1e-9)
    assert ppl_from_logprobs(np.array([-1.0, -np.inf])) == math.inf
    with pytest.raises(ValueError, match="at least one"):
        ppl_from_logprobs(np.array([]))


def test_target_nll_is_minus_log_softmax_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 3
    target = torch.randint(0, 11, (6,))
    expected = -torch.log_softmax(logits, -1)[torch.arange(6), target]
    torch.testing.assert_close(target_nll(logits, target), expected)
    half = target_nll(logits.to(torch.bfloat16), target)
    assert half.dtype == torch.float32 and half.shape == (6,)
    torch.testing.assert_close(half, expected, atol=0.1, rtol=0.05)


def test_target_nll_in_chunks_gives_the_same_bits_and_gradients(monkeypatch):
    """A batch past ``NLL_CHUNK_LOGITS`` is scored in chunks of rows: the same NLL, bit for bit,
    and the same gradient, as one call (here 4 rows of 11 per call, the last chunk short)."""
    from gnnlm.utils import metrics

    torch.manual_seed(0)
    logits = (torch.randn(10, 11) * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 11, (10,))
    whole = target_nll(logits, target)
    (whole_grad,) = torch.autograd.grad(whole.sum(), logits)
    calls = []
    cross_entropy = metrics.F.cross_entropy
    monkeypatch.setattr(metrics, "NLL_CHUNK_LOGITS", 44)
    monkeypatch.setattr(metrics.F, "cross_entropy",
                        lambda x, *a, **k: calls.append(len(x)) or cross_entropy(x, *a, **k))
    chunked = target_nll(logits, target)
    (chunked_grad,) = torch.autograd.grad(chunked.sum(), logits)
    assert calls == [4, 4, 2]
    assert torch.equal(chunked, whole) and torch.equal(chunked_grad, whole_grad)


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_token_nll_sums_masked_tokens_over_batches():
    metric = TokenNLL()
    metric.update(torch.tensor([1.0, 2.0, 100.0]), torch.tensor([1.0, 1.0, 0.0]))
    metric.update(torch.tensor([3.0]), torch.tensor([1.0]))
    assert metric.count.item() == 3
    assert metric.nll.item() == pytest.approx(6.0)
    assert metric.compute().item() == pytest.approx(2.0)          # (1 + 2 + 3) / 3
    metric.reset()
    assert metric.count.item() == 0 and metric.compute().item() == 0.0


def test_unigram_floor_is_add_one_smoothed():
    train = np.array([0, 0, 1, 2, 0, 1])
    V = 4
    targets = np.array([0, 1, 2, 3])
    got = unigram_logprobs(train, targets, V)
    expected = np.log(np.array([3 + 1, 2 + 1, 1 + 1, 0 + 1]) / (len(train) + V))
    np.testing.assert_allclose(got, expected)
    assert np.isfinite(got).all()                                    # unseen words too
    assert np.exp(unigram_logprobs(train, np.arange(V), V)).sum() == pytest.approx(1.0)
