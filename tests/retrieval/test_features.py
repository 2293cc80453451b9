"""The features stage on a tiny corpus and a tiny random GPT: what it stores, resume, skip,
refuse, and the output embedding."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from gnnlm.models.encode import encode_windows, sliding_windows, stream_tensor
from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.retrieval.features import (
    build_all_features,
    build_features,
    build_output_embedding,
    load_output_embedding,
    open_features,
)
from gnnlm.text.tokens import build_tokens
from gnnlm.workdir.layout import SPLITS, Workdir
from gnnlm.workdir.manifests import open_array
from gnnlm.workdir.refusals import ArtifactError

CONTEXT, STRIDE = 16, 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A word-level corpus of 30 words in train/valid/test files, tokenized once."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    for split, lines in (("train", 40), ("valid", 12), ("test", 8)):
        text = "\n".join(" ".join(rng.choice(words, rng.integers(3, 12))) for _ in range(lines))
        (root / "tiny" / f"{split}.txt").parent.mkdir(exist_ok=True)
        (root / "tiny" / f"{split}.txt").write_text(text + "\n")
    return build_tokens(root / "tokens", "tiny", corpus_path=str(root / "tiny"))


def gpt(store, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=store.vocab_size, context_length=CONTEXT, n_layer=2,
                         n_head=2, d_model=16, d_ff=32, dropout=0.0)).eval()


def build(model, store, wd, split="valid", **kw):
    return build_features(model, store, wd, split, CONTEXT, STRIDE, batch_size=3,
                          chunk_windows=2, device="cpu", **kw)


def reference(model, store, split):
    """final, att and log p(target) of every position from plain forward passes, one window
    at a time (the sliding-window protocol of gnnlm.models.encode)."""
    tokens = np.asarray(store.split(split), dtype=np.int64)
    stream = stream_tensor(tokens, store.bos_id)
    n = len(tokens)
    starts, score_from = sliding_windows(n, CONTEXT, STRIDE)
    final, att = np.zeros((n, 16), np.float32), np.zeros((n, 16), np.float32)
    logprob = np.zeros(n, np.float32)
    with torch.no_grad():
        for s, f in zip(starts, score_from):
            feats = model(stream[s:s + CONTEXT][None])
            logp = torch.log_softmax(model.logits(feats.final[0]), -1)
            rows = np.arange(f, s + CONTEXT)
            final[rows] = feats.final[0, rows - s].numpy()
            att[rows] = feats.att[0, rows - s].numpy()
            logprob[rows] = logp[torch.from_numpy(rows - s), torch.from_numpy(tokens[rows])]
    return final, att, logprob


def test_features_equal_a_direct_forward_pass(store, tmp_path):
    model = gpt(store)
    wd = Workdir(tmp_path)
    manifest = build(model, store, wd)
    n = len(store.split("valid"))
    assert (manifest["n"], manifest["dim"], manifest["vocab_size"]) == (n, 16, store.vocab_size)
    assert manifest["base_lm"]["fingerprint"] == model.fingerprint()
    assert manifest["base_lm"]["name"] == "gpt"
    assert manifest["config"]["context"] == CONTEXT and manifest["config"]["stride"] == STRIDE
    _, arrays = open_features(wd.features("valid"))
    assert arrays["final"].dtype == np.float16 and arrays["targets"].dtype == np.int32
    final, att, logprob = reference(model, store, "valid")
    np.testing.assert_allclose(arrays["final"], final, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(arrays["att"], att, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(arrays["lm_logprob"], logprob, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(arrays["targets"], np.asarray(store.split("valid")))
    assert not np.allclose(arrays["final"], arrays["att"], atol=1e-2)
    assert wd.n_positions("valid") == n


def test_the_stored_keys_are_each_batchs_float32_output_rounded_to_float16(store, tmp_path):
    """The stage writes batch i while batch i + 1 computes, rounding on the device: the
    bytes are those of writing each batch at once after numpy's rounding, at every span
    (batches of 3 windows, chunks of 2: a short batch at each chunk's end)."""
    model = gpt(store)
    wd = Workdir(tmp_path)
    build(model, store, wd)
    _, arrays = open_features(wd.features("valid"))
    tokens = np.asarray(store.split("valid"))
    n_windows = len(sliding_windows(len(tokens), CONTEXT, STRIDE)[0])
    written = 0
    for lo in range(0, n_windows, 2):
        for batch in encode_windows(model, tokens, store.bos_id, CONTEXT, STRIDE,
                                    (lo, min(lo + 2, n_windows)), 3, True):
            span = slice(batch.start, batch.start + len(batch.final))
            for key in ("final", "att"):
                host = getattr(batch, key).numpy().astype(np.float16)
                assert host.tobytes() == np.asarray(arrays[key][span]).tobytes(), (key, span)
            assert batch.logprob.numpy().tobytes() == np.asarray(
                arrays["lm_logprob"][span]).tobytes()
            written += len(batch.final)
    assert written == len(tokens)


def test_torch_rounds_float32_to_float16_as_numpy_does():
    """``HostBatch`` rounds with torch where the stage used numpy: to nearest, ties to even,
    subnormals, overflow to inf, at every float16 step (the halfway points included)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)].astype(np.float32)
    halves = np.sort(halves)
    middles = (halves[:-1].astype(np.float64) + halves[1:]) / 2
    values = np.concatenate([
        halves, middles.astype(np.float32),
        np.nextafter(middles.astype(np.float32), np.float32(np.inf)),
        np.nextafter(middles.astype(np.float32), np.float32(-np.inf)),
        np.array([65519.99, 65520.0, -65520.0, 1e6, np.inf, -np.inf, 3e-8, 6e-8, -1e-9],
                 dtype=np.float32),
        np.random.default_rng(0).standard_normal(100_000).astype(np.float32)])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    got = torch.from_numpy(values).half().numpy()
    assert expected.view(np.uint16).tobytes() == got.view(np.uint16).tobytes()


def test_a_stopped_build_resumes_to_the_same_bytes(store, tmp_path):
    model = gpt(store)
    whole, parts = Workdir(tmp_path / "a"), Workdir(tmp_path / "b")
    build(model, store, whole)
    assert build(model, store, parts, stop_after_chunks=1) == {}
    assert not parts.features("valid").exists()
    assert parts.features("valid").with_name("valid.partial").is_dir()
    assert build(model, store, parts, stop_after_chunks=1) == {}
    resumed = build(model, store, parts)
    for name in ("final.bin", "att.bin", "targets.bin", "lm_logprob.bin"):
        assert (whole.features("valid") / name).read_bytes() == \
            (parts.features("valid") / name).read_bytes(), name
    assert resumed["fingerprint"] == open_features(whole.features("valid"))[0]["fingerprint"]


def test_a_complete_build_is_skipped(store, tmp_path):
    model = gpt(store)
    wd = Workdir(tmp_path)
    first = build(model, store, wd)
    stamp = (wd.features("valid") / "final.bin").stat().st_mtime_ns
    again = build(model, store, wd)
    assert again["created"] == first["created"] and again["fingerprint"] == first["fingerprint"]
    assert (wd.features("valid") / "final.bin").stat().st_mtime_ns == stamp


def test_another_models_weights_are_refused_naming_both_fingerprints(store, tmp_path):
    model, other = gpt(store, seed=0), gpt(store, seed=1)
    assert model.fingerprint() != other.fingerprint()
    wd = Workdir(tmp_path)
    build(model, store, wd)
    with pytest.raises(ArtifactError, match=f"{model.fingerprint()}.*{other.fingerprint()}"):
        build(other, store, wd)
    rebuilt = build(other, store, wd, rebuild=True)
    assert rebuilt["base_lm"]["fingerprint"] == other.fingerprint()


def test_open_features_refuses_another_lm(store, tmp_path):
    model, other = gpt(store, seed=0), gpt(store, seed=1)
    wd = Workdir(tmp_path)
    build(model, store, wd)
    manifest, _ = open_features(wd.features("valid"), expect_lm=model.identity())
    assert manifest["base_lm"]["fingerprint"] == model.fingerprint()
    with pytest.raises(ArtifactError, match=re.escape(model.fingerprint()) + ".*"
                       + re.escape(other.fingerprint())):
        open_features(wd.features("valid"), expect_lm=other.identity())


def test_output_embedding_round_trips(store, tmp_path):
    model = gpt(store)
    wd = Workdir(tmp_path)
    manifest = build_output_embedding(model, wd)
    weight, bias = load_output_embedding(wd)
    torch.testing.assert_close(weight, model.output_embedding()[0].detach(), rtol=0, atol=0)
    assert bias is None and manifest["vocab_size"] == store.vocab_size and manifest["dim"] == 16
    assert manifest["base_lm"]["fingerprint"] == model.fingerprint()
    # a model with an output bias keeps it
    biased = gpt(store, seed=2)
    b = torch.linspace(-1, 1, store.vocab_size)
    biased.output_embedding = lambda: (biased.lm_head.weight, b)
    other = Workdir(tmp_path / "biased")
    build_output_embedding(biased, other)
    weight, bias = load_output_embedding(other)
    torch.testing.assert_close(bias, b, rtol=0, atol=0)
    torch.testing.assert_close(weight, biased.lm_head.weight.detach(), rtol=0, atol=0)


def test_build_all_features_and_a_prefix(store, tmp_path):
    model = gpt(store)
    wd = Workdir(tmp_path)
    manifests = build_all_features(model, store, wd, CONTEXT, STRIDE, batch_size=4,
                                   device="cpu", max_tokens={"train": 50})
    assert set(manifests) == set(SPLITS)
    assert manifests["train"]["n"] == 50 and "lm_logprob" not in manifests["train"]["arrays"]
    for split in ("valid", "test"):
        assert manifests[split]["n"] == len(store.split(split))
        assert "lm_logprob" in manifests[split]["arrays"]
    np.testing.assert_array_equal(open_array(wd.features("train"), "targets"),
                                  np.asarray(store.split("train")[:50]))
    assert load_output_embedding(wd)[0].shape == (store.vocab_size, 16)
