"""Hugging Face base LMs of the families people use, on tiny random-weight models built locally
(tests/families.py): features at the papers' definitions, the model's own logits (bias, logit
scale and soft-cap included, in the heads that reuse the output embedding too), each family's
BOS, the context of ALiBi models, loading precision and placement, and the pipeline end to end
on a WikiText-2 slice for the families marked ``pipeline``, then generation from its work
directory: incremental decoding through the model's own cache equals each prefix from scratch,
and Hugging Face ``generate()`` with ``KNNLogitsProcessor`` picks the tokens gnnlm's kNN-LM
picks."""
from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from transformers.utils import generic as transformers_outputs

from gnnlm.models import load_base_lm
from gnnlm.models.base import LogitTransform
from gnnlm.models.encode import sliding_windows
from gnnlm.models.hf import KEY_PATHS, LOGIT_SCALES, HFCausalLM, find_module
from gnnlm.text.tokens import HFTokenizer
from tests.conftest import wikitext_slice
from tests.families import FAMILIES, build_family, save_family, train_bpe


@pytest.fixture(scope="module")
def bpe(wikitext_root):
    """A 512-token BPE trained on the first 300k characters of WikiText-2's train split."""
    return train_bpe((wikitext_root / "wikitext-2" / "train.txt").read_text()[:300_000])


