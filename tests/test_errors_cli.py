"""What the `gnnlm` command line says when it is given something wrong: one line naming the
file, the checkpoint or the command that is wrong and what to do (exit status 2), no usage
dump, nothing created; and a `--help` short enough to read."""
from __future__ import annotations

import os

import pytest
import torch

from gnnlm.cli import USAGE, main
from gnnlm.workdir.rows import HEAD_FIELDS
from tests.conftest import CPU, LM, REPO
from tests.fakes import error_of

pytestmark = pytest.mark.usefixtures("in_repo")


def lm_test(tmp_path, capsys, ckpt):
    return error_of(["test", *LM, f"--ckpt_path={ckpt}",
                     f"--data.init_args.workdir={tmp_path / 'work'}",
                     f"--trainer.default_root_dir={tmp_path / 'logs'}"], capsys)


def test_a_checkpoint_of_another_model_is_named_before_anything_runs(tmp_path, capsys):
    ckpt = tmp_path / "gnn.ckpt"
    torch.save({"state_dict": {"gnn.w": torch.zeros(2)}, "pytorch-lightning_version": "2.6.0",
                "hyper_parameters": {"_class_path": "gnnlm.lit.gnn.GNNLM", "feature_dim": 8},
                "datamodule_hyper_parameters": {"_class_path": "datamodules.graph.GraphDataModule",
                                                "workdir": "runs/x"}}, ckpt)
    assert lm_test(tmp_path, capsys, ckpt) == (
        f"gnnlm test: error: {ckpt} is a gnnlm.lit.gnn.GNNLM checkpoint (trained on "
        f"datamodules.graph.GraphDataModule) but the config builds gnnlm.lit.lm.LanguageModel "
        f"on datamodules.lm.LMDataModule: give the -c configs it was trained with (the "
        f"config.yaml beside its Lightning logs holds them), or a checkpoint of LanguageModel.")
    assert sorted(os.listdir(tmp_path)) == ["gnn.ckpt"]                 # no tokens, no logs


class ShellPayload:
    def __reduce__(self):
        return os.system, ("true",)


@pytest.mark.parametrize("content,reason", [
    (b"not a checkpoint\n",
     "it is not a PyTorch checkpoint (neither the zip archive nor the pickle that torch.save "
     "writes; it begins with b'not a ch'). Give a .ckpt written by `gnnlm fit`."),
    ("payload",
     "it pickles posix.system, which is neither a tensor nor plain data: unpickling it would "
     "import and call it. Give a .ckpt written by `gnnlm fit`."),
    ("truncated",
     "its zip archive is truncated or corrupt (the file was not written to the end, or was "
     "damaged in a copy). Copy it again, or train it again with `gnnlm fit`."),
])
def test_a_checkpoint_that_is_not_plain_data_says_what_it_is_not(content, reason, tmp_path,
                                                                 capsys):
    ckpt = tmp_path / "model.ckpt"
    if content == "payload":
        torch.save({"state_dict": {}, "callbacks": ShellPayload()}, ckpt)
    elif content == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(64)}}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:300])
    else:
        ckpt.write_bytes(content)
    line = lm_test(tmp_path, capsys, ckpt)
    assert line == f"gnnlm test: error: Refusing to load {ckpt}: {reason}"
    assert "weights_only" not in line


BAD_YAML = "model:\n  class_path: gnnlm.lit.lm.LanguageModel\n   init_args: {}\n"
YAML_ERROR = ("is not valid YAML: mapping values are not allowed here (line 3, column 13). Fix "
              "the file at that line (YAML indents with spaces; quote a value holding ': ' or "
              "' #').")


