"""Settings that would fail only after the costly stages are refused when the config loads: one
line naming the setting and what to do, exit status 2, and no work directory."""
from __future__ import annotations

import json
import re

import pytest
import torch

import gnnlm.utils.devices
from gnnlm.pipeline.config import load_config
from tests.conftest import CPU
from tests.fakes import error_of, save_lm_checkpoint

# the CPU pipeline trains its base LM with these: context 128, 128 wide
BASE_LM = ("configs/trainer/cpu.yaml + configs/wikitext2/base_lm.yaml + "
           "configs/wikitext2/base_lm_cpu.yaml")
GNN = ["configs/trainer/cpu.yaml", "configs/wikitext2/gnnlm.yaml",
       "configs/wikitext2/gnnlm_cpu.yaml"]
FACTORY_ADVICE = ("write a faiss index_factory string such as 'IVF1024,SQ8' or 'IVF1024,PQ32', "
                  "or 'auto' to let the pipeline choose.")

pytestmark = pytest.mark.usefixtures("in_repo")


def refused(tmp_path, capsys, *flags: str, config=CPU) -> str:
    """The error line of ``gnnlm pipeline`` with ``flags``, after checking nothing was made."""
    line = error_of(["pipeline", *config, f"--workdir={tmp_path / 'w'}", *flags], capsys)
    assert not (tmp_path / "w").exists()                               # nothing was built
    return line.removeprefix("gnnlm pipeline: error: ")


@pytest.mark.parametrize("flag,message", [
    ("--knn.temperatures=[]", "knn.temperatures is empty: list at least one value, leave it "
                              "out for the default grid, or pin one with knn.temperature."),
    ("--knn.ks=[]", "knn.ks is empty: list at least one value, leave it out for the default "
                    "grid, or pin one with knn.k."),
    ("--knn.lambdas=[]", "knn.lambdas is empty: list at least one value, leave it out for the "
                         "default grid, or pin one with knn.lambda_."),
])
def test_an_empty_knn_grid(flag, message, tmp_path, capsys):
    assert refused(tmp_path, capsys, flag) == message


@pytest.mark.parametrize("flags,message", [
    (["--index.factory=IVFbogus"], "index.factory = 'IVFbogus' is not an index faiss can parse "
                                   "(could not parse index string IVFbogus): " + FACTORY_ADVICE),
    (["--index.factory=IVF0,Flat"], "index.factory = 'IVF0,Flat' has 0 inverted lists: give "
                                    "IVF<nlist> with nlist >= 1 (e.g. IVF1024), or 'auto'."),
    (["--index.factory=IVF4096,Flat", "--index.train_sample=1000"],
     "index.factory = 'IVF4096,Flat' has 4096 inverted lists but index.train_sample = 1000 keys "
     "train them: lower nlist or raise train_sample (faiss wants >= 39 keys per list)."),
    # parses, but not for the 128-dimensional features of the CPU base LM
    (["--index.factory=IVF64,PQ48"], "index.factory = 'IVF64,PQ48' cannot index the base LM's "
                                     "128-dimensional keys under knn.metric = 'cos' (The "
                                     "dimension of the vector (d) should be a multiple of the "
                                     "number of subquantizers (M)): " + FACTORY_ADVICE),
])
def test_an_index_factory_faiss_cannot_build(flags, message, tmp_path, capsys):
    assert refused(tmp_path, capsys, *flags) == message