def ffn_input(model, family, ids) -> torch.Tensor:
    """The last FFN's input, captured at the norm that feeds it (not at the adapter's path); in
    a post-norm block whose FFN reads the residual stream (OLMo 2), the block's input plus the
    attention output that norm returns."""
    captured = {}

    def block_input(module, args, kwargs) -> None:
        captured["block"] = args[0] if args else kwargs["hidden_states"]

    handles = [find_module(model, family.ffn_input, "test").register_forward_hook(
        lambda module, args, out: captured.setdefault("x", out))]
    if family.ffn_residual:
        block = find_module(model, family.ffn_input.rpartition(".")[0], "test")
        handles.append(block.register_forward_pre_hook(block_input, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    x = captured["x"] + captured["block"] if family.ffn_residual else captured["x"]
    return x.reshape(*ids.shape, -1)   # OPT flattens tokens before its FFN


@pytest.mark.parametrize("name", list(FAMILIES))
def test_features_are_the_papers_and_logits_the_model_s_own(name, bpe, monkeypatch):
    family = FAMILIES[name]
    model, _ = build_family(family, bpe)
    lm = HFCausalLM(model, name)
    assert lm.keys == KEY_PATHS[model.config.model_type]
    ids = torch.randint(0, bpe.get_vocab_size(), (2, 24))
    logged = []    # what transformers' outputs log when read by a name they deprecate
    monkeypatch.setattr(transformers_outputs.logger, "warning_once",
                        lambda *args, **kwargs: logged.append(args))
    with torch.no_grad():
        feats = lm(ids)
        _, cache = lm.step(ids[:, :4])
        assert cache is not None
        assert not logged
        clone = pickle.loads(pickle.dumps(lm))                  # spawned encoding processes
        torch.testing.assert_close(clone(ids).att, feats.att, rtol=0, atol=0)
        out = model(ids, output_hidden_states=True)
        logits = lm.logits(feats.final)
    # final: the model's own last hidden state; through W (and b, and the soft-cap) its logits
    torch.testing.assert_close(feats.final, out.hidden_states[-1], rtol=0, atol=0)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    # att: the input of the last FFN, as the norm that feeds it returns it
    torch.testing.assert_close(feats.att, ffn_input(model, family, ids), rtol=0, atol=0)
    assert not torch.allclose(feats.att, feats.final, atol=1e-3)
    assert model.forward.__func__ is type(model).forward        # hooks only: forward untouched
    assert lm.vocab_size == bpe.get_vocab_size() + family.pad_vocab


def test_bias_and_soft_capping_are_part_of_the_logits(bpe):
    phi = HFCausalLM(build_family(FAMILIES["phi"], bpe)[0], "phi")
    assert phi.output_embedding()[1] is not None                # Phi's lm_head has a bias
    model = build_family(FAMILIES["gemma2"], bpe)[0]
    model.config.final_logit_softcapping = 0.1      # random logits are small: cap them harder
    gemma2 = HFCausalLM(model, "gemma2")
    assert gemma2.logit_transform == LogitTransform(softcap=0.1)
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        final = gemma2(ids).final
        uncapped = torch.nn.functional.linear(final, gemma2.output_embedding()[0])
        reference = gemma2.model(ids).logits
    assert reference.abs().max() < 0.1 < uncapped.abs().max()
    torch.testing.assert_close(gemma2.logits(final), reference, rtol=1e-5, atol=1e-5)
    # heads that start as the base LM (SPALM's gate at g = 1) apply the same cap after W
    from gnnlm.spalm.gate import SpalmGate

    h = final[0]
    gated, _ = SpalmGate(32)(h, torch.full((16, 4), -1), *gemma2.output_embedding(),
                             force_gate=1.0, logit_transform=gemma2.logit_transform)
    torch.testing.assert_close(gated, reference[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, scale", [("cohere", 0.0625), ("granite", 1 / 8.0)])
def test_scaled_logits_are_the_model_s_own_in_every_head(name, scale, bpe, monkeypatch):
    """Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling: the
    load check, the base LM's logits, and the heads that start as the base LM (SPALM's gate at
    g = 1, GNN-LM's stack at its identity start), with W and the transform as a datastore
    records them, all give the model's logits."""
    from gnnlm.gnn.graph import GraphConfig, build_graph
    from gnnlm.lit.gnn import GNNLM
    from gnnlm.spalm.gate import SpalmGate

    model = build_family(FAMILIES[name], bpe)[0]
    lm = HFCausalLM(model, name)
    assert lm.logit_transform == LogitTransform(scale=scale)
    assert lm.identity()["logit_scale"] == scale
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        final = lm(ids).final[0]
        unscaled = torch.nn.functional.linear(final, lm.output_embedding()[0])
        reference = model(ids).logits[0]
    assert (unscaled - reference).abs().max() > 0.05           # the scale matters here
    torch.testing.assert_close(lm.logits(final), reference, rtol=1e-5, atol=1e-6)
    recorded = LogitTransform.of(lm.identity())                # as the heads read it back
    weight, bias = lm.output_embedding()
    gated, _ = SpalmGate(32)(final, torch.full((16, 4), -1), weight, bias, force_gate=1.0,
                             logit_transform=recorded)
    torch.testing.assert_close(gated, reference, rtol=1e-5, atol=1e-6)
    graph = build_graph(np.arange(100, 116), np.full((16, 4), -1), 200, GraphConfig(k=4))
    graph["ctx"].x = final
    graph["nbr"].x = torch.zeros(graph["nbr"].num_nodes, 32)
    gnn = GNNLM(vocab_size=lm.vocab_size, feature_dim=32, graph_layout=GraphConfig(k=4)).eval()
    gnn.attach_output_embedding(weight.detach(), bias, recorded)
    with torch.no_grad():
        torch.testing.assert_close(gnn(graph), reference, rtol=1e-5, atol=1e-6)
    # a family whose scale gnnlm does not know: the load check names the factor, not the path
    monkeypatch.delitem(LOGIT_SCALES, name)
    with pytest.raises(ValueError) as err:
        HFCausalLM(model, name)
    assert str(err.value) == (
        f"The model's logits are those of base_lm.keys.final = 'model.norm:output' times "
        f"{scale:.4g}: model_type {name!r} scales its logits past the output embedding, which "
        f"gnnlm.models.hf.LOGIT_SCALES does not list; add its config field there.")


def test_alibi_models_take_their_context_from_their_config_or_none(bpe, corpus_slice, tmp_path):
    """MPT's ALiBi reads up to max_seq_len; Bloom's has no length: features.context sets its
    windows, and without it the config is refused at load in one line."""
    from gnnlm.pipeline.config import load_config

    assert HFCausalLM(build_family(FAMILIES["mpt"], bpe)[0], "mpt").context_length == 256
    assert HFCausalLM(build_family(FAMILIES["bloom"], bpe)[0], "bloom").context_length is None
    folders = {name: save_family(FAMILIES[name], bpe, tmp_path / name) for name in ("bloom",
                                                                                     "mpt")}
    args = ["-c", "configs/tests/hf_family.yaml", f"--workdir={tmp_path / 'work'}",
            f"--corpus.path={corpus_slice}"]
    with pytest.raises(ValueError) as err:
        load_config([*args, f"--base_lm.ckpt=hf:{folders['bloom']}", "--features.context=null",
                     "--features.stride=null"])
    assert str(err.value) == (
        f"features.context is not set and base_lm.ckpt hf:{folders['bloom']} has no context "
        f"length of its own (ALiBi positions, any length): set features.context, the tokens "
        f"each window reads (e.g. 1024).")
    cfg = load_config([*args, f"--base_lm.ckpt=hf:{folders['bloom']}",
                       "--features.context=4096", "--features.stride=2048"])
    # and again when the model is loaded (a Hub name's config may be known only then)
    from dataclasses import replace

    from gnnlm.pipeline.stages import stage_base_lm, stage_features
    from gnnlm.workdir.layout import Workdir

    workdir = Workdir(cfg.workdir)
    model, store, _, location = stage_base_lm(cfg, workdir)
    with pytest.raises(ValueError) as err:
        stage_features(replace(cfg, features=replace(cfg.features, context=None, stride=None)),
                       model, store, workdir, location)
    assert str(err.value) == (
        "features.context is not set and the base LM hf:bloom has no context length of its own "
        "(ALiBi positions, any length): set features.context, the tokens each window reads "
        "(e.g. 1024).")
    with pytest.raises(ValueError, match=r"^features.context = 512 exceeds the context of "
                                         r"base_lm.ckpt .*, 256 tokens"):
        load_config([*args, f"--base_lm.ckpt=hf:{folders['mpt']}", "--features.context=512"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_tokenizer_opens_windows_as_its_family_was_trained(name, bpe, tmp_path):
    family = FAMILIES[name]
    folder = save_family(family, bpe, tmp_path / name)
    tokenizer = HFTokenizer.from_path(str(folder))
    assert tokenizer.bos_each_window == (family.bos is not None)
    assert tokenizer.bos_id == bpe.token_to_id(family.bos or family.eos)


def test_keys_by_module_path(bpe):
    model, _ = build_family(FAMILIES["llama"], bpe)
    ids = torch.randint(0, 512, (1, 12))
    default = HFCausalLM(model, "llama")(ids)
    first = HFCausalLM(model, "llama", keys={"att": "model.layers.0.mlp:input",
                                             "final": "lm_head:input"})
    feats = first(ids)
    assert first._runner is model                      # lm_head is outside the transformer
    captured = {}
    model.model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda module, args, out: captured.setdefault("x", out))
    model(ids)
    torch.testing.assert_close(feats.att, captured["x"], rtol=0, atol=0)
    torch.testing.assert_close(feats.final, default.final, rtol=0, atol=0)


@pytest.mark.parametrize("keys, message", [
    ({"att": "model.layerz.-1.mlp:input"},
     "base_lm.keys.att = 'model.layerz.-1.mlp:input': model has no 'layerz' in "
     "LlamaForCausalLM; name a module of `print(model)`."),
    ({"att": "model.layers.-1.mlp"},
     "base_lm.keys.att must be '<module path>:input' or '<module path>:output' (e.g. "
     "model.layers.-1.mlp:input), got 'model.layers.-1.mlp'."),
    ({"final": "model.layers.-1:output"},   # before the final norm: not what W reads
     "base_lm.keys.final = 'model.layers.-1:output' does not reproduce the model's logits"),
    ({"ffn": "model.norm:output"}, "base_lm.keys names ['ffn']: the keys are ['final', 'att']."),
])
def test_a_wrong_module_path_is_one_line_naming_the_field(keys, message, bpe):
    model, _ = build_family(FAMILIES["llama"], bpe)
    with pytest.raises(ValueError) as err:
        HFCausalLM(model, "llama", keys=keys)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_unknown_family_asks_for_the_path(bpe):
    model, _ = build_family(FAMILIES["llama"], bpe)
    model.config.model_type = "mystery"
    with pytest.raises(ValueError) as err:
        HFCausalLM(model, "mystery")
    assert str(err.value) == (
        "LlamaForCausalLM (model_type 'mystery') has no default feature paths: set "
        "base_lm.keys.final (e.g. 'model.norm:output'): the module path its final feature is "
        "read at.")
    assert HFCausalLM(model, "mystery", keys=KEY_PATHS["llama"]).keys == KEY_PATHS["llama"]


def test_bfloat16_weights_give_float32_log_probabilities(bpe, tmp_path):
    folder = save_family(FAMILIES["llama"], bpe, tmp_path / "llama")
    full = load_base_lm(f"hf:{folder}")
    half = load_base_lm(f"hf:{folder}", {"dtype": "bfloat16"})
    assert half.model.dtype == torch.bfloat16 and half.identity()["dtype"] == "bfloat16"
    assert half.fingerprint() != full.fingerprint()           # other weights, other datastore
    assert half.model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        feats = half(ids)
        logits = half.logits(feats.final)
        reference = torch.log_softmax(half.model(ids).logits.float(), -1)
        exact = torch.log_softmax(full.logits(full(ids).final), -1)
    assert feats.final.dtype == torch.bfloat16 and logits.dtype == torch.float32
    ours = torch.log_softmax(logits, -1)
    assert (ours - reference).abs().max() < 0.02      # the model's bf16 logits, rounded
    assert (ours - exact).abs().max() < 0.1           # and close to the float32 model


def test_the_knn_processor_mixes_the_work_directory_s_float32_p_lm_for_a_bf16_model(bpe):
    """``KNNLogitsProcessor`` of a bf16 model mixes p_LM as the work directory's rows compute it
    (float32 logits of ``final``), not ``generate()``'s scores rounded to bf16: with neighbours
    holding no word, its output is exactly log((1 − λ)·p_LM)."""
    import types

    from gnnlm.inference.hf import KNNLogitsProcessor

    model, _ = build_family(FAMILIES["llama"], bpe)
    with torch.no_grad():
        model.lm_head.weight.mul_(60)    # logits of an LLM's size (|logit| up to ~30)
    model = model.to(torch.bfloat16)
    knn = object.__new__(KNNLogitsProcessor)   # a lookup whose neighbours hold no word
    knn.adapter = HFCausalLM(model, "llama", check=False)
    knn.key, knn.scores, knn.check_prompt = "att", "faiss", lambda ids: None
    knn.lookup = types.SimpleNamespace(
        search=lambda q: (np.full((len(q), 1), -np.inf, np.float32), np.full((len(q), 1), -1)),
        knn_sims=lambda q, sims, ids, how: sims, values=lambda ids: np.full(ids.shape, -1))
    knn.settings = types.SimpleNamespace(knn=lambda: (1, 1.0), weight=0.5)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        p_lm = torch.log_softmax(knn.adapter.logits(knn.adapter(ids).final[:, -1]), -1)
        scores = model(ids).logits[:, -1].float()     # what generate() hands the processor
        rounded = torch.log_softmax(scores, -1)
        assert (rounded - p_lm).abs().max() > 1e-2    # bf16 rounding shows at this size
        mixed = knn(ids, scores)
    torch.testing.assert_close(mixed, p_lm + math.log(0.5), atol=1e-5, rtol=0)


def test_device_map_places_the_model_once(bpe, tmp_path):
    folder = save_family(FAMILIES["gpt2"], bpe, tmp_path / "gpt2")
    placed = load_base_lm(f"hf:{folder}", {"device_map": "cpu"})
    plain = load_base_lm(f"hf:{folder}")
    assert placed.to("meta") is placed                        # stays where accelerate put it
    assert next(placed.parameters()).device.type == "cpu"
    ids = torch.randint(0, 512, (1, 16))
    torch.testing.assert_close(placed(ids).final, plain(ids).final)


def test_options_are_for_hugging_face_models_only(tmp_path):
    from tests.fakes import save_lm_checkpoint

    ckpt, _ = save_lm_checkpoint(tmp_path / "lm.ckpt", vocab_size=7, context_length=8)
    with pytest.raises(ValueError, match=r"^base_lm.dtype applies to Hugging Face models"):
        load_base_lm(str(ckpt), {"dtype": "bfloat16"})


# -- the pipeline, end to end, on a WikiText-2 slice ------------------------------------------

@pytest.fixture(scope="module")
def corpus_slice(wikitext_root, tmp_path_factory):
    """The first 160k characters of train and 40k of valid and test, cut at line ends."""
    return wikitext_slice(wikitext_root, tmp_path_factory.mktemp("wt2-slice"),
                          {"train": 160_000, "valid": 40_000, "test": 40_000})


# GNN-LM on one family with BOS in every window and soft-capped logits, and one without either
GNN_FAMILIES = ("gpt2", "gemma2")


@pytest.mark.integration
@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.pipeline])
def test_the_pipeline_runs_end_to_end_on_each_family(name, bpe, corpus_slice, tmp_path):
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import run
    from gnnlm.workdir.layout import Workdir
    from gnnlm.workdir.manifests import is_complete

    family = FAMILIES[name]
    folder = save_family(family, bpe, tmp_path / name)
    args = ["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
            f"--corpus.path={corpus_slice}", f"--workdir={tmp_path / 'work'}", f"--name={name}"]
    if name not in GNN_FAMILIES:
        args.append("--gnn.config=null")
    cfg = load_config(args)
    run(cfg)
    work = tmp_path / "work"
    # kNN-LM reads valid and test neighbours only; GNN-LM's graphs read the train ones
    train_neighbours = Workdir(cfg.root).neighbors(cfg.knn.primary, cfg.knn.metric, "train")
    assert is_complete(train_neighbours) == (name in GNN_FAMILIES)
    results = json.loads((work / "reports" / name / "results.json").read_text())
    ppl = results["ppl"]
    # random weights: the base LM is near uniform (ppl ~ 515 over 512 tokens); retrieving the
    # next tokens of similar contexts of real text must do better (measured: 2.7x lower for
    # GPT-2, 1.1x for Gemma 2, the least of those measured)
    assert ppl["knn"] < 0.95 * ppl["base"] and ppl["knn[att]"] < 0.95 * ppl["base"]
    if name in GNN_FAMILIES:
        assert ppl["gnn"] < 0.95 * ppl["base"] and ppl["gnn+knn"] < ppl["knn"]
    assert results["base_lm"]["keys"] == KEY_PATHS[name]
    report = (work / "reports" / name / "results.md").read_text()
    assert f"Base LM: hf:{name} (weights {results['base_lm']['fingerprint']}" in report
    assert f"float32 weights; final at {KEY_PATHS[name]['final']}" in report
    scale = results["base_lm"].get("logit_scale")
    assert (scale is not None) == (name in LOGIT_SCALES)
    if scale is not None:
        assert f"; logits scaled by {scale:g})" in report

    manifest = json.loads((work / "features" / "valid" / "manifest.json").read_text())
    assert manifest["bos_each_window"] == (family.bos is not None)
    assert manifest["base_lm"]["keys"] == KEY_PATHS[name]
    assert manifest["vocab_size"] == bpe.get_vocab_size() + family.pad_vocab
    assert_log_probabilities_are_the_model_s_own(work, manifest, folder, family)
    assert_generation_is_gnnlm_s_from_scratch_and_hugging_face_s(work, folder, name)


def assert_generation_is_gnnlm_s_from_scratch_and_hugging_face_s(work, folder, name):
    """Past the window of 64 tokens (it slides, BOS first where the family reads one), each
    step of incremental decoding (the model's own key/value cache) against the prefix from
    scratch, for kNN-LM and GNN-LM; then greedy ``model.generate`` with the kNN processor, and
    without it, against ``lm.generate`` of the knn and base rows."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    import gnnlm

    lm = gnnlm.load(work)
    prompt = lm.encode(" ".join(["The game was released in Japan ."] * 9), prompt=True)[:56]
    for row in ("knn", "gnn+knn") if name in GNN_FAMILIES else ("knn",):
        out = lm.generate(prompt, row, 16, greedy=True, keep_distributions=True)
        for step in (0, 7, 15):
            scratch = lm.next_token_logprobs(np.concatenate([prompt, out.ids[:step]]), row)
            torch.testing.assert_close(out.distributions[step], scratch, atol=1e-5, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    knn = gnnlm.KNNLogitsProcessor.from_workdir(work, model)
    short = prompt[:12]
    stream = torch.tensor([[lm.bos_id, *short]])
    # every input token is read (the BOS too, which generate would take for padding)
    settings = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": lm.bos_id,
                "attention_mask": torch.ones_like(stream)}
    with torch.no_grad():
        theirs = model.generate(stream, logits_processor=LogitsProcessorList([knn]), **settings)
        assert theirs[0, stream.shape[1]:].tolist() == lm.generate(
            short, "knn", 10, greedy=True).ids.tolist()
        knn.close()
        plain = model.generate(stream, **settings)
    assert plain[0, stream.shape[1]:].tolist() == lm.generate(short, "base", 10,
                                                              greedy=True).ids.tolist()


def assert_log_probabilities_are_the_model_s_own(work, manifest, folder, family):
    """The pipeline's ``log p_LM(target)`` against ``model(input_ids).logits`` on the same
    windows, built here from the tokens: [BOS] + the stream where the family opens with BOS."""
    from gnnlm.workdir.manifests import open_array, read_manifest

    tokens_manifest = read_manifest(work / "tokens")
    tokens = np.asarray(open_array(work / "tokens", "valid", tokens_manifest), dtype=np.int64)
    logprob = np.asarray(open_array(work / "features" / "valid", "lm_logprob", manifest))
    model = load_base_lm(f"hf:{folder}").model
    bos = tokens_manifest["bos_id"]
    stream = np.concatenate([[bos], tokens])
    C, S = manifest["config"]["context"], manifest["config"]["stride"]
    starts, score_from = sliding_windows(len(tokens), C, S)
    for w in (0, 1, len(starts) - 1):
        window = torch.from_numpy(stream[starts[w]:starts[w] + C].copy())
        if family.bos is not None:
            window[0] = bos
        with torch.no_grad():
            reference = torch.log_softmax(model(window[None]).logits[0].float(), -1)
        lo = score_from[w] - starts[w]
        positions = np.arange(score_from[w], starts[w] + C)
        expected = reference[lo:, :].gather(1, torch.from_numpy(tokens[positions])[:, None])
        np.testing.assert_allclose(logprob[positions], expected[:, 0].numpy(), atol=1e-4)


@pytest.mark.integration
def test_the_readme_llama_config_runs_its_first_stages(bpe, corpus_slice, tmp_path):
    """configs/hf/llama.yaml as written, with a tiny Llama in place of the real one (and its
    smaller context): the paths, dtype and tokenizer it names are what the stages use."""
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import stage_base_lm, stage_features
    from gnnlm.workdir.layout import Workdir

    as_written = load_config(["-c", "configs/hf/llama.yaml"])
    assert as_written.base_lm.keys == KEY_PATHS["llama"]
    folder = save_family(FAMILIES["llama"], bpe, tmp_path / "llama")
    cfg = load_config(["-c", "configs/hf/llama.yaml", f"--base_lm.ckpt=hf:{folder}",
                       f"--workdir={tmp_path / 'work'}", f"--corpus.path={corpus_slice}",
                       "--features.context=128", "--features.stride=64",
                       "--features.max_tokens={train: 4000, valid: 1000, test: 1000}"])
    workdir = Workdir(cfg.workdir)
    model, store, _, location = stage_base_lm(cfg, workdir)
    assert model.model.dtype == torch.bfloat16 and store.bos_each_window
    stage_features(cfg, model, store, workdir, location)
    manifest = workdir.features_manifest("valid")
    assert manifest["base_lm"]["dtype"] == "bfloat16" and manifest["bos_each_window"]
    assert manifest["protocol"].startswith("sliding window: context 128 (BOS first in every")


def test_a_corpus_tokenized_with_another_vocabulary_is_refused(bpe, corpus_slice, tmp_path):
    """Same size, other tokens: the ids would mean other words to the model."""
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import stage_base_lm
    from gnnlm.workdir.layout import Workdir

    folder = save_family(FAMILIES["gpt2"], bpe, tmp_path / "gpt2")
    other = train_bpe((corpus_slice / "valid.txt").read_text())        # 512 other tokens
    other.save(str(tmp_path / "other.json"))
    args = ["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
            f"--corpus.path={corpus_slice}", f"--workdir={tmp_path / 'work'}",
            f"--corpus.tokenizer.path={tmp_path / 'other.json'}"]
    with pytest.raises(ValueError) as err:
        stage_base_lm(load_config(args), Workdir(tmp_path / "work"))
    own = HFTokenizer.from_path(str(folder)).vocab_fingerprint()
    mine = HFTokenizer.from_path(str(tmp_path / "other.json")).vocab_fingerprint()
    assert str(err.value) == (
        f"The corpus was tokenized with another vocabulary (fingerprint {mine}, tokens in "
        f"{tmp_path / 'work' / 'tokens'}) than the base LM's own tokenizer in {folder} ({own}): "
        f"token ids would mean different words. Use tokenizer kind 'hf' without a path (the "
        f"model's own).")
    assert not (tmp_path / "work" / "tokens").exists()          # the corrected run starts clean


def test_a_context_beyond_the_model_s_is_refused(bpe, corpus_slice, tmp_path):
    from dataclasses import replace

    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import stage_base_lm, stage_features
    from gnnlm.workdir.layout import Workdir

    folder = save_family(FAMILIES["llama"], bpe, tmp_path / "llama")
    args = ["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
            f"--corpus.path={corpus_slice}", f"--workdir={tmp_path / 'work'}"]
    with pytest.raises(ValueError) as err:  # at load: the folder's config.json says 256
        load_config([*args, "--features.context=512", "--features.stride=256"])
    assert str(err.value) == (f"features.context = 512 exceeds the context of base_lm.ckpt "
                              f"hf:{folder}, 256 tokens: lower it to at most 256, or leave it "
                              f"unset for the model's own.")
    # and again when the model is loaded (a Hub name's shape may be known only then)
    cfg = load_config([*args, "--features.context=128", "--features.stride=64"])
    workdir = Workdir(cfg.workdir)
    model, store, _, location = stage_base_lm(cfg, workdir)
    with pytest.raises(ValueError) as err:
        stage_features(replace(cfg, features=replace(cfg.features, context=512, stride=256)),
                       model, store, workdir, location)
    assert str(err.value) == ("features.context = 512 exceeds the base LM's context (hf:llama: "
                              "256 positions): lower it.")
