"""Token ids mean the same to the base LM and the corpus, and the run names its corpus once.

A `gnnlm fit` checkpoint records the fingerprint of the vocabulary it was trained on; the
pipeline refuses tokens of another vocabulary, even of the same size, and leaves no tokens
behind. The pipeline's `corpus:` section is what a base LM trained by the pipeline is trained
on, and a base LM config or checkpoint naming another corpus or tokenizer stops the run at load.
"""
from __future__ import annotations

import json

import pytest
import torch

from gnnlm.pipeline.config import load_config
from gnnlm.pipeline.stages import stage_base_lm, stage_tokens
from gnnlm.text.tokens import HFTokenizer, TokenizerConfig, WordTokenizer, build_tokens
from gnnlm.workdir.checkpoints import load_checkpoint
from gnnlm.workdir.layout import Workdir
from tests.conftest import REPO
from tests.fakes import as_older_code_wrote_it, error_of, write_corpus
from tests.families import FAMILIES, save_family, train_bpe

CPU = ["-c", "configs/wikitext2/pipeline.yaml", "-c", "configs/wikitext2/pipeline_cpu.yaml",
       "--features.context=8", "--features.stride=4"]  # the tiny LM's context
TINY_LM = ["-c", "configs/trainer/cpu.yaml", "-c", "configs/examples/own_corpus/base_lm.yaml",
           "--trainer.max_steps=2", "--trainer.val_check_interval=2",
           "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
           "--model.init_args.n_layer=1", "--model.init_args.context_length=8",
           "--data.init_args.block_size=8", "--data.init_args.eval_context=8",
           "--data.init_args.eval_stride=4", "--data.init_args.batch_size=4"]
