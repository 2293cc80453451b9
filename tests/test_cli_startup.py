"""``gnnlm --help`` and a mistyped command answer at once: they load neither torch nor Lightning
(the LightningCLI part is imported only when ``fit``/``validate``/``test``/``predict`` runs)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# the ``gnnlm`` entry point in a fresh interpreter; prints the heavy modules it loaded
PROBE = textwrap.dedent("""
    import json, sys
    from gnnlm.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    print(json.dumps(sorted(m for m in ("torch", "pytorch_lightning") if m in sys.modules)))
""")


@pytest.mark.parametrize("args, shown", [
    (["--help"], "usage: gnnlm COMMAND"),
    (["frobnicate"], "gnnlm frobnicate: error: unknown command 'frobnicate'"),
])
def test_help_and_an_unknown_command_load_neither_torch_nor_lightning(args, shown):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    assert shown in out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
