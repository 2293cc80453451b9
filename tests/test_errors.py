"""What a user sees when something is wrong: one line naming what and what to do, exit status 2
(the traceback only with --debug), and nothing left behind that looks complete."""
from __future__ import annotations

import errno
import json
import shutil

import numpy as np
import pytest

from gnnlm.cli import main
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.knn_cache import build_knn_cache
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from tests.conftest import CPU, LM, REPO
from tests.fakes import error_of, save_lm_checkpoint, write_corpus, write_features

pytestmark = pytest.mark.usefixtures("in_repo")


def fit_lm(root, capsys, *extra):
    return error_of(["fit", *LM, f"--data.init_args.workdir={root / 'work'}",
                     f"--trainer.default_root_dir={root / 'logs'}", *extra], capsys)


def test_a_missing_corpus(tmp_path, capsys):
    assert fit_lm(tmp_path, capsys, "--data.init_args.corpus_path=/no/such/corpus") == (
        "gnnlm fit: error: Corpus path /no/such/corpus does not exist: point corpus_path at the "
        "folder holding train.txt, valid.txt, test.txt.")
    assert not (tmp_path / "work" / "tokens").exists()


def test_an_empty_split(tmp_path, capsys):
    path = write_corpus(tmp_path / "c", valid="\n \n")
    assert fit_lm(tmp_path, capsys, f"--data.init_args.corpus_path={path}") == (
        f"gnnlm fit: error: Split file {path}/valid.txt is empty: a corpus needs text in train, "
        f"valid and test.")
    assert not (tmp_path / "work" / "tokens").exists()


def test_non_utf8_bytes_name_the_file_and_the_offset(tmp_path, capsys):
    path = write_corpus(tmp_path / "c", test=b"caf\xe9 au lait\n")
    assert fit_lm(tmp_path, capsys, f"--data.init_args.corpus_path={path}") == (
        f"gnnlm fit: error: {path}/test.txt is not UTF-8 text: byte 0xe9 at offset 3 cannot be "
        f"decoded. Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8).")


def test_a_split_prefix_of_no_tokens_is_refused_before_any_work(tmp_path, capsys):
    # characters of "a b a\n": a, space, b, newline, and <unk>: the LM's 5 outputs
    ckpt, _ = save_lm_checkpoint(tmp_path / "lm.ckpt", vocab_size=5, context_length=16)
    path = write_corpus(tmp_path / "c", valid="a b\n", test="b a\n", train="a b a\n")
    wd = tmp_path / "w"
    args = ["pipeline", *CPU, f"--workdir={wd}", f"--base_lm.ckpt={ckpt}",
            f"--corpus.path={path}", "--corpus.name=tiny", "--corpus.tokenizer.kind=char",
            "--features.context=16", "--features.stride=8", "--features.max_tokens={valid: 0}"]
    assert error_of(args, capsys) == (
        "gnnlm pipeline: error: features.max_tokens.valid must be >= 1 (got 0): leave the split "
        "out for all of it.")
    assert not wd.exists()


@pytest.mark.parametrize("flag", ["--corpus.tokenizer.max_vocab=-1",
                                  "--corpus.tokenizer.max_vocab=0"])
def test_a_vocabulary_of_no_words_is_refused_before_any_work(flag, tmp_path, capsys):
    """``max_vocab: -1`` once ran the whole pipeline on <eos> and <unk> alone (perplexity 1.2)."""
    wd = tmp_path / "w"
    line = error_of(["pipeline", *CPU, f"--workdir={wd}", flag], capsys)
    assert line == (f"gnnlm pipeline: error: tokenizer.max_vocab must be >= 3 (<eos>, <unk> and "
                    f"at least one word), or null for every word of the train split "
                    f"(got {flag.split('=')[1]}).")
    assert not wd.exists()