@pytest.mark.parametrize("command", ["fit", "pipeline"])
def test_a_yaml_syntax_error_names_the_file_and_the_line(command, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    assert error_of([command, "-c", str(tmp_path / "bad.yaml")], capsys) == (
        f"gnnlm {command}: error: Config file {tmp_path / 'bad.yaml'} {YAML_ERROR}")


@pytest.mark.parametrize("command", ["fit", "pipeline"])
@pytest.mark.parametrize("text,message", [
    ("", "is empty (or only comments): write its settings in it, or leave it out."),
    ("# trainer:\n#   max_steps: 3\n",
     "is empty (or only comments): write its settings in it, or leave it out."),
    ("- trainer\n", "holds a YAML list, not settings: a config maps sections to their values "
                    "(`section:` lines, the values indented under them)."),
])
def test_an_overlay_with_no_settings_names_the_file(command, text, message, tmp_path, capsys):
    """jsonargparse would say only "Unexpected config:"."""
    (tmp_path / "empty.yaml").write_text(text)
    configs = LM if command == "fit" else CPU
    assert error_of([command, *configs, "-c", str(tmp_path / "empty.yaml")], capsys) == (
        f"gnnlm {command}: error: Config file {tmp_path / 'empty.yaml'} {message}")
    assert sorted(os.listdir(tmp_path)) == ["empty.yaml"]


def test_a_yaml_syntax_error_in_a_fit_config_of_the_pipeline(tmp_path, capsys):
    (tmp_path / "gnn.yaml").write_text(BAD_YAML)
    assert error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     f"--gnn.config={tmp_path / 'gnn.yaml'}"], capsys) == (
        f"gnnlm pipeline: error: Config file {tmp_path / 'gnn.yaml'} {YAML_ERROR}")
    assert not (tmp_path / "w").exists()


def cwd_message(path, cwd) -> str:
    return (f"Config file {path} does not exist (paths are resolved against the current "
            f"directory, {cwd}): run gnnlm from the folder the path is relative to (the "
            f"repository root for configs/...), or give an absolute path.")


@pytest.mark.parametrize("command,configs", [("pipeline", CPU), ("fit", LM)])
def test_a_relative_config_path_from_another_folder(command, configs, tmp_path, monkeypatch,
                                                    capsys):
    monkeypatch.chdir(tmp_path)
    assert error_of([command, *configs], capsys) == (
        f"gnnlm {command}: error: {cwd_message(configs[1], tmp_path)}")


def test_a_missing_fit_config_listed_by_the_pipeline(tmp_path, capsys):
    assert error_of(["pipeline", *CPU, f"--workdir={tmp_path / 'w'}",
                     "--spalm.config=[configs/trainer/cpu.yaml,configs/nowhere.yaml]"],
                    capsys) == (
        f"gnnlm pipeline: error: {cwd_message('configs/nowhere.yaml', REPO)}")


