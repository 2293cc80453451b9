"""One BOS rule, decided when the features are built and applied by every route: the features
manifest records it (older ones derive it as the pipeline did); on a tiny Hugging Face GPT-2,
whose tokenizer adds no BOS, ``score``, ``next_token_logprobs``, ``generate`` and ``gnnlm
score`` read the stream the pipeline read (``<|endoftext|>`` first), ``lm.prompt_ids`` gives that
stream to Hugging Face (the model's own logits and greedy ``generate()`` with
``KNNLogitsProcessor`` then agree with gnnlm's), ids are the text's tokens in every route,
and ``KNNLogitsProcessor`` refuses ``input_ids`` without the BOS in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gnnlm
from gnnlm.text.bos import BosRule
from gnnlm.workdir.manifests import open_array, read_manifest

PROMPT = "The game was released in Japan"


@pytest.mark.parametrize("features, tokens, expected", [
    ({"bos": {"id": 7, "opens_stream": True, "each_window": True}}, {"bos_id": 3}, (7, True)),
    # before the record: the tokens' BOS, the features' bos_each_window (or their config's)
    ({"bos_each_window": True}, {"bos_id": 3}, (3, True)),
    ({"config": {"bos_each_window": True}}, {"bos_id": 3}, (3, True)),
    ({}, {"bos_id": 3, "bos_each_window": True}, (3, True)),
    ({"bos_each_window": False}, {"bos_id": 3, "bos_each_window": True}, (3, False)),
    ({}, {"bos_id": 3}, (3, False)),
])
def test_the_rule_is_the_record_or_what_the_pipeline_derived(features, tokens, expected):
    rule = BosRule.recorded(features, tokens)
    assert (rule.id, rule.each_window) == expected
    assert BosRule.recorded({"bos": rule.record()}) == rule
    assert rule.stream(np.array([5, 6])).tolist() == [expected[0], 5, 6]


def test_a_stream_without_bos_is_found_after_left_padding():
    rule = BosRule(0)
    assert rule.first_mismatch(np.array([[0, 5], [0, 6]])) is None
    assert rule.first_mismatch(np.array([[0, 5], [5, 6]])) == 1
    assert rule.first_mismatch(np.array([[9, 9, 0, 5], [0, 5, 6, 7]]), pad_id=9) is None
    assert rule.first_mismatch(np.array([[9, 9, 4, 5]]), pad_id=9) == 0


# -- a tiny Hugging Face GPT-2 work directory ------------------------------------------------

@pytest.fixture(scope="module")
def lm(gpt2_work):
    return gnnlm.load(gpt2_work.work)


@pytest.fixture(scope="module")
def hf(gpt2_work):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(gpt2_work.folder).eval(),
            AutoTokenizer.from_pretrained(gpt2_work.folder))


@pytest.mark.integration
def test_the_features_record_the_rule_and_every_route_reads_it(lm, gpt2_work):
    tokens = read_manifest(gpt2_work.work / "tokens")
    for split in ("train", "valid", "test"):
        manifest = read_manifest(gpt2_work.work / "features" / split)
        assert manifest["bos"] == {"id": tokens["bos_id"], "opens_stream": True,
                                   "each_window": False}
    assert lm.bos == BosRule(tokens["bos_id"], False) and lm.bos_id == tokens["bos_id"]
    # the report's per-token test scores are what score gives the test split under that rule
    n = read_manifest(gpt2_work.work / "features" / "test")["n"]
    ids = np.asarray(open_array(gpt2_work.work / "tokens", "test")[:n], dtype=np.int64)
    stored = np.load(gpt2_work.work / "reports" / "gpt2" / "test_logprobs.npz")
    scores = lm.score(ids, ["base", "knn"])
    for row in ("base", "knn"):
        np.testing.assert_allclose(scores[row].logprobs, stored[row], atol=1e-5, rtol=0)


@pytest.mark.integration
def test_hugging_face_reads_what_gnnlm_reads_from_prompt_ids(lm, hf):
    model, tokenizer = hf
    plain = tokenizer(PROMPT).input_ids
    assert plain[0] != lm.bos_id                   # GPT-2's tokenizer adds no BOS
    ids = lm.prompt_ids(PROMPT)
    assert ids == [lm.bos_id, *lm.encode(PROMPT, prompt=True)] and ids[1:] == plain
    with torch.no_grad():
        own = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        without = torch.log_softmax(model(torch.tensor([plain])).logits[0, -1].float(), -1)
    ours = lm.next_token_logprobs(PROMPT, "base")
    torch.testing.assert_close(ours, own, atol=1e-5, rtol=0)
    assert float((ours - without).abs().max()) > 0.05   # the rule is what makes them equal
    # score's first token is read after BOS too
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([[lm.bos_id]])).logits[0, -1].float(), -1)
    score = lm.score(PROMPT, "base")
    assert score.logprobs[0] == pytest.approx(float(first[score.ids[0]]), abs=1e-5)


@pytest.mark.integration
def test_ids_are_the_text_s_tokens_in_every_route(lm):
    """Ids are read after BOS whatever they open with (BOS itself too), by score and by the
    prompt routes alike: the distribution after a prefix is the score of the token after it."""
    ids = lm.prompt_ids(PROMPT)
    assert lm.next_token_logprobs(ids[1:], "knn").equal(lm.next_token_logprobs(PROMPT, "knn"))
    assert lm.generate(np.asarray(ids[1:]), "knn", 4, greedy=True).ids.tolist() == \
        lm.generate(PROMPT, "knn", 4, greedy=True).ids.tolist()
    for row in ("base", "knn"):
        scored = lm.score(ids, row).logprobs[-1]                 # BOS, then BOS as a token
        assert float(lm.next_token_logprobs(ids[:-1], row)[ids[-1]]) == pytest.approx(
            float(scored), abs=1e-5)


@pytest.mark.integration
def test_the_processor_refuses_input_ids_without_bos_and_matches_gnnlm_with_it(lm, hf,
                                                                               gpt2_work):
    from transformers import LogitsProcessorList

    model, tokenizer = hf
    knn = gnnlm.KNNLogitsProcessor(lm, model)
    try:
        plain = torch.tensor([tokenizer(PROMPT).input_ids])
        with pytest.raises(ValueError) as err:
            model.generate(plain, logits_processor=LogitsProcessorList([knn]), max_new_tokens=2,
                           do_sample=False, pad_token_id=lm.bos_id)
        message = str(err.value)
        assert message == (f"input_ids row 0 opens with token {int(plain[0, 0])}, but the "
                           f"streams of {gpt2_work.work} open with BOS {lm.bos_id} "
                           f"('<|endoftext|>'), as its features were built: give input_ids = "
                           f"lm.prompt_ids(prompt), or [{lm.bos_id}] + "
                           f"tokenizer(prompt).input_ids for a tokenizer that adds no BOS.")
        stream = torch.tensor([lm.prompt_ids(PROMPT)])
        with torch.no_grad():
            theirs = model.generate(stream, logits_processor=LogitsProcessorList([knn]),
                                    max_new_tokens=8, do_sample=False, pad_token_id=lm.bos_id,
                                    attention_mask=torch.ones_like(stream))
        assert theirs[0, stream.shape[1]:].tolist() == lm.generate(
            PROMPT, "knn", 8, greedy=True).ids.tolist()
    finally:
        knn.close()


@pytest.mark.integration
def test_gnnlm_score_reads_the_stream_the_api_reads(lm, hf, gpt2_work, capsys):
    """``gnnlm score`` of a text: the model's own log p of its tokens after BOS."""
    from gnnlm.inference.commands import score_main

    model, _ = hf
    summary = score_main([str(gpt2_work.work), "--text", PROMPT, "--rows", "base", "--json"])
    capsys.readouterr()
    ids = lm.encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.from_numpy(lm.bos.stream(ids))[None]).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(ids)[:, None])
    assert summary["tokens"] == len(ids)
    assert summary["rows"]["base"]["ppl"] == pytest.approx(float((-logprobs.mean()).exp()),
                                                          rel=1e-5)
