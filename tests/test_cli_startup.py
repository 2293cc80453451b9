"""``gnnlm --help``, a mistyped command and the help of every command answer at once: they load
none of torch, Lightning, faiss or transformers (the LightningCLI part is imported only when
``fit``/``validate``/``test``/``predict`` runs; ``pipeline``, ``sweep`` and ``explain`` answer
their help from the config's modules, ``gnnlm.pipeline.arguments``, before importing their own).
How fast that is, is measured by ``benchmarks/bench_cli_help.py``."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gnnlm.pipeline.arguments import COMMANDS as CONFIG_COMMANDS
from gnnlm.pipeline.arguments import answer_help

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pytorch_lightning", "lightning", "faiss", "transformers", "torchmetrics")

# the ``gnnlm`` entry point in a fresh interpreter; prints the heavy modules it loaded
PROBE = textwrap.dedent(f"""
    import json, sys
    from gnnlm.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
""")


@pytest.mark.parametrize("args, shown", [
    (["--help"], "usage: gnnlm COMMAND"),
    (["frobnicate"], "gnnlm frobnicate: error: unknown command 'frobnicate'"),
    (["pipeline", "--help"], "usage: gnnlm pipeline -c CONFIG"),
    (["pipeline", "-h"], "usage: gnnlm pipeline -c CONFIG"),
    (["pipeline", "--help=knn"], "knn: kNN-LM"),
    (["sweep", "--help", "knn"], "knn: kNN-LM"),
    (["explain", "--help"], "--text TEXT"),
    (["explain", "--help-all"], "usage: gnnlm explain [-c CONFIG]"),
    (["score", "--help"], "usage: gnnlm score"),
    (["generate", "-h"], "usage: gnnlm generate"),
    (["verify", "--help"], "usage: gnnlm verify"),
])
def test_help_and_an_unknown_command_load_no_heavy_library(args, shown):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    assert shown in out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def printed(run, args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        run(args)
    assert stop.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--help=knn"], ["--help", "features"],
                                  ["--help-all"], ["-c", "configs/wikitext2/pipeline.yaml", "-h"]])
def test_the_help_without_the_command_is_the_commands_own(command, args, capsys, monkeypatch):
    """The help answered before the command's module is imported is, word for word, the one its
    own parser prints (its description, its options besides the config's)."""
    monkeypatch.chdir(REPO)
    light = printed(lambda words: answer_help(command, words), args, capsys)
    own = printed(importlib.import_module(CONFIG_COMMANDS[command][0]).main, args, capsys)
    assert light == own
    assert light.startswith((f"usage: gnnlm {command}", "knn: ", "features: "))


# the ``gnnlm`` entry point in a fresh interpreter; prints its exit status and the heavy
# modules it loaded
EXIT_PROBE = textwrap.dedent(f"""
    import json, sys
    from gnnlm.cli import main
    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as stop:
        code = stop.code
    print(json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))
""")


@pytest.mark.parametrize("args,line", [
    (["score", "{missing}", "--text", "a"],
     "gnnlm score: error: {missing} does not exist: give the work directory a `gnnlm pipeline` "
     "run built (its config's `workdir`)."),
    (["score", "{empty}", "--text", "a"], "gnnlm score: error: {empty} is not a built gnnlm "
                                          "work directory"),
    (["generate", "{missing}", "--prompt", "a", "--row", "gnn"], "gnnlm generate: error: "
                                                                  "{missing} does not exist"),
    (["generate", "{missing}", "--prompt", "a", "--greedy", "--temperature", "0.7"],
     "gnnlm generate: error: greedy decoding takes the most likely token: leave temperature, "
     "top_k and top_p unset, or sample (greedy off)."),
    # once torch's "probability tensor contains either inf, nan or element < 0"
    (["generate", "{missing}", "--prompt", "a", "--temperature", "1e-40"],
     "gnnlm generate: error: temperature must be at least 1.18e-38, the smallest float32 the "
     "log-probabilities can be divided by (got 1e-40); as the temperature falls to 0, sampling "
     "becomes greedy decoding (greedy on)."),
    # the corpus reader's checks (each was told to `iconv -f latin1`, or scored: UTF-16LE)
    (["score", "{missing}", "--file", "{gzip}"],
     "gnnlm score: error: {gzip} is not text: it is gzip-compressed (it begins with "
     "b'\\x1f\\x8b'): decompress it first (gunzip)."),
    (["score", "{missing}", "--file", "{bom}"],
     "gnnlm score: error: {bom} is UTF-16 text: convert it to UTF-8 (e.g. iconv -f utf-16 -t "
     "utf-8)."),
    (["score", "{missing}", "--file", "{utf16le}"],
     "gnnlm score: error: {utf16le} is UTF-16 text without a byte-order mark (UTF-16LE): "
     "convert it to UTF-8 (e.g. iconv -f utf-16le -t utf-8)."),
    (["score", "{missing}", "--file", "{binary}"],
     "gnnlm score: error: {binary} is not text: it holds a NUL byte at offset 5 (it begins with "
     "b'\\x01\\x02\\x03\\x04\\x05\\x00\\x00\\x00'): give a plain text file to score."),
])
def test_score_and_generate_answer_what_needs_no_model_without_torch(args, line, tmp_path):
    """Errors in the options, the text and the work directory are one line, exit status 2,
    before torch is imported (once 7-10 s on two cores: torch loaded first)."""
    import gzip

    text = "The game was released in Japan in 2011 .\n"
    files = {"gzip": gzip.compress(text.encode()), "bom": text.encode("utf-16"),
             "utf16le": text.encode("utf-16-le"), "binary": bytes([1, 2, 3, 4, 5, 0, 0, 0])}
    names = {"missing": str(tmp_path / "nowhere"), "empty": str(tmp_path / "empty")}
    (tmp_path / "empty").mkdir()
    for name, content in files.items():
        names[name] = str(tmp_path / f"{name}.txt")
        (tmp_path / f"{name}.txt").write_bytes(content)
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, *(a.format(**names) for a in args)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    code, heavy = json.loads(out.stdout.splitlines()[-1])
    assert (code, heavy) == (2, [])
    errors = out.stderr.splitlines()
    assert errors[0].startswith(line.format(**names)) and len(errors) == 2, errors
