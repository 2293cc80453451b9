"""Integration on a WikiText-2 slice: ``gnnlm pipeline -c configs/tests/pipeline.yaml`` once,
then real outcomes — every row scores the same tokens, kNN-LM beats the base LM, GNN+kNN beats
kNN-LM, SPALM and the learned W_ds help, no train neighbour leaks — and the bad-input errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import REPO, run_gnnlm

from gnnlm.artifacts import ArtifactError, open_array, read_manifest
from gnnlm.datastore import build_features, features_dir, open_features
from gnnlm.metrics import ppl_from_logprobs, unigram_logprobs
from gnnlm.models import load_base_lm
from gnnlm.tokens import TokenStore

pytestmark = pytest.mark.integration


def test_results_json_has_the_promised_fields(results):
    assert results["dataset"] == "wikitext-2" and results["split"] == "test"
    assert results["tokens"] == 20000
    assert {"base", "knn", "gnn", "gnn+knn", "spalm", "spalm_ft", "learned_wds"} <= set(
        results["ppl"])
    assert {"k", "lambda", "temperature", "similarity", "key"} <= set(results["hparams"]["knn"])
    assert {"base_lm", "features", "index[final]", "neighbors[final]", "gnn"} <= set(
        results["timing_s"])
    buckets = results["knn_recall_buckets"]
    assert 2 <= len(buckets) <= 5 and sum(b["tokens"] for b in buckets) == results["tokens"]
    assert all(a["recall_range"][1] < b["recall_range"][0] for a, b in zip(buckets, buckets[1:]))


def test_base_lm_is_far_below_unigram_on_the_same_tokens(workdir):
    store = TokenStore.open(workdir / "tokens")
    _, valid = open_features(features_dir(workdir, "valid"))
    base = ppl_from_logprobs(np.asarray(valid["lm_logprob"]))
    unigram = ppl_from_logprobs(unigram_logprobs(store.split("train")[:300000],
                                                 valid["targets"], store.vocab_size))
    assert base < 0.5 * unigram, (base, unigram)


def test_knn_lm_beats_the_base_lm_with_both_keys(results):
    ppl = results["ppl"]
    assert ppl["knn"] < ppl["base"]
    assert ppl["knn[att]"] < ppl["base"]
    assert 0 < results["hparams"]["knn"]["lambda"] < 1


def test_gnn_lm_ordering(results):
    """The paper's ordering on the same test tokens: GNN+kNN < kNN-LM < base."""
    ppl = results["ppl"]
    assert ppl["gnn+knn"] < ppl["knn"] < ppl["base"]
    assert ppl["gnn+knn"] < ppl["gnn"]


def test_spalm_and_learned_wds_beat_the_base_lm(results):
    ppl = results["ppl"]
    assert ppl["spalm"] < ppl["base"]
    assert ppl["learned_wds+base"] < ppl["base"]
    hist = results["spalm_gate"]["histogram"]
    assert sum(hist) == results["tokens"] * 64           # every gate dimension of every token


def test_spalm_with_its_last_block_fine_tuned_beats_the_base_lm(results):
    ppl = results["ppl"]
    assert ppl["spalm_ft"] < ppl["base"]
    assert sum(results["spalm_ft_gate"]["histogram"]) == results["tokens"] * 64


def test_retrieval_windows_carry_the_datastore_s_tokens_and_neighbours(workdir):
    from datamodules.features import FeatureBlocks
    from datamodules.retrieval_windows import RetrievalWindowsDataModule

    data = RetrievalWindowsDataModule(workdir=str(workdir), neighbors="final-cos", k=4,
                                      eval_batch_size=4)
    assert (data.context, data.stride) == (64, 32)
    assert data.base_lm_fingerprint == load_base_lm(data.base_lm).fingerprint()
    batch = next(iter(data.test_dataloader()))
    _, test = open_features(features_dir(workdir, "test"))
    positions = batch["positions"].flatten().numpy()
    np.testing.assert_array_equal(batch["target"].flatten().numpy(), test["targets"][positions])
    blocks = FeatureBlocks(workdir, "test", "final", "final-cos", 4, block_size=10**6)
    np.testing.assert_array_equal(batch["nbr_values"].reshape(-1, 4).numpy(),
                                  blocks[0]["nbr_values"].numpy()[positions])
    covered = read_manifest(workdir / "neighbors" / "final-cos" / "train")["n"]
    too_long = RetrievalWindowsDataModule(workdir=str(workdir), train_tokens=covered + 1)
    with pytest.raises(ValueError, match="cover only the first"):
        too_long.train_dataloader()