@pytest.mark.parametrize("overlay,setting", [
    # the graph's own checks (GraphConfig), on the parsed config
    ("graph: {k: 0}", ": data.init_args.graph.k (windows retrieved per token) must be >= 1 "
                      "(got 0)."),
    ("graph: {k: -4}", ": data.init_args.graph.k (windows retrieved per token) must be >= 1 "
                       "(got -4)."),
    ("graph: {left: -1}", ": data.init_args.graph.left and graph.right (tokens on each side of "
                          "a retrieved one) must be >= 0 (got left=-1, right=1)."),
    ("graph: {ctx_window: 0}", ": data.init_args.graph.ctx_window must be >= 1, or null for the "
                               "whole block (got 0)."),
    ("k_schedule: [[0, 0], [1, 16]]", " sets data.init_args.k_schedule = [[0, 0], [1, 16]], but "
                                      "every k (windows retrieved per token) must be >= 1."),
    ("eval_ks: [0, 16]", " sets data.init_args.eval_ks = [0, 16], but every k (windows "
                         "retrieved per token) must be >= 1."),
])
def test_a_graph_count_below_one_in_the_gnn_config(overlay, setting, tmp_path, capsys):
    extra = tmp_path / "overlay.yaml"
    extra.write_text(f"data:\n  init_args:\n    {overlay}\n")
    chain = [*GNN, str(extra)]
    assert refused(tmp_path, capsys, f"--gnn.config={json.dumps(chain)}") == (
        f"the gnn config ({' + '.join(chain)}){setting}")


def test_a_block_size_below_one_in_the_gnn_config(tmp_path, capsys):
    extra = tmp_path / "overlay.yaml"
    extra.write_text("data:\n  init_args:\n    block_size: 0\n")
    chain = [*GNN, str(extra)]
    assert refused(tmp_path, capsys, f"--gnn.config={json.dumps(chain)}") == (
        f"The `gnnlm fit` config {' + '.join(chain)} sets data.init_args.block_size = 0: it "
        f"must be >= 1.")


OWN_GNN = ["configs/trainer/cpu.yaml", "configs/examples/own_corpus/gnnlm.yaml"]


@pytest.mark.parametrize("head,chain,overlay,message", [
    # the k curriculum must end at graph.k (8 in the own-corpus example): once stopped only when
    # the GNN stage began, with neither file nor key named
    ("gnn", OWN_GNN, "k_schedule: [[0, 4], [1, 16]]",
     ": data.init_args.k_schedule must start at epoch 0 and end with graph.k = 8, the k "
     "evaluation uses (got [[0, 4], [1, 16]]); {overlay} sets it."),
    ("gnn", OWN_GNN, "k_schedule: [[1, 8]]",
     ": data.init_args.k_schedule must start at epoch 0 and end with graph.k = 8, the k "
     "evaluation uses (got [[1, 8]]); {overlay} sets it."),
    # a k of the curriculum above the K = 64 stored neighbours
    ("gnn", OWN_GNN, "k_schedule: [[0, 128], [1, 8]]",
     " keeps k = 128 neighbours per token (k_schedule [128]) but neighbors.K = 64 are stored: "
     "lower them to at most 64, or raise neighbors.K."),
    ("gnn", OWN_GNN, "predict_split: dev",
     ": data.init_args.predict_split must be one of train, valid, test (got 'dev'); {overlay} "
     "sets it."),
    # a head that reads no neighbours (SPALM's gate on the frozen LM with retrieved < 0)
    ("spalm", ["configs/trainer/cpu.yaml", "configs/wikitext2/spalm.yaml",
               "configs/wikitext2/spalm_cpu.yaml"], "retrieved: -1",
     ": data.init_args.retrieved must be >= 0 (got -1); {overlay} sets it."),
])
def test_every_head_s_data_arguments_are_checked_at_load(head, chain, overlay, message,
                                                         tmp_path, capsys):
    """A data module's own checks of its arguments run on every head's config when the
    pipeline loads it, naming the head's files and the file that sets the key."""
    extra = tmp_path / "overlay.yaml"
    extra.write_text(f"data:\n  init_args:\n    {overlay}\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text("a few words\n")
    files = [*chain, str(extra)]
    line = refused(tmp_path, capsys, f"--{head}.config={json.dumps(files)}",
                   config=["-c", "configs/examples/own_corpus/pipeline.yaml",
                           f"--corpus.path={corpus}"])
    assert line == f"the {head} config ({' + '.join(files)})" + message.format(overlay=extra)


def test_a_graph_k_below_one_in_gnnlm_fit(tmp_path, capsys):
    line = error_of(["fit", *(a for f in GNN for a in ("-c", f)), "--data.init_args.graph.k=0",
                     f"--data.init_args.workdir={tmp_path / 'w'}",
                     f"--trainer.default_root_dir={tmp_path / 'logs'}"], capsys)
    assert line == "gnnlm fit: error: graph.k (windows retrieved per token) must be >= 1 (got 0)."
    assert not (tmp_path / "w").exists() and not (tmp_path / "logs").exists()


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gnnlm.utils.devices, "faiss_has_gpu", lambda: False)