# two corpora whose word vocabularies, capped at 8 (6 words + <eos>, <unk>), have the same size
# and give the same ids to different words
CORPUS_A = "the cat sat on a mat\nthe cat ran to a dog\n" * 20
CORPUS_B = "one two three four five six\nseven one two three\n" * 20
CAPPED = TokenizerConfig(kind="word", max_vocab=8)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A `gnnlm fit` checkpoint of a tiny built-in LM trained on corpus A (words capped at 8),
    and corpus B beside it."""
    from gnnlm.lit.cli import lightning_main

    root = tmp_path_factory.mktemp("fitted")
    corpus_a = write_corpus(root / "a", train=CORPUS_A, valid=CORPUS_A, test=CORPUS_A)
    corpus_b = write_corpus(root / "b", train=CORPUS_B, valid=CORPUS_B, test=CORPUS_B)
    cli = lightning_main(["fit", *TINY_LM, "--data.init_args.corpus=corpus-a",
                          f"--data.init_args.corpus_path={corpus_a}",
                          "--data.init_args.tokenizer.max_vocab=8",
                          f"--data.init_args.workdir={root / 'work'}",
                          f"--trainer.default_root_dir={root / 'logs'}"])
    ckpt = root / "lm.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    return {"root": root, "ckpt": ckpt, "a": corpus_a, "b": corpus_b,
            "tokens": root / "work" / "tokens"}


def vocabulary_of(text: str) -> str:
    return WordTokenizer.fit(text, CAPPED.max_vocab).vocab_fingerprint()


def test_a_fit_checkpoint_records_the_vocabulary_it_was_trained_on(fitted):
    saved = load_checkpoint(fitted["ckpt"])["hyper_parameters"]["vocab_fingerprint"]
    tokens = json.loads((fitted["tokens"] / "manifest.json").read_text())
    assert saved == tokens["vocab_fingerprint"] == vocabulary_of(CORPUS_A)
    assert saved != vocabulary_of(CORPUS_B)


def without_saved_corpus(fitted, name: str, drop_fingerprint: bool = False) -> str:
    """The fitted checkpoint as if trained where its corpus is not found on this machine (its
    saved corpus path does not exist here), optionally without the vocabulary's fingerprint
    (a checkpoint written before it was recorded)."""
    from gnnlm.workdir.checkpoints import plain_classes

    with torch.serialization.safe_globals(plain_classes()):
        checkpoint = torch.load(fitted["ckpt"], weights_only=True)
    checkpoint["datamodule_hyper_parameters"]["corpus_path"] = "/elsewhere/corpus-a"
    if drop_fingerprint:
        del checkpoint["hyper_parameters"]["vocab_fingerprint"]
    path = fitted["root"] / name
    torch.save(checkpoint, path)
    return str(path)


def test_tokens_of_another_vocabulary_of_the_same_size_are_refused(fitted, tmp_path, capsys):
    ckpt = without_saved_corpus(fitted, "moved.ckpt")
    wd = Workdir(tmp_path / "w")
    args = ["pipeline", *CPU, f"--workdir={wd.root}", f"--base_lm.ckpt={ckpt}",
            f"--corpus.path={fitted['b']}", "--corpus.name=corpus-b",
            "--corpus.tokenizer.max_vocab=8"]
    assert error_of(args, capsys) == (
        f"gnnlm pipeline: error: The base LM {ckpt} was trained on another vocabulary "
        f"(fingerprint {vocabulary_of(CORPUS_A)}, recorded in the checkpoint) than the corpus "
        f"was tokenized with (fingerprint {vocabulary_of(CORPUS_B)}, tokens in {wd.tokens}): "
        f"token ids would mean different words. Read the corpus the base LM was trained on "
        f"with its tokenizer (leave out the pipeline's corpus section: the checkpoint names "
        f"them), or train a base LM on this corpus (base_lm.config).")
    assert not wd.tokens.exists()                                  # the corrected run starts

    # the corpus it was trained on, read the same way, has its vocabulary; and a checkpoint
    # written before the fingerprint was recorded has nothing to compare: only sizes are
    old = without_saved_corpus(fitted, "old.ckpt", drop_fingerprint=True)
    for name, check, corpus in (("same", ckpt, "a"), ("old", old, "b")):
        cfg = load_config([*CPU, f"--workdir={tmp_path / name}", f"--base_lm.ckpt={check}",
                           f"--corpus.path={fitted[corpus]}", f"--corpus.name=corpus-{corpus}",
                           "--corpus.tokenizer.max_vocab=8"])
        model, store, _, _ = stage_base_lm(cfg, Workdir(cfg.workdir))
        assert store.vocab_size == model.vocab_size == 8


def test_a_pipeline_corpus_other_than_the_checkpoint_s_is_refused_at_load(fitted, tmp_path,
                                                                         capsys):
    ckpt = str(fitted["ckpt"])
    base = ["pipeline", *CPU, f"--workdir={tmp_path / 'w'}", f"--base_lm.ckpt={ckpt}"]
    line = error_of([*base, f"--corpus.path={fitted['b']}", "--corpus.name=corpus-b",
                     "--corpus.tokenizer.max_vocab=8"], capsys)
    assert line == (
        f"gnnlm pipeline: error: The pipeline's corpus.name = 'corpus-b' (the command line), "
        f"corpus.path = '{fitted['b']}' (the command line) names other split files than the "
        f"corpus the base LM {ckpt} was trained on (corpus = 'corpus-a', corpus_path = "
        f"'{fitted['a']}', saved in the checkpoint): its word vocabulary was learned from that "
        f"corpus's train split, so token ids would mean other words. Leave out the pipeline's "
        f"corpus section (the checkpoint names its own), or train a base LM on this corpus "
        f"(base_lm.config).")
    line = error_of([*base, f"--corpus.path={fitted['a']}", "--corpus.name=corpus-a"], capsys)
    assert line == (
        f"gnnlm pipeline: error: The pipeline's corpus.tokenizer = {{kind: word}} (the default) "
        f"differs from the tokenizer the base LM {ckpt} was trained with ({{kind: word, "
        f"max_vocab: 8}}, saved in the checkpoint): token ids would mean other words. Leave "
        f"out the pipeline's corpus section (the checkpoint names its own), or train a base LM "
        f"on this corpus (base_lm.config).")
    assert not (tmp_path / "w").exists()                               # nothing was built


def test_a_pipeline_corpus_other_than_the_trained_base_lm_s_is_refused_at_load(tmp_path,
                                                                              capsys):
    """The base LM config names WikiText-2 (configs/wikitext2/base_lm.yaml); the pipeline, its
    own folder: the base LM would be trained on one and the datastore built from the other."""
    mine = write_corpus(tmp_path / "mine")
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}", f"--corpus.path={mine}",
                     "--corpus.name=mine"], capsys)
    assert line == (
        f"gnnlm pipeline: error: The pipeline's corpus.name = 'mine' (the command line), "
        f"corpus.path = '{mine}' (the command line) and its base LM config's "
        f"data.init_args.corpus = 'wikitext-2' (configs/wikitext2/base_lm.yaml) name different "
        f"corpora: the base LM would be trained on one and the datastore built from the other. "
        f"Name the corpus once: in the pipeline's corpus section (passed to the base LM's "
        f"training) or in the base LM config's data section.")
    tests = [*CPU, "-c", "configs/tests/pipeline.yaml", f"--workdir={tmp_path / 'w'}"]
    line = error_of(["pipeline", *tests, "--corpus.tokenizer.max_vocab=5000"], capsys)
    assert line == (
        "gnnlm pipeline: error: The pipeline's corpus.tokenizer = {kind: word, max_vocab: 5000} "
        "(the command line) and its base LM config's data.init_args.tokenizer = {kind: word, "
        "max_vocab: 10000} (configs/tests/tiny_lm.yaml) name different tokenizers: the base LM "
        "would be trained on other token ids than the datastore's. Name the tokenizer once: in "
        "the pipeline's corpus section (passed to the base LM's training) or in the base LM "
        "config's data section.")
    assert not (tmp_path / "w").exists()
    # the same corpus named in both places is one corpus
    same = load_config([*tests, "--corpus.tokenizer.max_vocab=10000"])
    assert same.corpus.tokenizer.max_vocab == 10000


def test_the_pipeline_s_corpus_is_what_its_base_lm_is_trained_on(tmp_path, monkeypatch):
    """A base LM config that names no corpus takes the pipeline's, passed to `gnnlm fit`; the
    tokens are built once, from the pipeline's section (the corpus named after its folder),
    and are an input of the trained LM."""
    import gnnlm.pipeline.stages as pipeline

    mine = write_corpus(tmp_path / "mine", train=CORPUS_B, valid=CORPUS_B, test=CORPUS_B)
    cfg = load_config(["-c", "configs/examples/own_corpus/pipeline.yaml",
                       f"--corpus.path={mine}", f"--workdir={tmp_path / 'w'}"])
    calls = []

    def fit(workdir, name, configs, inputs, predict=True, rebuild=False, overrides=None):
        calls.append((name, inputs, overrides))
        raise RuntimeError("stop after the call")

    monkeypatch.setattr(pipeline, "fit_with_cli", fit)
    with pytest.raises(RuntimeError, match="stop after the call"):
        stage_base_lm(cfg, Workdir(cfg.workdir))
    store = stage_tokens(cfg, Workdir(cfg.workdir), "")
    assert store.manifest["sources"]["train"] == str(mine / "train.txt")
    assert calls == [("base_lm", {"tokens": store.manifest["fingerprint"]}, [
        "--data.init_args.corpus=mine", f"--data.init_args.corpus_path={mine}",
        "--data.init_args.data_dir=null",
        '--data.init_args.tokenizer={"kind": "word", "vocab_size": 32000, "path": null, '
        '"max_vocab": 5000}'])]


def test_a_model_refuses_weights_of_another_vocabulary():
    """`gnnlm test --ckpt_path` (or a resumed fit) on tokens of another vocabulary."""
    from gnnlm.lit.lm import LanguageModel

    model = LanguageModel(vocab_size=8, context_length=8, n_layer=1, n_head=2, d_model=16,
                          d_ff=32, vocab_fingerprint="aaaa")
    model.on_load_checkpoint({"hyper_parameters": {"vocab_fingerprint": "aaaa"}})
    with pytest.raises(ValueError) as err:
        model.on_load_checkpoint({"hyper_parameters": {"vocab_fingerprint": "bbbb"}})
    assert str(err.value) == (
        "The model's vocabulary (fingerprint aaaa) is not the one of the checkpoint's weights "
        "(bbbb): token ids would mean different words. Train and evaluate a model with the "
        "corpus and tokenizer it was trained on.")


def test_a_hugging_face_folder_refuses_older_tokens_of_another_vocabulary(wikitext_root,
                                                                         tmp_path, capsys):
    """Tokens built before the manifest recorded the vocabulary's fingerprint: the tokenizer
    saved with them says it, and a model folder with another tokenizer is refused."""
    text = (wikitext_root / "wikitext-2" / "valid.txt").read_text()[:60_000]
    corpus = write_corpus(tmp_path / "c", train=text, valid=text[:8000], test=text[:8000])
    folder = save_family(FAMILIES["gpt2"], train_bpe(text[:30_000]), tmp_path / "gpt2")
    other = train_bpe(text[30_000:])                                   # 512 other tokens
    other.save(str(tmp_path / "other.json"))
    wd = Workdir(tmp_path / "w")
    build_tokens(wd.tokens, "c", str(corpus), None,
                 TokenizerConfig(kind="hf", path=str(tmp_path / "other.json")))
    as_older_code_wrote_it(wd.tokens, lambda manifest: manifest.pop("vocab_fingerprint"))
    line = error_of(["pipeline", "-c", "configs/tests/hf_family.yaml", f"--workdir={wd.root}",
                     f"--base_lm.ckpt=hf:{folder}", f"--corpus.path={corpus}",
                     "--corpus.name=c", f"--corpus.tokenizer.path={tmp_path / 'other.json'}"],
                    capsys)
    own = HFTokenizer.from_path(str(folder)).vocab_fingerprint()
    mine = HFTokenizer.from_path(str(tmp_path / "other.json")).vocab_fingerprint()
    assert own != mine
    assert line == (
        f"gnnlm pipeline: error: The corpus was tokenized with another vocabulary (fingerprint "
        f"{mine}, tokens in {wd.tokens}) than the base LM's own tokenizer in {folder} ({own}): "
        f"token ids would mean different words. Use tokenizer kind 'hf' without a path (the "
        f"model's own).")