def test_a_tokenizer_of_a_fit_config_with_no_words(tmp_path, capsys):
    line = fit_lm(tmp_path, capsys, "--data.init_args.tokenizer.max_vocab=-1")
    assert line.startswith("gnnlm fit: error: tokenizer.max_vocab must be >= 3 ")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("content,what", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)),
     "is not text: it is an ELF binary (it begins with b'\\x7fELF'): point the corpus at plain "
     "text files."),
    (b"\x1f\x8b\x08\x00rest",
     "is not text: it is gzip-compressed (it begins with b'\\x1f\\x8b'): decompress it first "
     "(gunzip)."),
    (b"the cat\x00\x00sat\n",
     "is not text: it holds a NUL byte at offset 7 (it begins with b'the cat\\x00'): point the "
     "corpus at plain text files."),
    ("the cat sat\n".encode("utf-16"),
     "is UTF-16 text: convert it to UTF-8 (e.g. iconv -f utf-16 -t utf-8)."),
    ("the cat sat\n".encode("utf-16-le"),
     "is UTF-16 text without a byte-order mark (UTF-16LE): convert it to UTF-8 (e.g. iconv -f "
     "utf-16le -t utf-8)."),
])
def test_a_split_file_that_is_not_text_says_so(content, what, tmp_path, capsys):
    """Not advice to convert from Latin-1, which would turn a binary into nonsense text."""
    path = write_corpus(tmp_path / "c", train=content)
    assert fit_lm(tmp_path, capsys, f"--data.init_args.corpus_path={path}") == (
        f"gnnlm fit: error: {path}/train.txt {what}")
    assert not (tmp_path / "work" / "tokens").exists()


@pytest.mark.parametrize("given,message", [
    ("", "workdir is an empty path: name the folder the artifacts go to, e.g. runs/wikitext2 "
         "('.' for the current directory)."),
    ("a-file", "workdir {root}/a-file is a file, not a folder: name another path (the folder is "
               "made if absent)."),
    ("a-file/w", "workdir {root}/a-file/w lies under {root}/a-file, which is a file, not a "
                 "folder: name another path."),
])
def test_a_work_directory_that_cannot_be_one(given, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("notes\n")
    workdir = f"{tmp_path}/{given}" if given else ""
    assert error_of(["pipeline", *CPU, f"--workdir={workdir}"], capsys) == (
        f"gnnlm pipeline: error: {message.format(root=tmp_path)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]     # nothing written


def test_an_empty_work_directory_of_a_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", *(a if not a.startswith("configs/") else f"{REPO}/{a}" for a in LM),
            "--data.init_args.workdir=", f"--trainer.default_root_dir={tmp_path / 'logs'}"]
    assert error_of(args, capsys) == (
        "gnnlm fit: error: The work directory (workdir) is an empty path: name the folder the "
        "artifacts go to, e.g. runs/wikitext2 ('.' for the current directory).")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec,folder", [("hf:/no/such/folder", "/no/such/folder"),
                                         ("hf:./typo", "./typo"), ("hf:~/typo", "~/typo")])
def test_a_hugging_face_folder_that_does_not_exist(spec, folder, tmp_path, capsys):
    """The Hub client would answer "Repo id must be in the form ..." of a folder's path."""
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}", f"--base_lm.ckpt={spec}"],
                    capsys)
    assert line == (f"gnnlm pipeline: error: base_lm.ckpt {spec}: there is no folder {folder} "
                    f"(relative paths are resolved against the current directory, {REPO}): "
                    f"give the folder `save_pretrained` wrote, or a Hub name such as hf:gpt2.")
    assert not (tmp_path / "w").exists()