GPU_GNN = ["configs/trainer/gpu.yaml", *GNN[1:]]
TRAINER_ADVICE = ("sets trainer.accelerator: gpu, but torch sees no CUDA GPU on this machine: "
                  "start that chain with configs/trainer/cpu.yaml instead of "
                  "configs/trainer/gpu.yaml (with the model's *_cpu.yaml overlay, as "
                  "pipeline_cpu.yaml does), or set trainer.accelerator: auto.")


@pytest.mark.parametrize("config,flags,message", [
    (CPU, ["--features.device=cuda"], "features.device = 'cuda' needs a CUDA GPU, but torch sees "
                                      "no GPU on this machine: set features.device: auto (a "
                                      "GPU when there is one) or cpu."),
    (CPU, ["--features.device=cuda:1"], "features.device = 'cuda:1' needs CUDA GPU 1, but torch "
                                        "sees no GPU on this machine: set features.device: auto "
                                        "(a GPU when there is one) or cpu."),
    (CPU, ["--index.device=cuda"], "index.device = 'cuda' needs faiss-gpu and a GPU, but this "
                                   "faiss has no GPU support or sees no GPU: set index.device: "
                                   "auto (the GPU when faiss has one) or cpu, or install the "
                                   "`gpu` extra (faiss-gpu, after uninstalling faiss-cpu)."),
    (CPU, [f"--gnn.config={json.dumps(GPU_GNN)}"],
     "the `gnnlm fit` config configs/trainer/gpu.yaml + configs/wikitext2/gnnlm.yaml + "
     "configs/wikitext2/gnnlm_cpu.yaml " + TRAINER_ADVICE),
    # the GPU pipeline without its CPU overlay: the base LM's trainer preset is the first stop
    (CPU[:2], [], "the `gnnlm fit` config configs/trainer/gpu.yaml + "
                  "configs/wikitext2/base_lm.yaml " + TRAINER_ADVICE),
])
def test_a_gpu_setting_on_a_machine_without_one(config, flags, message, no_gpu, tmp_path,
                                                capsys):
    assert refused(tmp_path, capsys, *flags, config=config) == message


def test_gpu_settings_are_checked_by_availability(monkeypatch):
    """The same settings load where torch and faiss see a GPU; commands that only read the
    pipeline's results (``gnnlm sweep``) load them anywhere."""
    gpu_flags = ["--features.device=cuda", "--index.device=cuda",
                 f"--gnn.config={json.dumps(GPU_GNN)}"]
    load_config([*CPU, *gpu_flags])                                    # without machine checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gnnlm.utils.devices, "faiss_has_gpu", lambda: True)
    cfg = load_config([*CPU[:2], *gpu_flags], machine=True)
    assert cfg.features.device == cfg.index.device == "cuda"


ONE_PROCESS_ADVICE = ("but the pipeline trains each part in the process that runs it: set "
                      "trainer.devices: 1 and num_nodes: 1 there. A base LM trained under DDP by "
                      "`gnnlm fit` (--trainer.strategy=ddp --trainer.devices=N) joins the "
                      "pipeline as base_lm.ckpt.")