@pytest.mark.parametrize("args,message", [
    (["fit", "-c", "configs/trainer/cpu.yaml", "--trainer.max_stepz=3"],
     "gnnlm fit: error: unrecognized arguments: --trainer.max_stepz=3"),
    (["fit", *LM, "--model.init_args.n_layr=2"],
     "gnnlm fit: error: model.init_args has no key 'n_layr' (LanguageModel): did you mean "
     "n_layer?"),
    (["fit", "-c", "configs/trainer/cpu.yaml"],
     "gnnlm fit: error: the following arguments are required: fit.data, fit.model: give the "
     "configs that set them with -c, e.g. -c configs/trainer/cpu.yaml -c "
     "configs/wikitext2/base_lm.yaml (each YAML in configs/ starts with the command that runs "
     "it)."),
    (["fitt", *LM],
     "gnnlm fitt: error: unknown command 'fitt': the commands are pipeline, sweep, explain, "
     "verify, score, generate, reproduce, fit, validate, test, predict (gnnlm --help)."),
])
def test_a_fit_command_line_error_is_one_line_without_the_usage(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [message, "(rerun with --debug for the traceback)"]
    assert "usage" not in captured.out


def test_sweep_on_an_unbuilt_work_directory_names_the_pipeline_and_creates_nothing(tmp_path,
                                                                                  capsys):
    wd = tmp_path / "w"
    assert error_of(["sweep", *CPU, f"--workdir={wd}"], capsys) == (
        f"gnnlm sweep: error: `gnnlm sweep` reads what `gnnlm pipeline` builds, and "
        f"{wd}/knn_cache/final-cos-faiss/valid is not built yet: run `gnnlm pipeline -c "
        f"configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml "
        f"--workdir={wd}` first (the same configs), then `gnnlm sweep` again.")
    assert not wd.exists()


def test_explain_on_an_unbuilt_work_directory_names_the_pipeline_and_creates_nothing(tmp_path,
                                                                                    capsys):
    wd = tmp_path / "w"
    assert error_of(["explain", *CPU, "--text", "In 2000 Boulter had", f"--workdir={wd}",
                     "--top=2"], capsys) == (
        f"gnnlm explain: error: `gnnlm explain` reads what `gnnlm pipeline` builds, and "
        f"{wd}/models/base_lm is not built yet: run `gnnlm pipeline -c "
        f"configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml "
        f"--workdir={wd}` first (the same configs), then `gnnlm explain` again.")
    assert not wd.exists()


@pytest.mark.parametrize("config", [CPU, ["-c", "configs/examples/own_corpus/pipeline.yaml",
                                          "--corpus.path=null", "--corpus.name=wikitext-2"]])
def test_a_run_without_gnnlm_data_stops_before_loading_anything(config, tmp_path):
    """No GNNLM_DATA, online as the environment says, and the Hub not answering (nothing
    listens on its port): the run once trained or loaded its base LM, then the Hub's client
    retried five times. Now the config's load says it, in one line, and nothing is made."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("GNNLM_DATA", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(GNNLM_CACHE=str(tmp_path / "cache"), HF_ENDPOINT="http://127.0.0.1:9",
               HF_HOME=str(tmp_path / "hf"))
    wd = tmp_path / "w"
    out = subprocess.run([sys.executable, "-m", "gnnlm.cli", "pipeline", *config,
                          f"--workdir={wd}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2
    line, rerun = out.stderr.strip().splitlines()  # no retries, no model's lines
    assert line.startswith(f"gnnlm pipeline: error: Corpus 'wikitext-2' not found. Looked in: "
                           f"$GNNLM_DATA (not set); {tmp_path / 'cache' / 'wikitext-2'}; Hugging "
                           f"Face datasets ('Salesforce/wikitext', 'wikitext-2-v1') (the Hub is "
                           f"not reachable: http://127.0.0.1:9: "), line
    assert rerun == "(rerun with --debug for the traceback)"
    assert not wd.exists() and not (tmp_path / "cache").exists()


SECTIONS = ["name", "workdir", "base_lm", "corpus", "features", "index", "neighbors", "knn", "pq",
            *HEAD_FIELDS, "ablations", "rebuild", "copy_report_to"]


def help_of(args, capsys) -> list[str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code in (0, None)
    return capsys.readouterr().out.rstrip("\n").splitlines()


@pytest.mark.parametrize("command", ["pipeline", "sweep", "explain"])
def test_help_lists_every_section_in_one_line(command, capsys):
    lines = help_of([command, "--help"], capsys)
    assert len(lines) < 60
    assert all(len(line) <= 100 for line in lines)
    described = {line.split()[0]: line for line in lines if line.startswith("  ")
                 and not line.startswith("   ") and line.split()[0] in SECTIONS}
    assert sorted(described) == sorted(SECTIONS)
    # each description fits on its own line: the next line is another section or blank
    for i, line in enumerate(lines):
        if line in described.values():
            after = lines[i + 1]
            assert after == "" or after.split()[0] in SECTIONS, (line, after)
    assert "--help=SECTION" in "\n".join(lines) and "--help-all" in "\n".join(lines)


def test_help_of_a_section_shows_its_fields_and_whole_sentences(capsys):
    lines = help_of(["pipeline", "--help=features"], capsys)
    text = "\n".join(lines)
    assert lines[0].startswith("features: ")
    assert all(len(line) <= 100 for line in lines)
    for name in ("context", "stride", "batch_size", "device", "max_tokens", "devices"):
        assert f"\n  {name} " in text
    # the docstring is reflowed, not cut at its first line
    assert "at most 1,024 tokens for a Hugging Face model" in " ".join(text.split())


def test_full_help_and_the_pointers_to_it(capsys):
    assert len(help_of(["pipeline", "--help-all"], capsys)) > 100
    usage = " ".join(USAGE.split())
    assert "`gnnlm pipeline --help`" in usage and "`--help=SECTION`" in usage
    assert "`gnnlm fit --help` is LightningCLI's" in usage


def test_an_unknown_help_section(capsys):
    assert error_of(["pipeline", "--help=featurs"], capsys) == (
        "gnnlm pipeline: error: gnnlm pipeline has no section 'featurs': the sections are "
        + ", ".join(SECTIONS) + ".")

