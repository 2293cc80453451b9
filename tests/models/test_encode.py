import numpy as np
import pytest
import torch

from gnnlm.models.encode import encode_windows, sliding_windows
from gnnlm.models.gpt import GPT, GPTConfig


@pytest.mark.parametrize("n,C,S", [(100, 16, 8), (100, 16, 16), (17, 16, 4), (5, 16, 8),
                                   (1000, 64, 48)])
def test_every_position_scored_once_with_enough_context(n, C, S):
    starts, score_from = sliding_windows(n, min(C, n), min(S, C, n))
    C = min(C, n)
    scored = np.concatenate([np.arange(f, min(s + C, n)) for s, f in zip(starts, score_from)])
    np.testing.assert_array_equal(scored, np.arange(n))
    assert np.all(starts + C <= n) and np.all(score_from >= starts)
    context = scored - np.repeat(starts, [min(s + C, n) - f for s, f in zip(starts, score_from)])
    assert np.all((context >= C - min(S, C)) | (scored == context))


def test_bad_protocol_is_refused():
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 8, 9)
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 8, 0)


def test_features_do_not_depend_on_chunking():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=16, n_layer=2, n_head=2, d_model=16,
                          d_ff=32, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 50, size=203)

    def run(chunk_windows, batch_size):
        n_windows = len(sliding_windows(len(tokens), 16, 6)[0])
        out = np.zeros((len(tokens), 16), dtype=np.float32)
        lp = np.zeros(len(tokens), dtype=np.float32)
        for lo in range(0, n_windows, chunk_windows):
            window_range = (lo, min(lo + chunk_windows, n_windows))
            for b in encode_windows(model, tokens, 0, 16, 6, window_range, batch_size,
                                    with_logprob=True):
                out[b.start: b.start + len(b.final)] = b.final.numpy()
                lp[b.start: b.start + len(b.final)] = b.logprob.numpy()
        return out, lp

    a, lp_a = run(chunk_windows=3, batch_size=2)
    b, lp_b = run(chunk_windows=1000, batch_size=7)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
    # the first window's positions equal a plain forward pass over the stream prefix
    stream = torch.tensor(np.concatenate([[0], tokens[:15]]))[None]
    with torch.no_grad():
        final = model(stream).final
        logits = model.logits(final)[0]
    np.testing.assert_allclose(a[:16], final[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(lp_a[:16], torch.log_softmax(logits, -1)[
        torch.arange(16), torch.tensor(tokens[:16])].numpy(), atol=1e-5)
