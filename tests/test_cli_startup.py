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