def test_every_row_scores_the_same_tokens(workdir, results):
    scores = np.load(workdir / "reports" / "tests" / "test_logprobs.npz")
    assert all(len(scores[name]) == results["tokens"] for name in scores.files)
    assert all(np.isfinite(scores[name]).all() for name in scores.files)
    for name in scores.files:
        assert ppl_from_logprobs(scores[name]) == pytest.approx(results["ppl"][name])


def test_no_train_neighbour_inside_the_leakage_window(workdir):
    for tag in ("final-cos",):  # train queries are searched for the heads' key only
        path = workdir / "neighbors" / tag / "train"
        manifest = read_manifest(path)
        ids = np.asarray(open_array(path, "ids")).astype(np.int64)
        t = np.arange(len(ids))[:, None]
        valid = ids >= 0
        assert valid.mean() > 0.99
        assert np.all(np.abs(ids - t)[valid] >= manifest["leakage_window"])
        assert manifest["leakage_window"] == 64 and 0 < manifest["masked_fraction"] < 1


def test_train_graphs_have_no_node_inside_the_leakage_window(workdir):
    from datamodules.graph import GraphDataModule

    dm = GraphDataModule(workdir=str(workdir), neighbors="final-cos")
    data = dm.dataset("train", k=8)
    W = dm.leakage_window
    for i in (0, 7, len(data) - 1):
        g = data[i]
        owner = g["nbr", "inter", "ctx"].edge_index[1]
        gap = (g["nbr"].train_pos - g["ctx"].split_pos[owner]).abs()
        assert g["nbr"].num_nodes > 0 and bool((gap >= W).all())
        assert g["ctx"].x.shape[1] == g["nbr"].x.shape[1] == dm.feature_dim


def test_killed_features_build_resumes_to_the_same_bytes(workdir, tmp_path):
    model = load_base_lm(str(workdir / "heads" / "base_lm" / "model.ckpt"))
    store = TokenStore.open(workdir / "tokens")
    done = read_manifest(features_dir(workdir, "valid"))
    args = dict(context=done["config"]["context"], stride=done["config"]["stride"],
                max_tokens=done["config"]["max_tokens"], batch_size=16, chunk_windows=64)
    assert build_features(model, store, "valid", tmp_path / "valid", stop_after_chunks=2,
                          **args) == {}
    assert not (tmp_path / "valid").exists() and (tmp_path / "valid.partial").exists()
    build_features(model, store, "valid", tmp_path / "valid", **args)
    fresh = tmp_path / "fresh"
    build_features(model, store, "valid", fresh, **args)
    for name in ("final", "att", "targets", "lm_logprob"):
        assert (tmp_path / "valid" / f"{name}.bin").read_bytes() == \
            (fresh / f"{name}.bin").read_bytes()
    # and the chunk size does not change the features
    np.testing.assert_allclose(open_array(fresh, "final"),
                               open_array(features_dir(workdir, "valid"), "final"), atol=2e-3)


def test_a_datastore_made_by_another_base_lm_is_refused_naming_both(workdir, tmp_path):
    model = load_base_lm(str(workdir / "heads" / "base_lm" / "model.ckpt"))
    with torch.no_grad():
        model.ln_f.bias.add_(0.1)
    model._fingerprint = None
    with pytest.raises(ArtifactError, match=r"made by base LM .* not by .*"):
        open_features(features_dir(workdir, "test"), expect_lm=model.identity())
    # the features stage refuses to overwrite the other model's datastore too
    store = TokenStore.open(workdir / "tokens")
    done = read_manifest(features_dir(workdir, "test"))
    with pytest.raises(ArtifactError, match=done["inputs"]["base_lm_fingerprint"]):
        build_features(model, store, "test", features_dir(workdir, "test"),
                       context=done["config"]["context"], stride=done["config"]["stride"],
                       max_tokens=done["config"]["max_tokens"])


def test_bad_interpolation_settings_are_refused(workdir, run_dir):
    from gnnlm.pipeline import load_config

    cfg = load_config(["-c", str(REPO / "configs/tests/pipeline.yaml"), "--knn.lambda_=1.5"])
    with pytest.raises(ValueError, match=r"\[0, 1\].*got \[1.5\]"):
        cfg.knn.grid()
    cfg = load_config(["-c", str(REPO / "configs/tests/pipeline.yaml"), "--knn.temperature=0"])
    with pytest.raises(ValueError, match=r"> 0 \(got \[0.0\]\)"):
        cfg.knn.grid()


