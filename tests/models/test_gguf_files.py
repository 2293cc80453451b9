"""GGUF files as base LMs: which file a spec names, the header read without tensors, the three
one-line refusals (no ``gguf`` package, an architecture transformers cannot read, a truncated
file), and SmolLM2-135M-Instruct's real weights (``make smollm2``) through the adapter, the
pipeline's sliding windows and its tokenizer on WikiText-2."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gnnlm.models import is_hf, load_base_lm
from gnnlm.models.gguf_files import TruncatedGGUF, read_header
from gnnlm.models.settings import check_hf_folder, gguf_file
from tests.conftest import wikitext_slice

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def write_gguf(path: Path, architecture: str = "mamba-xyz", context: int = 64,
               width: int = 8) -> Path:
    """A tiny GGUF: an architecture, its context and width, one float32 tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_tensor("token_embd.weight", np.arange(16 * width, dtype=np.float32)
                      .reshape(16, width))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- which GGUF a spec names -------------------------------------------------------------------

def test_a_gguf_spec_names_its_file_with_or_without_the_prefix(tmp_path):
    (tmp_path / "one").mkdir()
    file = write_gguf(tmp_path / "one" / "m.Q4_1.gguf")
    for spec in (str(file), f"hf:{file}", str(file.parent), f"hf:{file.parent}"):
        assert is_hf(spec) and gguf_file(spec) == file
        check_hf_folder(spec)  # there, and one file: nothing to refuse
    # a folder with config.json is a Hugging Face folder even beside a GGUF
    (file.parent / "config.json").write_text("{}")
    assert is_hf(str(file.parent)) and gguf_file(str(file.parent)) is None
    # a checkpoint of the built-in LM is neither
    (tmp_path / "model.ckpt").write_bytes(b"")
    assert not is_hf(str(tmp_path / "model.ckpt")) and gguf_file(str(tmp_path / "model.ckpt")) \
        is None


def test_a_missing_gguf_or_a_folder_of_several_is_refused_in_one_line(tmp_path):
    missing = tmp_path / "absent.gguf"
    assert is_hf(str(missing)) and gguf_file(str(missing)) is None  # a GGUF, not a checkpoint
    with pytest.raises(FileNotFoundError) as err:
        check_hf_folder(str(missing))
    assert str(err.value).startswith(f"base_lm.ckpt {missing}: there is no file {missing} ")
    assert "make smollm2" in str(err.value) and "\n" not in str(err.value)
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(two / "a.gguf")
    write_gguf(two / "b.gguf")
    assert is_hf(str(two)) and gguf_file(str(two)) is None
    with pytest.raises(ValueError) as err:
        check_hf_folder(f"hf:{two}")
    assert str(err.value) == (f"base_lm.ckpt hf:{two}: the folder {two} holds 2 GGUF files "
                              f"(a.gguf, b.gguf): name the one to load.")


def test_a_gguf_s_fingerprint_is_its_file_and_the_dtype_it_was_dequantized_to():
    """float32 (the default) is the file's sha256; another dtype is another fingerprint, so the
    features of a float32 and a bfloat16 load of one file are never reused for each other."""
    from gnnlm.models.hf import HFCausalLM

    def fingerprint(dtype: str) -> str:
        return HFCausalLM.fingerprint(SimpleNamespace(gguf_sha256=SMOLLM2_SHA256,
                                                      dtype_name=dtype))

    assert fingerprint("float32") == SMOLLM2_SHA256[:16]
    assert len({fingerprint(d) for d in ("float32", "bfloat16", "float16")}) == 3


