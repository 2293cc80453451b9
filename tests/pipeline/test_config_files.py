"""gnnlm.pipeline.config_files: a fit config as one YAML or a list, each file's text refused in
one line naming it, and several files merged key by key as LightningCLI merges them (the
messages through the command line are in tests/test_errors_cli.py)."""
from __future__ import annotations

import pytest

from gnnlm.pipeline.config_files import config_text, merged_texts, merged_yaml, yaml_list


def test_a_fit_config_is_one_yaml_or_a_base_and_its_overlays():
    assert yaml_list(None) == []
    assert yaml_list("configs/a.yaml") == ["configs/a.yaml"]
    assert yaml_list(("a.yaml", "b.yaml")) == ["a.yaml", "b.yaml"]


def test_the_text_is_returned_as_written(tmp_path):
    text = "# the base LM\nmodel:\n  d_model: 8   # small\n"
    (tmp_path / "lm.yaml").write_text(text)
    assert config_text(tmp_path / "lm.yaml") == text


def test_a_folder_or_a_missing_file_is_refused_naming_it(tmp_path, monkeypatch):
    with pytest.raises(IsADirectoryError, match=rf"^Config file {tmp_path} is a folder: give a "):
        config_text(tmp_path)
    with pytest.raises(FileNotFoundError) as absolute:
        config_text(tmp_path / "none.yaml")
    assert str(absolute.value) == (
        f"Config file {tmp_path / 'none.yaml'} does not exist: check the path.")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as relative:
        config_text("configs/none.yaml")
    # a relative path names the folder it was looked for in
    assert str(relative.value).startswith(
        f"Config file configs/none.yaml does not exist (paths are resolved against the current "
        f"directory, {tmp_path}): ")


@pytest.mark.parametrize("content,message", [
    (b"model:\n  name: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 18): save it as UTF-8."),
    (b"model:\n  a: 1\n   b: 2\n", "is not valid YAML: mapping values are not allowed here "
                                  "(line 3, column 5). Fix the file at that line"),
    (b"", "is empty (or only comments): write its settings in it, or leave it out."),
    (b"# model:\n", "is empty (or only comments)"),
    (b"- model\n", "holds a YAML list, not settings"),
    (b"3\n", "holds a YAML int, not settings"),
])
def test_a_file_that_holds_no_settings_is_refused_in_one_line(content, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        config_text(path)
    assert str(err.value).startswith(f"Config file {path} {message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_later_files_win_key_by_key(tmp_path):
    base = ("model:\n  d_model: 8\n  layers: [1, 2]\n  optim: {lr: 0.1, wd: 0.0}\n"
            "trainer: {max_steps: 5}\n")
    overlay = "model:\n  layers: [3]\n  optim: {lr: 0.01}\ndata: {batch_size: 2}\n"
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "overlay.yaml").write_text(overlay)
    merged = merged_yaml([str(tmp_path / "base.yaml"), str(tmp_path / "overlay.yaml")])
    # nested mappings merge; a list or a scalar is replaced whole
    assert merged == {"model": {"d_model": 8, "layers": [3], "optim": {"lr": 0.01, "wd": 0.0}},
                      "trainer": {"max_steps": 5}, "data": {"batch_size": 2}}
    assert merged_yaml([str(tmp_path / "overlay.yaml"), str(tmp_path / "base.yaml")])["model"] == (
        {"d_model": 8, "layers": [1, 2], "optim": {"lr": 0.1, "wd": 0.0}})
    assert merged_yaml([]) == {}


def test_a_value_replaces_a_mapping_and_a_mapping_a_value():
    assert merged_texts(["a: {b: 1}\n", "a: null\n"]) == {"a": None}
    assert merged_texts(["a: 1\n", "a: {b: 1}\n"]) == {"a": {"b": 1}}
    # an empty text (as an older manifest may have recorded one) adds nothing
    assert merged_texts(["a: 1\n", "", "# note\n"]) == {"a": 1}


def test_merging_reads_every_file_through_the_same_checks(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {d_model: 8}\n")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match=rf"Config file {tmp_path / 'empty.yaml'} is empty"):
        merged_yaml([str(tmp_path / "base.yaml"), str(tmp_path / "empty.yaml")])