def test_k_larger_than_the_datastore_is_refused(workdir):
    from gnnlm.index import Searcher, index_dir

    searcher = Searcher.open(index_dir(workdir, "final-cos"))
    with pytest.raises(ValueError, match=f"datastore size {searcher.ntotal}"):
        searcher.search(np.zeros((1, searcher.d), dtype=np.float32), searcher.ntotal + 1)
    with pytest.raises(ValueError, match="dim"):
        searcher.search(np.zeros((1, searcher.d + 1), dtype=np.float32), 4)


def test_rerun_skips_every_stage_and_sweep_and_explain_work(run_dir, workdir, results):
    before = {p: p.stat().st_mtime for p in workdir.glob("*/**/manifest.json")}
    out = run_gnnlm(["pipeline", "-c", "configs/tests/pipeline.yaml"], run_dir).stdout
    assert "+GNN+kNN" in out
    assert {p: p.stat().st_mtime for p in workdir.glob("*/**/manifest.json")} == before
    sweep = run_gnnlm(["sweep", "-c", "configs/tests/pipeline.yaml"], run_dir).stdout
    assert "best on valid" in sweep
    summary = json.loads((workdir / "reports" / "tests" / "sweep" / "sweep.json").read_text())
    assert summary["test_ppl"] == pytest.approx(results["ppl"]["knn"], rel=1e-4)
    assert (workdir / "reports" / "tests" / "sweep" / "sweep_heatmap.png").stat().st_size > 0
    explained = run_gnnlm(["explain", "-c", "configs/tests/pipeline.yaml", "--text",
                           "The game was released in", "--top", "2"], run_dir).stdout
    assert explained.count("Extracted") == 2 and "[" in explained


def test_ddp_fit_on_two_cpu_processes(run_dir, workdir):
    """GNN-LM training runs unchanged under DDP (gloo, 2 processes)."""
    out = run_gnnlm(["fit", "-c", "configs/tests/tiny_gnn.yaml", "--trainer.strategy=ddp",
                     "--trainer.devices=2", "--trainer.max_epochs=1",
                     "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=4",
                     f"--trainer.default_root_dir={run_dir / 'ddp'}",
                     f"--data.init_args.workdir={workdir}"], run_dir, timeout=600)
    metrics = next((run_dir / "ddp").glob("lightning_logs/version_*/metrics.csv")).read_text()
    assert "val/ppl" in metrics
    log = out.stdout + out.stderr
    assert "distributed_backend=gloo" in log and "MEMBER: 2/2" in log


def test_ablation_table(results, workdir):
    """Xu et al.'s switches, one row each on the same prefix; a bigger datastore helps."""
    ablations = results["ablations"]
    rows = {r["row"]: r for r in ablations["rows"]}
    base = rows["base LM"]["test_ppl"]
    assert ablations["tokens"] == {"valid": 3000, "test": 3000}
    for m in ("cos", "ip", "l2"):
        assert f"kNN-LM, key final, {m}, exact neighbours + exact scores" in rows
    assert "kNN-LM, key att, cos, FAISS neighbours + FAISS scores" in rows
    assert "kNN-LM, key final, cos, FAISS neighbours + exact scores" in rows
    assert all(r["test_ppl"] < base for name, r in rows.items() if name != "base LM")
    curve = ablations["subsample_curve"]
    assert [r["fraction"] for r in curve] == [0.1, 0.5, 1.0]
    assert curve[-1]["valid_ppl"] < curve[0]["valid_ppl"]
    assert len(ablations["temperature_curve"]) == 6
    report = workdir / "reports" / "tests"
    assert (report / "temperature_curve.png").stat().st_size > 0
    assert (report / "datastore_subsampling.png").stat().st_size > 0
    assert "Ablations" in (report / "results.md").read_text()


def test_learned_wds_with_several_embeddings_per_word(results):
    assert results["ppl"]["learned_wds[n=3]+base"] < results["ppl"]["base"]


def test_transformer_xl_memory_on_and_off(results):
    on, off = results["ablations"]["memory"]
    assert on["row"].endswith("M = 64") and off["row"].endswith("off")
    assert on["tokens"] == off["tokens"] == 20000
    assert on["test_ppl"] < off["test_ppl"]   # the cached segment is useful context
