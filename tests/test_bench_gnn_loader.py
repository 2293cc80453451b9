"""``benchmarks/bench_gnn_loader.py`` keeps working: at a small k, both loaders' rates and the
bytes each batch copies (the decoded features are most of a batch's bytes)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_both_loaders_report_their_rate_and_batch_bytes(tmp_path):
    out = tmp_path / "bench_gnn_loader.json"
    result = subprocess.run([sys.executable, "benchmarks/bench_gnn_loader.py", "--ks", "4",
                             "--batches", "1", "--json", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads(out.read_text())["records"]
    assert record["k"] == 4
    assert record["decoded_tokens_per_s"] > 0 and record["positions_tokens_per_s"] > 0
    # 8 blocks x 128 tokens x 4 windows x 3 nodes x 512 float32: at most 25.2 MB of features
    features_mb = 8 * 128 * 4 * 3 * 512 * 4 / 1e6
    extra = record["decoded_batch_mb"] - record["positions_batch_mb"]
    assert 0.9 * features_mb < extra <= features_mb
    assert "k = 4: features decoded" in result.stdout