def test_a_hugging_face_folder_without_a_model(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     f"--base_lm.ckpt=hf:{tmp_path / 'hf'}"], capsys)
    assert line == (f"gnnlm pipeline: error: base_lm.ckpt hf:{tmp_path / 'hf'}: the folder "
                    f"{tmp_path / 'hf'} holds no config.json and no .gguf file, so it is not a "
                    f"saved Hugging Face model: give the folder `save_pretrained` wrote, a GGUF "
                    f"file, or a Hub name such as hf:gpt2.")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("overlay,message", [
    ("model:\n  init_args:\n    n_layr: 2\n",
     "model.init_args has no key 'n_layr' (LanguageModel): did you mean n_layer?"),
    ("data:\n  init_args:\n    tokenizer:\n      max_vocb: 100\n",
     "data.init_args.tokenizer has no key 'max_vocb' (LMDataModule's tokenizer): did you mean "
     "max_vocab?"),
    ("trainer:\n  max_stepz: 3\n",
     "trainer has no key 'max_stepz': did you mean max_steps or max_time or min_steps?"),
])
def test_a_key_typo_in_a_fit_config_of_the_pipeline(overlay, message, tmp_path, capsys):
    """Named with its section and the keys near it, not inside jsonargparse's text about the
    Union of every LightningModule and None."""
    (tmp_path / "typo.yaml").write_text(overlay)
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/base_lm.yaml",
             str(tmp_path / "typo.yaml")]
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     f"--base_lm.config=[{','.join(chain)}]"], capsys)
    assert line == (f"gnnlm pipeline: error: The `gnnlm fit` config {' + '.join(chain)} does not "
                    f"parse: {message}")
    assert not (tmp_path / "w").exists()


def test_a_key_typo_in_a_head_config_lists_the_keys_when_none_is_close(tmp_path, capsys):
    (tmp_path / "typo.yaml").write_text("data:\n  init_args:\n    graph:\n      zzz: 3\n")
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/gnnlm.yaml",
             "configs/wikitext2/gnnlm_cpu.yaml", str(tmp_path / "typo.yaml")]
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     f"--gnn.config=[{','.join(chain)}]"], capsys)
    assert line.endswith("does not parse: data.init_args.graph has no key 'zzz' "
                         "(GraphDataModule's graph): its keys are ctx_window, inter, k, left, "
                         "right.")


def test_a_typo_in_a_setting(capsys):
    assert error_of(["pipeline", *CPU, "--knn.metrix=cos"], capsys) == (
        "gnnlm pipeline: error: unrecognized arguments: --knn.metrix=cos")


@pytest.mark.parametrize("flag,message", [
    ("--knn.k=1000", "knn.ks/knn.k ask for up to k = 1000 neighbours but neighbors.K = 128 are "
                     "stored: lower k or raise neighbors.K."),
    ("--knn.temperature=0", "The temperature T (knn.temperature) must be a finite number > 0 "
                            "(got [0.0])."),
    ("--knn.lambda_=1.5", "λ (knn.lambda_) must lie in [0, 1] (got [1.5])."),
])
def test_interpolation_settings_are_checked_before_any_work(flag, message, tmp_path, capsys):
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}", flag], capsys)
    assert line == f"gnnlm pipeline: error: {message}"
    assert not (tmp_path / "w").exists()                               # nothing was built


def test_a_missing_checkpoint(tmp_path, capsys):
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     "--base_lm.ckpt=/no/such/model.ckpt"], capsys)
    assert line == ("gnnlm pipeline: error: No checkpoint at /no/such/model.ckpt: give a .ckpt "
                    "written by `gnnlm fit` (or hf:<name-or-folder> for a Hugging Face model).")


def test_a_checkpoint_of_another_vocabulary_leaves_no_tokens(tmp_path, capsys):
    ckpt, _ = save_lm_checkpoint(tmp_path / "lm.ckpt", vocab_size=50)
    path = write_corpus(tmp_path / "c")
    line = error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}", f"--base_lm.ckpt={ckpt}",
                     f"--corpus.path={path}", "--corpus.name=tiny",
                     "--features.context=16", "--features.stride=8"], capsys)  # the LM's context
    assert line == ("gnnlm pipeline: error: The base LM gpt has 50 outputs but the tokenizer of "
                    "the corpus has 7 types: they must match (for a Hugging Face LM use "
                    "tokenizer kind 'hf', which without a path is the model's own).")
    assert not Workdir(tmp_path / "w").tokens.exists()                 # the corrected run starts


