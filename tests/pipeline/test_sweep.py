"""The sweep report: files, the valid-chosen point, test at that point, an offline W&B run."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from gnnlm.pipeline.sweep import run_sweep, sweep_caches, write_sweep
from gnnlm.retrieval.knn import default_temperatures, evaluate, fit
from gnnlm.workdir.builder import ArtifactBuilder


def write_cache(path, n, K, seed, scores="faiss", **facts):
    """A kNN cache artifact whose kNN part helps: hits concentrate on the best neighbours."""
    rng = np.random.default_rng(seed)
    sims = -np.sort(rng.exponential(1.0, (n, K)), axis=1).astype(np.float32)
    hits = rng.random((n, K)) < np.linspace(0.5, 0.05, K)[None]
    lm = np.log(rng.uniform(0.005, 0.3, n)).astype(np.float32)
    builder = ArtifactBuilder(path, kind="knn_cache", config={"seed": seed})
    with builder:
        builder.array("lm_logprob", np.float32, (n,))[:] = lm
        builder.array("sims", np.float32, (n, K))[:] = sims
        builder.array("hits", np.bool_, (n, K))[:] = hits
        builder.finish(extra={"n": n, "K": K, "key": "att", "metric": "l2", "scores": scores,
                              "base_lm": {"name": "fake-lm", "fingerprint": "weights-a"},
                              "backend": "index", "factory": "Flat", **facts})
    return {"sims": sims, "hits": hits, "lm_logprob": lm}


def test_sweep_report(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    valid = write_cache(tmp_path / "valid", 600, 32, seed=0)
    test = write_cache(tmp_path / "test", 400, 32, seed=1)
    ks, temps, lams = [16, 4, 32, 16], [0.5, 1.0, 2.0], [0.0, 0.1, 0.3, 0.6]
    out = tmp_path / "report"
    result = run_sweep(tmp_path / "valid", tmp_path / "test", out, ks, temps, lams)
    assert result.ks == [4, 16, 32]                                  # sorted, once each
    best = fit(valid, [4, 16, 32], temps, lams)
    assert (result.k, result.temperature, result.lambda_) == \
        (best["k"], best["temperature"], best["lambda"])
    assert result.valid_ppl == pytest.approx(best["ppl"])
    assert result.valid_ppl < result.base_valid_ppl  # this kNN part helps
    assert result.test_ppl == pytest.approx(
        evaluate(test, result.k, result.temperature, result.lambda_))
    assert result.base_test_ppl == pytest.approx(np.exp(-test["lm_logprob"].mean()), rel=1e-5)
    assert result.points == 36 and (result.points_per_s or 0) > 0
    assert result.cache["metric"] == "l2" and result.cache["K"] == 32
    for name in ("sweep.csv", "sweep.md", "sweep_heatmap.png", "sweep.json"):
        assert (out / name).stat().st_size > 0
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 36 and set(rows[0]) == {"k", "temperature", "lambda", "valid_ppl"}
    best_row = min(rows, key=lambda r: float(r["valid_ppl"]))
    assert (int(best_row["k"]), float(best_row["temperature"]), float(best_row["lambda"])) == \
        (result.k, result.temperature, result.lambda_)
    md = (out / "sweep.md").read_text()
    assert f"{result.test_ppl:.3f}" in md and f"{result.base_valid_ppl:.3f}" in md
    assert (out / "sweep_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((out / "sweep.json").read_text())
    assert written == json.loads(json.dumps(result.to_json()))
    assert set(written) == {"k", "temperature", "lambda", "valid_ppl", "test_ppl",
                            "base_valid_ppl", "base_test_ppl", "points", "valid_tokens",
                            "test_tokens", "seconds", "points_per_s", "grid", "cache",
                            "on_grid_edge", "files", "wandb_dir"}
    assert written["grid"] == {"k": [4, 16, 32], "temperature": temps, "lambda": lams}
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    assert result.wandb_dir is not None and result.wandb_dir.startswith(str(out / "wandb"))


def test_the_sweep_computes_without_writing(tmp_path):
    """``sweep_caches`` only computes; ``write_sweep`` writes what it computed."""
    write_cache(tmp_path / "valid", 80, 8, seed=0)
    write_cache(tmp_path / "test", 60, 8, seed=1)
    result = sweep_caches(tmp_path / "valid", tmp_path / "test", [2, 8], [1.0], [0.0, 0.5])
    assert result.valid_grid.shape == (2, 1, 2) and result.files == {}
    assert result.valid_ppl == pytest.approx(float(result.valid_grid[result.chosen]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test", "valid"]
    write_sweep(result, tmp_path / "out", use_wandb=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "sweep.csv", "sweep.json", "sweep.md", "sweep_heatmap.png"]
    assert set(result.files) == {"sweep.csv", "sweep.md", "sweep_heatmap.png", "sweep.json"}


def test_sweep_refuses_mismatched_caches(tmp_path):
    write_cache(tmp_path / "valid", 50, 8, seed=0)
    write_cache(tmp_path / "test", 50, 8, seed=1, scores="exact")
    with pytest.raises(ValueError, match=r"differ in scores \(valid 'faiss', test 'exact'\)"):
        run_sweep(tmp_path / "valid", tmp_path / "test", tmp_path / "out", [4], [1.0], [0.5],
                  use_wandb=False)


def test_k_above_the_caches_k_is_an_error(tmp_path):
    """A k the caches cannot serve is refused, never silently clamped to K."""
    write_cache(tmp_path / "valid", 50, 8, seed=0)
    write_cache(tmp_path / "test", 50, 8, seed=1)
    with pytest.raises(ValueError, match=r"between 1 and the K = 8 .*\(got \[4, 64\]\)"):
        run_sweep(tmp_path / "valid", tmp_path / "test", tmp_path / "out", [64, 4], [1.0],
                  [0.5], use_wandb=False)
    assert not (tmp_path / "out" / "sweep.json").exists()


def test_default_temperatures_follow_the_caches_metric_and_arrays_work(tmp_path):
    valid = write_cache(tmp_path / "valid", 80, 8, seed=0)
    test = write_cache(tmp_path / "test", 60, 8, seed=1)
    result = run_sweep(tmp_path / "valid", tmp_path / "test", tmp_path / "out", [2, 8],
                       lambdas=[0.0, 0.5], use_wandb=False)
    assert result.temperatures == default_temperatures("l2")
    assert result.wandb_dir is None and not (tmp_path / "out" / "wandb").exists()
    # mappings of arrays instead of folders: the same numbers, nothing recorded about them
    again = run_sweep(valid, test, tmp_path / "arrays", [2, 8], default_temperatures("l2"),
                      [0.0, 0.5], use_wandb=False)
    assert again.valid_ppl == pytest.approx(result.valid_ppl)
    assert again.test_ppl == pytest.approx(result.test_ppl)
    assert again.cache["metric"] is None


def test_sweep_md_names_the_neighbours_and_scores_as_the_report_does(tmp_path):
    """An IVF index re-ranked exactly: "faiss" scores that are exact; sweep.md says so in the
    words of results.md's and the printed table's kNN-LM rows (``search_description``)."""
    from gnnlm.pipeline.ablations import search_description

    facts = {"backend": "index", "factory": "IVF64,SQ8", "nprobe": 4, "rerank": 1.0,
             "scores_are_exact": True}
    for split, seed in (("valid", 0), ("test", 1)):
        write_cache(tmp_path / split, 60, 8, seed=seed, **facts)
    result = sweep_caches(tmp_path / "valid", tmp_path / "test", [8], [1.0], [0.0, 0.5])
    write_sweep(result, tmp_path / "out", use_wandb=False)
    md = (tmp_path / "out" / "sweep.md").read_text()
    words = search_description(facts)
    assert words == "IVF64,SQ8 neighbours (nprobe 4, re-ranked 1x) + exact scores"
    assert f"key att, l2: {words} (knn.scores: faiss)" in md
    # a cache that does not record its search is not described as exact or approximate
    write_cache(tmp_path / "old", 60, 8, seed=0)
    write_cache(tmp_path / "old_test", 60, 8, seed=1)
    old = sweep_caches(tmp_path / "old", tmp_path / "old_test", [8], [1.0], [0.0, 0.5])
    write_sweep(old, tmp_path / "old_out", use_wandb=False)
    assert "faiss scores (what was searched is not recorded)" in (
        tmp_path / "old_out" / "sweep.md").read_text()


def test_sweep_md_notes_a_temperature_that_changes_nothing(tmp_path):
    """Neighbours whose similarities tie (keys that all point the same way): every T gives the
    same perplexity, and sweep.md says the kNN part smooths rather than retrieves; a cache whose
    neighbours differ gets no such note."""
    rng = np.random.default_rng(0)
    n, K = 300, 8
    cache = {"sims": np.full((n, K), 0.99999, dtype=np.float32),
             "hits": rng.random((n, K)) < 0.3,
             "lm_logprob": np.log(rng.uniform(0.005, 0.3, n)).astype(np.float32)}
    temps = default_temperatures("cos")
    flat = sweep_caches(cache, cache, [8], temps, [0.0, 0.2, 0.5])
    assert flat.lambda_ > 0
    write_sweep(flat, tmp_path / "flat", use_wandb=False)
    said = (tmp_path / "flat" / "sweep.md").read_text()
    assert "Note: T changes valid perplexity by 0.00%" in said
    write_cache(tmp_path / "valid", 300, 8, seed=0)
    write_cache(tmp_path / "test", 300, 8, seed=1)
    apart = sweep_caches(tmp_path / "valid", tmp_path / "test", [8], [0.5, 1.0, 2.0], [0.0, 0.5])
    assert apart.lambda_ > 0
    write_sweep(apart, tmp_path / "apart", use_wandb=False)
    assert "Note: T changes" not in (tmp_path / "apart" / "sweep.md").read_text()
