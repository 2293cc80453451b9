"""``scripts/gpu_check.sh``'s own switches, without running the table (the rehearsal test runs
the whole command)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_bench_seconds_0_skips_the_benchmark(wikitext_root, tmp_path):
    """``BENCH_SECONDS=0 scripts/gpu_check.sh OUT --rehearsal`` (a GPU session's smoke run
    before the table, without the benchmark's minute): straight to the table, here refused at
    once by a setting the pipeline does not know (``timeout 0`` would have run the benchmark
    with no limit at all)."""
    env = {**os.environ, "PYTHON": sys.executable, "GNNLM_DATA": str(wikitext_root),
           "GNNLM_WHEELS": str(tmp_path / "no-wheels"), "GNNLM_SITE": str(tmp_path / "site"),
           "GNNLM_CHECK_TABLE": str(tmp_path / "table"), "BENCH_SECONDS": "0"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out"),
                             "--rehearsal", "--knn.metric=nearest"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    log = (tmp_path / "out" / "pipeline.log").read_text()
    assert result.returncode != 0, log[-3000:]
    assert log.splitlines()[0] == "gpu_check.sh: bench_gpu.py skipped (BENCH_SECONDS=0)"
    assert "bench_gpu.py ended" not in log and not (tmp_path / "out" / "bench_gpu.json").exists()
    assert "gpu_check.sh: the table (-c configs/tests/gpu_rehearsal.yaml), at most 480 s" in log
    assert "metric must be one of ('cos', 'ip', 'l2') (got 'nearest')" in log  # the pipeline's