def test_a_hugging_face_folder_without_a_tokenizer(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    path = write_corpus(tmp_path / "c")
    line = error_of(["fit", *LM, f"--data.init_args.workdir={tmp_path / 'work'}",
                     f"--data.init_args.corpus_path={path}", "--data.init_args.corpus=tiny",
                     "--data.init_args.tokenizer.kind=hf",
                     f"--data.init_args.tokenizer.path={tmp_path / 'hf'}"], capsys)
    assert line.startswith(f"gnnlm fit: error: No tokenizer at '{tmp_path / 'hf'}'")


@pytest.fixture
def caches(tmp_path):
    """A work directory with valid/test kNN caches (what `gnnlm sweep` reads)."""
    rng = np.random.default_rng(0)
    wd = Workdir(tmp_path / "w")
    write_features(wd.features("train"), rng.standard_normal((400, 8)).astype(np.float32),
                   targets=rng.integers(0, 9, 400).astype(np.int32))
    for split in ("valid", "test"):
        write_features(wd.features(split), rng.standard_normal((60, 8)).astype(np.float32),
                       targets=rng.integers(0, 9, 60).astype(np.int32),
                       lm_logprob=-rng.uniform(1, 3, 60), split=split)
    build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=10))
    for split in ("valid", "test"):
        build_neighbors(wd, split, "final", "cos", NeighborsConfig(K=128))
        build_knn_cache(wd, split, "final", "cos")
    return wd


def sweep(wd, capsys):
    return error_of(["sweep", *CPU, f"--workdir={wd.root}", "--knn.keys=[final]"], capsys)


def test_a_truncated_memmap(caches, capsys):
    sims = caches.knn_cache("final", "cos", "faiss", "valid") / "sims.bin"
    sims.write_bytes(sims.read_bytes()[:-8])
    assert sweep(caches, capsys) == (
        f"gnnlm sweep: error: {sims} holds {60 * 128 * 4 - 8} bytes but its manifest says "
        f"float32 [60, 128] = {60 * 128 * 4} bytes: the file is truncated or was replaced. "
        f"Rebuild this stage.")


def test_a_corrupt_manifest(caches, capsys):
    manifest = caches.knn_cache("final", "cos", "faiss", "test") / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    line = sweep(caches, capsys)
    assert line.startswith(f"gnnlm sweep: error: {manifest} is not valid JSON (")
    assert line.endswith(f"the file is corrupt. Delete {manifest.parent} and run the stage "
                         f"again, or rerun with --rebuild.")


def test_a_refusal_names_the_fields_that_differ(caches, capsys):
    with pytest.raises(Exception) as refused:
        build_neighbors(caches, "valid", "final", "cos", NeighborsConfig(K=64))
    assert "config.K: 128 → 64" in str(refused.value)
    assert str(refused.value).endswith("Use another work directory, delete the folder, or "
                                       "rerun with --rebuild=[neighbors], which rebuilds it and "
                                       "every stage that reads it.")


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match=r"λ \(knn.lambda_\) must lie in \[0, 1\]"):
        main(["pipeline", *CPU, "--knn.lambda_=1.5", "--debug"])


def test_a_full_disk_leaves_only_a_partial_folder_that_resumes(tmp_path, monkeypatch):
    """The disk fills up in the middle of a stage: the run stops with the OS error, the folder
    stays ``.partial`` (nothing looks complete), and the next run resumes to the same bytes."""
    def build(path, fail_at=None):
        builder = ArtifactBuilder(path, kind="demo", config={"n": 6})
        if builder.is_complete():
            return
        with builder:
            values = builder.array("values", np.float64, (6, 4))
            for chunk in builder.chunks(6, "demo"):
                if chunk == fail_at:
                    raise OSError(errno.ENOSPC, "No space left on device")
                values[chunk] = chunk
            builder.finish()

    with pytest.raises(OSError, match="No space left on device"):
        build(tmp_path / "a", fail_at=3)
    assert not (tmp_path / "a").exists() and (tmp_path / "a.partial").is_dir()
    progress = json.loads((tmp_path / "a.partial" / "progress.json").read_text())
    assert progress["progress"]["chunks_done"] == 3
    build(tmp_path / "a")
    build(tmp_path / "b")
    assert (tmp_path / "a" / "values.bin").read_bytes() == \
        (tmp_path / "b" / "values.bin").read_bytes()
    assert read_manifest(tmp_path / "a")["complete"]
    shutil.rmtree(tmp_path / "b")