def trainer_overlay(tmp_path, chain: list[str], **trainer) -> list[str]:
    """``chain`` with one more YAML setting ``trainer``'s fields."""
    overlay = tmp_path / "trainer.yaml"
    overlay.write_text(json.dumps({"trainer": trainer}))  # (JSON is YAML)
    return [*chain, str(overlay)]


@pytest.mark.parametrize("trainer", [{"devices": 2, "strategy": "ddp"}, {"num_nodes": 2}])
def test_a_trained_part_on_several_processes(trainer, tmp_path, capsys):
    """Lightning's DDP launcher would start the whole ``gnnlm pipeline`` command again on
    every other rank, each running the stages before that fit in the same work directory (on
    the old code two base LMs raced on one build folder): refused when the config loads."""
    chain = trainer_overlay(tmp_path, GNN, **trainer)
    assert refused(tmp_path, capsys, f"--gnn.config={json.dumps(chain)}") == (
        f"the `gnnlm fit` config {' + '.join(chain)} trains on 2 processes (trainer.devices × "
        f"trainer.num_nodes), " + ONE_PROCESS_ADVICE)


def test_a_gpu_trainer_on_every_gpu_the_machine_has(monkeypatch, tmp_path, capsys):
    """``devices: auto`` trains on every GPU torch sees: it loads where there is one GPU and
    is refused where there are two."""
    chain = trainer_overlay(tmp_path, GPU_GNN, devices="auto")
    flag = f"--gnn.config={json.dumps(chain)}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    load_config([*CPU, flag], machine=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert refused(tmp_path, capsys, flag) == (
        f"the `gnnlm fit` config {' + '.join(chain)} trains on 2 processes (trainer.devices × "
        f"trainer.num_nodes), " + ONE_PROCESS_ADVICE)


def test_devices_lightning_refuses_are_refused_at_load(tmp_path, capsys):
    chain = trainer_overlay(tmp_path, GNN, devices=0)
    assert refused(tmp_path, capsys, f"--gnn.config={json.dumps(chain)}") == (
        f"the `gnnlm fit` config {' + '.join(chain)} sets trainer.devices: 0, which Lightning "
        f"refuses: `devices` selected with `CPUAccelerator` should be an int > 0.")


@pytest.fixture
def checkpoint(tmp_path):
    """A `gnnlm fit` checkpoint of a tiny LM: context 16, 16 wide."""
    return save_lm_checkpoint(tmp_path / "lm.ckpt", vocab_size=7)[0]


@pytest.mark.parametrize("flags,message", [
    (["--features.context=256"],  # the CPU base LM is trained here: its YAMLs say 128
     f"features.context = 256 exceeds the context of the base LM of base_lm.config ({BASE_LM}), "
     f"128 tokens: lower it to at most 128, or leave it unset for the model's own."),
    (["--features.context=null", "--features.stride=200"],
     f"features.stride = 200 exceeds the context of the base LM of base_lm.config ({BASE_LM}), "
     f"128 tokens: windows would skip tokens; lower the stride to at most 128, or leave it "
     f"unset for half the context."),
    (["--features.context=64", "--features.stride=100"],
     "features.stride = 100 exceeds features.context = 64: windows would skip tokens; lower "
     "the stride to at most the context."),
    (["--features.stride=0"], "features.stride (tokens between window starts) must be >= 1 "
                              "(got 0): leave it unset for half the context."),
])
def test_feature_windows_beyond_a_trained_base_lm(flags, message, tmp_path, capsys):
    assert refused(tmp_path, capsys, *flags) == message