def test_the_header_is_read_without_the_tensors(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", context=96, width=8)
    header = read_header(path)
    assert header.architecture == "llama"
    assert (header.field("context_length"), header.field("embedding_length")) == (96, 8)
    assert header.size == path.stat().st_size  # the tensors end where the file does


def test_the_config_checks_read_a_gguf_s_context(tmp_path, wikitext_root, in_repo):
    """``features.context`` past the GGUF's context length is refused when the config is
    loaded, from the file's header (no model loaded)."""
    from gnnlm.pipeline.config import load_config

    path = write_gguf(tmp_path / "m.gguf", "llama", context=96, width=8)
    args = ["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt={path}",
            f"--corpus.path={wikitext_root / 'wikitext-2'}", f"--workdir={tmp_path / 'work'}"]
    with pytest.raises(ValueError) as err:
        load_config([*args, "--features.context=128"])
    assert str(err.value) == (f"features.context = 128 exceeds the context of base_lm.ckpt "
                              f"{path}, 96 tokens: lower it to at most 96, or leave it unset "
                              f"for the model's own.")
    assert load_config([*args, "--features.context=96"]).features.context == 96


# -- the three one-line refusals ---------------------------------------------------------------

def test_without_the_gguf_package_a_gguf_is_refused_in_one_line(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError) as err:
        load_base_lm(str(path))
    assert str(err.value) == (f"{path} is a GGUF file, which needs the `gguf` package: pip "
                              f"install 'gguf>=0.10' (a dependency of gnnlm: reinstall it).")


def test_an_architecture_transformers_cannot_read_is_refused_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba-xyz")
    with pytest.raises(ValueError) as err:
        load_base_lm(f"hf:{path}")
    message = str(err.value)
    assert message.startswith(f"{path} is a GGUF of architecture 'mamba-xyz', which "
                              f"transformers ")
    assert "llama" in message and message.endswith(
        "give a GGUF of one of those, or the model as a Hugging Face folder.")
    assert "\n" not in message


@pytest.mark.parametrize("keep", [40, -16])  # inside the header; inside the tensor data
def test_a_truncated_gguf_is_refused_in_one_line(keep, tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:keep])
    with pytest.raises(TruncatedGGUF) as err:
        load_base_lm(str(path))
    message = str(err.value)
    assert message.startswith(f"{path} is truncated ({len(whole[:keep]):,} bytes")
    assert message.endswith("the download or copy was cut short; fetch the file again.")
    assert "\n" not in message


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"^.*m\.gguf is not a GGUF file \(it does not begin "
                                         r"with 'GGUF'\)"):
        load_base_lm(str(path))


def test_the_work_directory_reloads_a_gguf_from_where_it_recorded_it(tmp_path):
    """A GGUF named without ``hf:`` is recorded relative to the work directory, as checkpoints
    are; with ``hf:`` as given. Either way the served model reloads it as a GGUF, with the
    options its features were built with."""
    from gnnlm.inference.model import TrainedLM
    from gnnlm.workdir.layout import Workdir

    workdir = Workdir(tmp_path / "work")
    (workdir.root / "models").mkdir(parents=True)
    inside = write_gguf(workdir.root / "models" / "m.gguf")
    outside = write_gguf(tmp_path / "m.gguf")
    assert workdir.relative(inside) == "models/m.gguf"
    identity = {"keys": {"final": "model.norm:output"}, "dtype": "float32"}
    for location, file in (("models/m.gguf", inside), (workdir.relative(outside), outside),
                           (f"hf:{outside}", outside)):
        served = SimpleNamespace(workdir=workdir,
                                 features={"base_lm": {**identity, "location": location}})
        spec = TrainedLM.base_lm_spec.func(served)  # type: ignore[attr-defined]
        served.base_lm_spec = spec
        assert gguf_file(spec) is not None and gguf_file(spec).samefile(file)
        assert TrainedLM.base_lm_options.func(served) == identity  # type: ignore[attr-defined]


# -- SmolLM2-135M-Instruct's real weights ------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), loaded once."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2.relative_to(REPO)} is not there: run `make smollm2`.")
    torch.manual_seed(0)
    return load_base_lm(str(SMOLLM2))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from gnnlm.text.tokens import HFTokenizer

    return HFTokenizer.from_path(str(SMOLLM2.parent))


@pytest.fixture(scope="module")
def small_slice(wikitext_root, tmp_path_factory):
    """The first 20k characters of each WikiText-2 split, cut at a line end."""
    return wikitext_slice(wikitext_root, tmp_path_factory.mktemp("wt2-small"),
                          dict.fromkeys(("train", "valid", "test"), 20_000))


@pytest.mark.integration
def test_smollm2_is_its_file_and_its_final_keys_give_its_logits(smollm2, smollm2_tokenizer,
                                                                wikitext_root):
    """The identity is the file's sha256 and the dtype; ``final`` through the output embedding
    is the model's own logits on real text, and those logits predict WikiText-2 as a trained
    LM does (a per-token perplexity far below the 49,152 of a uniform guess)."""
    assert smollm2.name == "hf:SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.fingerprint() == SMOLLM2_SHA256[:16]
    assert smollm2.identity()["dtype"] == "float32" and smollm2.model.dtype == torch.float32
    assert (smollm2.vocab_size, smollm2.hidden_size, smollm2.context_length) == (49152, 576, 8192)
    assert smollm2.model.config.model_type == "llama" and len(smollm2.model.model.layers) == 30
    text = (wikitext_root / "wikitext-2" / "valid.txt").read_text()[:4000]
    ids = torch.from_numpy(smollm2_tokenizer.encode(text)[:256])[None]
    with torch.no_grad():
        ours = smollm2.logits(smollm2(ids).final)
        reference = smollm2.model(input_ids=ids, use_cache=False).logits.float()
    scale = float(reference.abs().max())
    assert float((ours - reference).abs().max()) <= 1e-4 * scale
    nll = torch.nn.functional.cross_entropy(ours[0, :-1], ids[0, 1:])
    assert float(nll.exp()) < 100, float(nll.exp())


