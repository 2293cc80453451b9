"""The README's own-corpus example, as written: its command and configs on a folder of
train/valid/test.txt (a WikiText-2 slice standing in for the user's corpus), with the base LM
trained by the pipeline on that folder and kNN-LM over it; then ``gnnlm score`` on the
corpus's own test file prints the report's test perplexities."""
from __future__ import annotations

import json
import math
import shlex

import pytest
from conftest import REPO, run_gnnlm

from gnnlm.workdir.checkpoints import datamodule_args, load_checkpoint

EXAMPLE = "configs/examples/own_corpus/pipeline.yaml"


def readme_command() -> list[str]:
    """The example's command in README.md's section "Your own corpus and base LM"."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Your own corpus and base LM\n", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in section.splitlines()
                if line.strip().startswith(f"gnnlm pipeline -c {EXAMPLE}")]
    assert len(commands) == 1, commands
    return shlex.split(commands[0])


def test_the_readme_runs_the_example_config_with_the_command_its_first_line_names():
    first = (REPO / EXAMPLE).read_text().splitlines()[0]
    assert shlex.split(first.removeprefix("# ")) == readme_command()


@pytest.mark.integration
def test_the_own_corpus_example_runs_as_the_readme_says(wikitext_root, tmp_path):
    corpus = tmp_path / "my-corpus"                        # the user's own folder
    corpus.mkdir()
    for split, lines in (("train", 1500), ("valid", 150), ("test", 150)):
        text = (wikitext_root / "wikitext-2" / f"{split}.txt").read_text()
        (corpus / f"{split}.txt").write_text("\n".join(text.split("\n")[:lines]) + "\n")
    cwd = tmp_path / "run"
    cwd.mkdir()
    (cwd / "configs").symlink_to(REPO / "configs")
    command = readme_command()
    paths = [i for i, arg in enumerate(command) if arg.startswith("--corpus.path=")]
    assert command[:2] == ["gnnlm", "pipeline"] and len(paths) == 1
    command[paths[0]] = f"--corpus.path={corpus}"
    run_gnnlm(command[1:], cwd, timeout=900)

    work = cwd / "runs" / "my-corpus"
    results = json.loads((work / "reports" / "my-corpus" / "results.json").read_text())
    assert (work / "reports" / "my-corpus" / "results.md").is_file()
    ppl = results["ppl"]
    assert math.isfinite(ppl["base"]) and math.isfinite(ppl["knn"]) and ppl["base"] > 1
    # a tiny LM trained for 80 steps; the datastore is the same domain (measured: 167 -> 144 on
    # a 2,000-line slice)
    assert ppl["knn"] < 1.02 * ppl["base"]
    tokens = json.loads((work / "tokens" / "manifest.json").read_text())
    assert tokens["sources"] == {s: str(corpus / f"{s}.txt") for s in ("train", "valid", "test")}
    assert tokens["config"]["tokenizer"] == {"kind": "word", "max_vocab": 5000}
    # the base LM was trained on the user's folder (the pipeline's corpus section), and its
    # checkpoint records the vocabulary the datastore's tokens have
    ckpt = work / "models" / "base_lm" / "model.ckpt"
    assert datamodule_args(ckpt)["corpus_path"] == str(corpus)
    saved = load_checkpoint(ckpt)["hyper_parameters"]["vocab_fingerprint"]
    assert saved == tokens["vocab_fingerprint"]
    # the test file, scored as any text, is the report's test split
    scored = json.loads(run_gnnlm(["score", str(work), "--file", str(corpus / "test.txt"),
                                   "--json"], cwd).stdout)
    assert scored["tokens"] == results["tokens"]
    assert {row: s["ppl"] for row, s in scored["rows"].items()} == pytest.approx(ppl, rel=1e-6)
