"""The records beside every result: the machine and versions (``gnnlm.utils.environment``), the
code (``gnnlm.utils.provenance``) and this run's wall time of each stage
(``gnnlm.pipeline.stage_times``)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.torch_version import TorchVersion

from gnnlm.pipeline.stage_times import StageTimes, timed
from gnnlm.utils import cpu_kernels, environment, provenance
from tests.conftest import REPO


def test_describe_names_the_device_and_the_installed_versions():
    env = environment.describe()
    assert env["torch"] == torch.__version__ and env["numpy"] == np.__version__
    assert env["device"] == ("cpu" if not torch.cuda.is_available()
                             else torch.cuda.get_device_name(0))
    assert "cores)" in env["cpu"]
    line = environment.one_line(env)
    assert f"torch {torch.__version__}" in line and "\n" not in line


def test_torch_is_named_by_its_build_where_its_metadata_drops_the_tag(monkeypatch):
    """A CUDA wheel from PyPI records ``2.11.0`` in its metadata while torch reports
    ``2.11.0+cu130``: the record keeps torch's own string, which names the build, as a plain
    ``str`` (``TorchVersion`` is one that YAML's safe dumper refuses)."""
    metadata = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: (
        "2.11.0" if name == "torch" else metadata(name)))
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    env = environment.describe()
    assert env["torch"] == "2.11.0+cu130" and type(env["torch"]) is str
    assert "torch 2.11.0+cu130" in environment.one_line(env)


def test_a_missing_package_is_named_and_fails(capsys):
    assert environment.main(["--require", "json,no_such_package_here"]) == 1
    assert capsys.readouterr().err.startswith("missing Python packages: no_such_package_here;")
    assert environment.main(["--require", "json"]) == 0
    assert capsys.readouterr().out.strip() == environment.one_line(environment.describe())


def test_stages_are_timed_only_inside_a_timed_run_and_only_when_they_finish(tmp_path):
    with timed("outside"):  # a stage called on its own records nothing, and does not fail
        pass
    times = StageTimes()
    with times.running():
        with timed("first"):
            pass
        with pytest.raises(ValueError), timed("failed"):
            raise ValueError("stops the run")
        with timed("second"):
            sum(range(10_000))
    assert [s["stage"] for s in times.stages] == ["first", "second"]
    with timed("after"):  # the run is over: nothing more is recorded
        pass
    record = times.write(tmp_path, {"device": "cpu"})
    assert json.loads((tmp_path / "stage_times.json").read_text()) == record
    assert record["environment"] == {"device": "cpu"} and len(record["stages"]) == 2
    assert record["made_by"] == provenance.code_version()
    assert record["total_seconds"] >= sum(s["seconds"] for s in record["stages"])


def test_code_version_names_the_checkout_s_commit_and_its_changes():
    provenance.code_version.cache_clear()
    made_by = provenance.code_version()

    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert made_by == {"gnnlm": importlib.metadata.version("gnnlm"),
                       "commit": git("rev-parse", "HEAD"),
                       "dirty": bool(git("status", "--porcelain"))}


def test_a_folder_that_is_not_a_checkout_s_top_has_no_commit(tmp_path):
    """gnnlm installed into a virtual environment inside some project's checkout is not that
    project's code: only the checkout whose top folder holds the package counts."""
    assert provenance._checkout(REPO / "gnnlm") == (None, None)
    assert provenance._checkout(tmp_path) == (None, None)


def test_the_kernel_path_and_its_pins_are_recorded_in_the_process_that_ran():
    """Two CPUs of one name and one stack run other kernels when one has AVX-512: the record
    says which path torch ran and which variables pinned it, as the run's own process saw it."""
    script = ("import json; from gnnlm.utils import environment as e; "
              "print(json.dumps(e.describe()['cpu_kernels']))")
    pins = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    # (a machine's own environment may pin a library already, e.g. OPENBLAS_CORETYPE)
    unpinned_env = {k: v for k, v in os.environ.items() if k not in cpu_kernels.PINS}
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**unpinned_env, **pins}, cwd=REPO)
    kernels = json.loads(ran.stdout)
    assert kernels["torch_capability"] == "DEFAULT" and kernels["pinned"] == pins
    assert kernels["blas"] and kernels["threads"] >= 1
    unpinned = environment.describe()["cpu_kernels"]
    assert unpinned["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "DEFAULT kernels (pinned)" in environment.one_line(
        {**environment.describe(), "cpu_kernels": kernels})