@pytest.mark.integration
def test_the_pipeline_s_log_probabilities_are_transformers_own(smollm2, small_slice, tmp_path):
    """The tokens and features stages on a WikiText-2 slice (the GGUF's own tokenizer; context
    128, stride 64): ``lm_logprob`` of the first, a middle and the last window equals
    ``log_softmax(model(window).logits)`` at the positions each window scores."""
    from gnnlm.models.encode import sliding_windows
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import check_vocabulary, stage_features, stage_tokens
    from gnnlm.text.tokens import HFTokenizer
    from gnnlm.workdir.layout import Workdir
    from gnnlm.workdir.manifests import open_array, read_manifest

    cfg = load_config(["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt={SMOLLM2}",
                       f"--corpus.path={small_slice}", f"--workdir={tmp_path / 'work'}",
                       "--features.context=128", "--features.stride=64",
                       "--features.max_tokens={train: 128, valid: 600, test: 128}",
                       "--gnn.config=null"])
    workdir = Workdir(cfg.workdir)
    reads = []
    read = HFTokenizer.from_path.__func__  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:  # how often the GGUF's tokenizer is read
        mp.setattr(HFTokenizer, "from_path", classmethod(
            lambda cls, path: reads.append(path) or read(cls, path)))
        store = stage_tokens(cfg, workdir, str(SMOLLM2))
        check_vocabulary(smollm2, store, str(SMOLLM2))  # the GGUF's own tokenizer: the same ids
    assert reads.count(str(SMOLLM2)) == 1  # once per run: the tokens stage's read is reused
    location = workdir.relative(SMOLLM2)
    stage_features(cfg, smollm2, store, workdir, location)
    manifest = workdir.features_manifest("valid")
    assert manifest["base_lm"]["fingerprint"] == SMOLLM2_SHA256[:16]
    assert manifest["base_lm"]["location"] == location and not manifest["bos_each_window"]
    tokens_manifest = read_manifest(workdir.tokens)
    tokens = np.asarray(open_array(workdir.tokens, "valid", tokens_manifest), dtype=np.int64)
    logprob = np.asarray(open_array(workdir.features("valid"), "lm_logprob", manifest))
    n = len(logprob)
    assert n == 600
    stream = np.concatenate([[tokens_manifest["bos_id"]], tokens[:n]])
    starts, score_from = sliding_windows(n, 128, 64)
    assert len(starts) >= 3
    for w in (0, len(starts) // 2, len(starts) - 1):
        window = torch.from_numpy(stream[starts[w]:starts[w] + 128].copy())[None]
        with torch.no_grad():
            reference = torch.log_softmax(smollm2.model(input_ids=window).logits[0].float(), -1)
        positions = np.arange(score_from[w], starts[w] + 128)
        expected = reference[score_from[w] - starts[w]:].gather(
            1, torch.from_numpy(tokens[positions])[:, None])[:, 0]
        np.testing.assert_allclose(logprob[positions], expected.numpy(), atol=1e-4)
    assert float(np.exp(-logprob.mean())) < 100  # a trained LM on WikiText-2, not noise


@pytest.mark.integration
def test_the_gguf_tokenizer_round_trips_wikitext(smollm2_tokenizer, wikitext_root):
    """400 lines of test.txt, encoded as ``build_tokens`` encodes a split (each line and its
    newline), decode to the same text: ``<unk>``, `` @-@ ``, `` @,@ ``, blank lines and all."""
    lines = (wikitext_root / "wikitext-2" / "test.txt").read_text().split("\n")[:400]
    text = "\n".join(lines) + "\n"
    assert all(mark in text for mark in ("<unk>", " @-@ ", " @,@ ", "\n \n"))
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.vocab_size == 49152 and len(ids) < len(text.split()) * 2
