"""``KNNLogitsProcessor`` keeps Hugging Face's rules, through real ``model.generate()`` on a tiny
GPT-2 work directory: each of Hugging Face's own processors (bad words, suppressed tokens,
min_new_tokens' EOS ban, forced BOS and EOS, no-repeat n-grams, repetition penalty, sequence
bias) acts on kNN-LM's mixture, step by step exactly as that processor applied to gnnlm's kNN-LM
distribution of the same prefix, so a banned word a neighbour holds stays banned; assisted and
prompt-lookup decoding are refused in one line; and a GGUF work directory (SmolLM2) serves the
model the README loads with ``from_pretrained(folder, gguf_file=...)``."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessorList
from transformers import generation as hf

import gnnlm
from gnnlm.inference.decoding import Decoder
from gnnlm.inference.hf import ONE_QUERY, same_weights

pytestmark = pytest.mark.integration

PROMPT = "The game was released in Japan"
LAM, T = 0.25, 0.05   # kNN-LM weighs enough that its neighbours' words matter


@pytest.fixture(scope="module")
def lm(gpt2_work):
    return gnnlm.load(gpt2_work.work)


@pytest.fixture(scope="module")
def model(gpt2_work):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gpt2_work.folder).eval()


@pytest.fixture
def knn(lm, model):
    processor = gnnlm.KNNLogitsProcessor(lm, model, lam=LAM, knn_temperature=T)
    yield processor
    processor.close()


@pytest.fixture(scope="module")
def held(lm) -> int:
    """The word the prompt's neighbours add most probability to."""
    mixed = lm.next_token_logprobs(PROMPT, "knn", lam=LAM, knn_temperature=T).exp()
    base = lm.next_token_logprobs(PROMPT, "base").exp()
    word = int((mixed - (1 - LAM) * base).argmax())
    assert float(mixed[word] - (1 - LAM) * base[word]) > 0.01
    return word


def options(word: int, prompt_length: int, steps: int) -> dict:
    """Each option: ``(generate's arguments, the input's length, Hugging Face's processor)``."""
    eos = 0   # the tiny GPT-2's <|endoftext|>
    return {
        "bad_words_ids": ({"bad_words_ids": [[word]]}, prompt_length,
                          hf.NoBadWordsLogitsProcessor([[word]], eos)),
        "suppress_tokens": ({"suppress_tokens": [word]}, prompt_length,
                            hf.SuppressTokensLogitsProcessor([word])),
        "min_new_tokens": ({"min_new_tokens": steps, "eos_token_id": word}, prompt_length,
                           hf.MinNewTokensLengthLogitsProcessor(prompt_length, steps, word)),
        "forced_bos_token_id": ({"forced_bos_token_id": word}, 1,   # BOS alone: one token
                                hf.ForcedBOSTokenLogitsProcessor(word)),
        "forced_eos_token_id": ({"forced_eos_token_id": word}, prompt_length,
                                hf.ForcedEOSTokenLogitsProcessor(prompt_length + steps, word)),
        "no_repeat_ngram_size": ({"no_repeat_ngram_size": 1}, prompt_length,
                                 hf.NoRepeatNGramLogitsProcessor(1)),
        "repetition_penalty": ({"repetition_penalty": 1.5}, prompt_length,
                               hf.RepetitionPenaltyLogitsProcessor(1.5)),
        "sequence_bias": ({"sequence_bias": [[[word], -4.0]]}, prompt_length,
                          hf.SequenceBiasLogitsProcessor([[[word], -4.0]])),
    }


def after(lm, stream: torch.Tensor, row: str) -> torch.Tensor:
    """gnnlm's log p [1, V] of the token after ``stream`` [1, L] (BOS first; BOS alone too),
    as ``lm.next_token_logprobs`` computes it, with this file's λ and T for kNN-LM."""
    served = lm.served.row(row)
    settings = lm.settings(served, **({"lam": LAM, "knn_temperature": T} if row == "knn" else {}))
    return Decoder(lm, served, settings, incremental=False).start(stream[:, 1:])


MASKS = {"bad_words_ids", "suppress_tokens", "min_new_tokens", "forced_bos_token_id",
         "forced_eos_token_id", "no_repeat_ngram_size"}


@pytest.mark.parametrize("name", ["bad_words_ids", "suppress_tokens", "min_new_tokens",
                                  "forced_bos_token_id", "forced_eos_token_id",
                                  "no_repeat_ngram_size", "repetition_penalty",
                                  "sequence_bias"])
