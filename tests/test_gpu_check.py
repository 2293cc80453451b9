"""``scripts/gpu_check.sh``'s own switches, without running the table (the rehearsal test runs
the whole command)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def check(wikitext_root, tmp_path, *args: str, **env: str) -> tuple[int, str]:
    """``scripts/gpu_check.sh OUT --rehearsal ARGS`` with ``env``, from a folder of its own
    (a stage that starts writes its work directory there): (exit status, its log)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "PYTHON": sys.executable, "GNNLM_DATA": str(wikitext_root),
           "GNNLM_WHEELS": str(tmp_path / "no-wheels"), "GNNLM_SITE": str(tmp_path / "site"),
           "GNNLM_CHECK_TABLE": str(tmp_path / "table"), "BENCH_SECONDS": "0", **env}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"),
                             str(tmp_path / "out"), "--rehearsal", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    return result.returncode, (tmp_path / "out" / "pipeline.log").read_text()


def test_bench_seconds_0_skips_the_benchmark(wikitext_root, tmp_path):
    """``BENCH_SECONDS=0 scripts/gpu_check.sh OUT --rehearsal`` (a GPU session's smoke run
    before the table, without the benchmark's minute): straight to the table, here refused at
    once by a setting the pipeline does not know (``timeout 0`` would have run the benchmark
    with no limit at all), so its work directory is not served afterwards. An earlier run's
    results in the table's folder (the rehearsal's, before the table) do not come back as this
    run's."""
    (tmp_path / "table").mkdir()
    for name in ("results.json", "results.md", "stage_times.json", "test_logprobs.npz"):
        (tmp_path / "table" / name).write_text("an earlier run's")
    status, log = check(wikitext_root, tmp_path, "--knn.metric=nearest")
    assert status not in (0, 3), log[-3000:]
    assert log.splitlines()[0] == "gpu_check.sh: bench_gpu.py skipped (BENCH_SECONDS=0)"
    assert "bench_gpu.py ended" not in log and not (tmp_path / "out" / "bench_gpu.json").exists()
    assert "gpu_check.sh: the table (-c configs/tests/gpu_rehearsal.yaml), at most 480 s" in log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pipeline.log",
                                                                    "records.tar.gz"]
    assert "metric must be one of ('cos', 'ip', 'l2') (got 'nearest')" in log  # the pipeline's
    assert "served through gnnlm.load" not in log   # a table that failed is not served


def test_the_table_s_limit_keeps_the_whole_within_check_seconds_and_exits_3(wikitext_root,
                                                                           tmp_path):
    """The table gets what the whole's limit leaves less a stopped table's 30 s to exit; a
    table stopped at its limit exits 3 (its own limit, told from a stop from outside)."""
    status, log = check(wikitext_root, tmp_path, CHECK_SECONDS="33")
    limit = int(re.search(r"the table \(.*\), at most (\d+) s", log).group(1))
    assert 1 <= limit <= 3 and status == 3, log[-3000:]
    assert f"gpu_check.sh: the table stopped at its limit of {limit} s" in log