@pytest.mark.parametrize("flags,message", [
    (["--features.context=32", "--features.stride=8"],
     "features.context = 32 exceeds the context of base_lm.ckpt {ckpt}, 16 tokens: lower it to "
     "at most 16, or leave it unset for the model's own."),
    (["--features.context=null", "--features.stride=40"],
     "features.stride = 40 exceeds the context of base_lm.ckpt {ckpt}, 16 tokens: windows would "
     "skip tokens; lower the stride to at most 16, or leave it unset for half the context."),
    (["--features.context=16", "--features.stride=8", "--index.factory=PQ5"],
     "index.factory = 'PQ5' cannot index the base LM's 16-dimensional keys under knn.metric = "
     "'cos' (The dimension of the vector (d) should be a multiple of the number of "
     "subquantizers (M)): " + FACTORY_ADVICE),
])
def test_settings_beyond_a_checkpoint(flags, message, checkpoint, tmp_path, capsys):
    assert refused(tmp_path, capsys, f"--base_lm.ckpt={checkpoint}", *flags) == message.format(
        ckpt=checkpoint)


@pytest.fixture
def hf_folder(tmp_path):
    """A Hugging Face folder as far as the load-time checks read it: its config.json."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 2048,
                                                    "n_embd": 32}))
    return folder


@pytest.mark.parametrize("flags,message", [
    (["--features.context=4096"], "features.context = 4096 exceeds the context of base_lm.ckpt "
                                  "hf:{folder}, 2048 tokens: lower it to at most 2048, or leave "
                                  "it unset for the model's own."),
    # unset, the context is 1,024 tokens for a Hugging Face model, not its own 2,048
    (["--features.context=null", "--features.stride=1500"],
     "features.stride = 1500 exceeds the default features.context for a Hugging Face model, "
     "1024 tokens: windows would skip tokens; lower the stride to at most 1024, or leave it "
     "unset for half the context."),
])
def test_settings_beyond_a_hugging_face_model(flags, message, hf_folder, tmp_path, capsys):
    line = refused(tmp_path, capsys, f"--base_lm.ckpt=hf:{hf_folder}", "--corpus.name=x",
                   "--corpus.tokenizer.kind=hf", *flags)
    assert line == message.format(folder=hf_folder)


def test_a_rebuild_of_a_stage_that_does_not_exist(tmp_path, capsys):
    line = refused(tmp_path, capsys, "--rebuild=[featurs]")
    assert re.fullmatch(r"--rebuild names stages \[.*'features'.*'neighbors'.*\] "
                        r"\(got \['featurs'\]\)\.", line), line


def test_a_base_lm_with_neither_checkpoint_nor_config(tmp_path, capsys):
    assert refused(tmp_path, capsys, "--base_lm.config=null") == (
        "base_lm needs `ckpt` (a checkpoint or hf:<name>) or `config` (the `gnnlm fit` YAMLs to "
        "train one).")


@pytest.mark.parametrize("flag,read,searched", [
    ("--knn.keys=[att]", "key = 'final'", "knn.keys[0] = 'att' under knn.metric = 'cos'"),
    ("--knn.metric=l2", "metric = 'cos'", "knn.keys[0] = 'final' under knn.metric = 'l2'"),
])
def test_a_head_that_reads_neighbours_the_pipeline_does_not_search(flag, read, searched, tmp_path,
                                                                    capsys):
    line = refused(tmp_path, capsys, flag)
    assert line.startswith(f"the gnn config ({' + '.join(GNN)}) reads the neighbours of "), line
    assert read in line and line.endswith(f"searches train neighbours for {searched}."), line


def test_a_corpus_other_than_the_base_lm_config_s(tmp_path, capsys):
    line = refused(tmp_path, capsys, "--corpus.name=wikitext-103")
    assert line == (
        "The pipeline's corpus.name = 'wikitext-103' (the command line) and its base LM config's "
        "data.init_args.corpus = 'wikitext-2' (configs/wikitext2/base_lm.yaml) name different "
        "corpora: the base LM would be trained on one and the datastore built from the other. "
        "Name the corpus once: in the pipeline's corpus section (passed to the base LM's "
        "training) or in the base LM config's data section.")