def test_hugging_face_s_processors_act_on_the_mixture(name, lm, model, knn, held):
    """Greedy ``generate`` with the option: at every step the scores are Hugging Face's
    processor applied to gnnlm's kNN-LM log p after the prefix, and the
    token chosen is their argmax; a banned token a neighbour holds gets −inf."""
    steps = 4
    stream = torch.tensor([lm.prompt_ids(PROMPT)])
    arguments, length, processor = options(held, stream.shape[1], steps)[name]
    stream = stream[:, :length]
    with torch.no_grad():
        out = model.generate(stream, logits_processor=LogitsProcessorList([knn]),
                             max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=lm.bos_id,
                             attention_mask=torch.ones_like(stream), **arguments)
    held_and_banned = changed = 0
    for step, scores in enumerate(out.scores):
        prefix = out.sequences[:, :length + step]
        mixed, base = after(lm, prefix, "knn"), after(lm, prefix, "base")
        expected = processor(prefix, mixed.clone())
        banned = torch.isneginf(expected)
        assert torch.equal(torch.isneginf(scores), banned), (name, step)
        torch.testing.assert_close(scores[~banned], expected[~banned], atol=1e-4, rtol=0)
        assert int(out.sequences[0, length + step]) == int(expected.argmax())
        neighbours = mixed > math.log(1 - LAM) + base + 1e-3   # words a neighbour holds
        held_and_banned += int((banned & neighbours).sum())
        changed += int((expected[~banned] != mixed[~banned]).sum())
    if name in MASKS:
        assert held_and_banned > 0, name      # the case that came back before
    else:
        assert changed > 0, name              # the penalty moved the mixture


def test_a_token_banned_before_it_stays_banned(lm, model, knn, held):
    stream = torch.tensor([lm.prompt_ids(PROMPT)])
    with torch.no_grad():
        logits = model(stream).logits[:, -1].float()
    logits[0, held] = -math.inf
    out = knn(stream, logits)
    assert math.isinf(float(out[0, held])) and float(out[0, held]) < 0
    assert float(out.exp().sum()) < 1.0 and torch.isfinite(out).sum() == out.shape[1] - 1


def test_it_runs_first_while_open_and_leaves_generate_as_it_was(lm, model):
    knn = gnnlm.KNNLogitsProcessor(lm, model)
    assert "_get_logits_processor" in model.__dict__
    built = model._get_logits_processor(
        model.generation_config.__class__(repetition_penalty=1.2, no_repeat_ngram_size=2),
        input_ids_seq_length=4, logits_processor=LogitsProcessorList([knn]))
    assert built[0] is knn and len(built) == 3
    knn.close()
    assert "_get_logits_processor" not in model.__dict__
    stream = torch.tensor([lm.prompt_ids(PROMPT)])
    with torch.no_grad():
        plain = model.generate(stream, max_new_tokens=5, do_sample=False,
                               pad_token_id=lm.bos_id, attention_mask=torch.ones_like(stream))
    assert plain[0, stream.shape[1]:].tolist() == lm.generate(PROMPT, "base", 5,
                                                              greedy=True).ids.tolist()


@pytest.mark.parametrize("how", ["prompt_lookup_num_tokens", "assistant_model"])
def test_decoding_several_positions_per_pass_is_refused_in_one_line(how, lm, model, knn,
                                                                    gpt2_work):
    from transformers import AutoModelForCausalLM

    repeated = " . ".join([PROMPT] * 3)   # prompt lookup finds its n-grams
    stream = torch.tensor([lm.prompt_ids(repeated)])
    extra = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup_num_tokens" else \
        {"assistant_model": AutoModelForCausalLM.from_pretrained(gpt2_work.folder).eval()}
    with pytest.raises(ValueError) as err, torch.no_grad():
        model.generate(stream, logits_processor=LogitsProcessorList([knn]), max_new_tokens=8,
                       do_sample=False, pad_token_id=lm.bos_id,
                       attention_mask=torch.ones_like(stream), **extra)
    assert str(err.value) == ONE_QUERY and "\n" not in ONE_QUERY


def test_same_weights_compares_names_dtypes_and_values():
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert not same_weights(first, second)
    second.load_state_dict(first.state_dict())
    assert same_weights(first, second)
    assert not same_weights(first, torch.nn.Linear(3, 2).to(torch.bfloat16))


# -- SmolLM2 from its GGUF file ---------------------------------------------------------------

def test_a_gguf_work_directory_serves_the_model_the_readme_loads(smollm2_work):
    from transformers import AutoModelForCausalLM

    from tests.inference.conftest import SMOLLM2

    lm = gnnlm.load(smollm2_work)
    ours = lm.generate(PROMPT, "knn", 4, greedy=True).ids.tolist()
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent),
                                                 gguf_file=SMOLLM2.name).eval()
    knn = gnnlm.KNNLogitsProcessor(lm, model)
    stream = torch.tensor([lm.prompt_ids(PROMPT)])
    with torch.no_grad():
        theirs = model.generate(stream, logits_processor=LogitsProcessorList([knn]),
                                max_new_tokens=4, do_sample=False, pad_token_id=lm.bos_id,
                                attention_mask=torch.ones_like(stream))
    knn.close()
    assert theirs[0, stream.shape[1]:].tolist() == ours
    with torch.no_grad():   # other weights: refused, saying how to load the file
        model.model.norm.weight[0] += 1.0
    with pytest.raises(ValueError) as err:
        gnnlm.KNNLogitsProcessor(lm, model)
    assert str(err.value) == (
        f"The model given does not hold the weights of {SMOLLM2} in float32, the base LM of "
        f"{smollm2_work}: load it with AutoModelForCausalLM.from_pretrained("
        f"{str(SMOLLM2.parent)!r}, gguf_file={SMOLLM2.name!r}, dtype=torch.float32).")
