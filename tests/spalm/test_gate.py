"""The retrieval heads as nn.Modules: SPALM's gate and the multi-embedding softmax."""
import pytest
import torch

from gnnlm.models.multi_embedding import MultiEmbeddingSoftmax
from gnnlm.spalm.gate import SpalmGate


@pytest.fixture
def setup():
    torch.manual_seed(0)
    V, d, B, K = 40, 8, 5, 4
    weight, bias = torch.randn(V, d), torch.randn(V)
    h = torch.randn(B, d)
    values = torch.randint(0, V, (B, K))
    values[0, 2:] = -1           # fewer neighbours
    values[1] = -1               # none at all
    return SpalmGate(d), h, values, weight, bias


def test_spalm_gate_one_is_exactly_the_base_lm(setup):
    gate, h, values, weight, bias = setup
    logits, g = gate(h, values, weight, bias, force_gate=1.0)
    torch.testing.assert_close(logits, h @ weight.T + bias, rtol=0, atol=0)
    assert torch.all(g == 1)


def test_spalm_gate_zero_predicts_from_memory_alone(setup):
    gate, h, values, weight, bias = setup
    logits, _ = gate(h, values, weight, bias, force_gate=0.0)
    for b in range(h.shape[0]):
        ys = weight[values[b][values[b] >= 0]]
        if len(ys) == 0:
            expected = bias                               # m = 0: nothing retrieved
        else:
            attn = torch.softmax(ys @ h[b], dim=0)
            expected = (attn @ ys) @ weight.T + bias
        torch.testing.assert_close(logits[b], expected)


def test_spalm_learned_gate_is_between(setup):
    gate, h, values, weight, bias = setup
    logits, g = gate(h, values, weight, bias)
    assert torch.all((g > 0) & (g < 1))
    assert g.shape == h.shape                                        # one gate per dimension
    z_scalar = [gate(h, values, weight, bias, force_gate=x)[0] for x in (0.0, 1.0)]
    with torch.no_grad():                                            # a constant gate: W z is
        gate.gate.weight.zero_()                                     # linear in g
        logits, g = gate(h, values, weight, bias)
    c = g[:, :1]
    torch.testing.assert_close(logits, (1 - c) * z_scalar[0] + c * z_scalar[1], atol=1e-5,
                               rtol=1e-5)


def test_multi_embedding_with_one_row_per_word_is_a_plain_softmax():
    torch.manual_seed(0)
    head = MultiEmbeddingSoftmax(vocab_size=30, dim=6, n=1)
    h = torch.randn(7, 6)
    torch.testing.assert_close(head(h), torch.log_softmax(h @ head.weight.T, -1))


def test_multi_embedding_sums_probabilities_per_word():
    torch.manual_seed(0)
    head = MultiEmbeddingSoftmax(vocab_size=5, dim=3, n=3)
    h = torch.randn(2, 3)
    probs = torch.softmax(h @ head.weight.T, -1).view(2, 3, 5).sum(1)
    torch.testing.assert_close(head(h).exp(), probs)
    torch.testing.assert_close(head(h).exp().sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="got 0"):
        MultiEmbeddingSoftmax(5, 3, n=0)
