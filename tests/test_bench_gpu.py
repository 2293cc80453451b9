"""``benchmarks/bench_gpu.py`` at small shapes on this machine: every stage runs and reports a
rate next to its limit (the GPU table's numbers come from the same script on a GPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.conftest import REPO


def test_every_stage_reports_its_rate_and_limit(tmp_path):
    out = tmp_path / "bench_gpu.json"
    result = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--small", "--json",
                             str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    limits = record["limits"]
    assert min(limits.values()) > 0
    search = record["exact_search"]
    assert search["equal_to_float32_screening"] is True
    assert search["scores_independent_of_position"] is True
    assert search["queries_rows"] == record["shapes"]["queries"]
    assert search["queries_per_s"] > 0 and search["limit_naive_queries_per_s"] > 0
    for stage in ("kmeans", "features", "base_lm_step"):
        assert 0 < record[stage]["tflops"], stage
    stage = record["features_stage"]
    assert stage["equal_to_host_rounding"] is True
    assert stage["tokens_per_s"] > 0 and 0 < stage["forward_share"]
    for k in record["shapes"]["ks"]:
        assert record[f"gnn_train[{k}]"]["tokens_per_s"] > 0
        assert record[f"gnn_train[{k}]"]["graphs_built_tokens_per_s_one_core"] > 0
    assert record["gnn_eval"]["time_vs_base_lm"] > 0
    assert record["pq_codebooks"]["seconds"] > 0 and record["pq_codebooks"]["same_bytes_twice"]
    sweep = record["knn_sweep"]
    assert sweep["seconds"] > 0 and sweep["cpu_seconds_estimate"] > 0
    assert sweep["points"] == 4 * 9 * 20
    if not torch.cuda.is_available():                  # the same device: the same bits
        assert sweep["max_relative_gap_to_cpu"] == 0.0
    assert sweep["max_relative_gap_to_cpu"] < 1e-5      # a GPU's exp rounds otherwise
    assert "exact search" in result.stdout and "GNN-LM evaluation" in result.stdout
    assert "kNN-LM fit" in result.stdout
