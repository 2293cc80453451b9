"""Integration on a WikiText-2 slice: ``gnnlm pipeline -c configs/tests/pipeline.yaml`` once,
through ``scripts/gpu_table.sh`` (the one-command table), then real outcomes — every row scores
the same tokens, kNN-LM beats the base LM, GNN+kNN beats kNN-LM, SPALM and the learned W_ds
help, no train neighbour leaks — and the bad-input errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gnnlm.models import load_base_lm
from gnnlm.models.protocols import layout
from gnnlm.pipeline.ablations import row_label
from gnnlm.retrieval.features import build_features, open_features
from gnnlm.retrieval.knn_cache import search_facts
from gnnlm.text.tokens import TokenStore
from gnnlm.utils.metrics import ppl_from_logprobs, unigram_logprobs
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.refusals import ArtifactError
from gnnlm.workdir.rows import HEAD_CONFIGS
from tests.conftest import PIPELINE, PROBE_WHEEL, run_gnnlm

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


def test_the_table_script_leaves_the_report_the_machine_and_every_stage_s_time(run_dir, results):
    """``scripts/gpu_table.sh table -c <test overlays>``: the carried wheel installed in its own
    folder, the report copied whole, the machine and versions, this run's time of each stage."""
    import pytorch_lightning
    import torch_geometric

    from gnnlm.utils.environment import one_line

    assert (run_dir / "site" / PROBE_WHEEL / "__init__.py").is_file()
    table = run_dir / "table"
    copied = json.loads((table / "results.json").read_text())
    assert copied["ppl"] == results["ppl"] and copied["timing_s"] == results["timing_s"]
    assert (table / "results.md").read_text().startswith("# tests: wikitext-2")
    assert (table / "test_logprobs.npz").stat().st_size > 0
    assert list(table.glob("*_gate_hist.png"))  # the SPALM rows' plots
    env = copied["environment"]
    assert env["device"] == "cpu" and env["gpus"] == 0 and env["cuda"] is None
    assert (env["torch"], env["torch_geometric"], env["pytorch_lightning"]) == (
        torch.__version__, torch_geometric.__version__, pytorch_lightning.__version__)
    assert (table / "environment.txt").read_text().strip() == one_line(env)
    assert f"Report written on: {one_line(env)}." in (table / "results.md").read_text()
    # the heads' scoring is timed apart from their training
    assert copied["timing_s"]["gnn scoring"] > 0 and copied["timing_s"]["spalm scoring"] > 0
    times = json.loads((table / "stage_times.json").read_text())
    stages = [s["stage"] for s in times["stages"]]
    assert stages[:2] == ["base_lm", "features"] and stages[-1] == "report"
    assert {"index[final]", "neighbors[final]", "knn_cache[final]", "knn_fit[final]",
            "index[att]", "knn_fit[att]", "gnn", "spalm", "spalm_xl", "learned_wds",
            "interpolations", "ablations", "data_checks"} <= set(stages)
    assert len(stages) == len(set(stages)) and times["environment"] == env
    # built from nothing: each trained stage's time here is at least its training time
    seconds = {s["stage"]: s["seconds"] for s in times["stages"]}
    for row in ("gnn", "spalm"):
        build = copied["timing_s"][row] + copied["timing_s"][f"{row} scoring"]
        assert seconds[row] >= build - 0.05  # (each is rounded to 0.01 s)
    assert sum(seconds.values()) <= times["total_seconds"]
    log = (table / "pipeline.log").read_text()
    assert "+GNN+kNN" in log and "[gnnlm] stage report:" in log


def test_results_record_unknown_tokens_and_the_overlap_with_the_datastore(results, workdir):
    """The test pipeline keeps WikiText-2's 10,000 most frequent words: of the slices it scores,
    9.77% of train, 12.02% of valid and 10.87% of test are `<unk>` (measured), a usual share for
    that size and not warned of. Its valid and test are other articles than train, so next to
    no position retrieves a near-copy of its own text; a head is flagged exactly when it is
    worse than the base LM on valid."""
    unk = results["unk_share"]
    assert results["unk_token"] == "<unk>"
    assert unk["train"] == pytest.approx(29298 / 300000)
    assert unk["valid"] == pytest.approx(0.1202)
    assert unk["test"] == pytest.approx(0.1087)
    overlap = results["datastore_overlap"]
    assert set(overlap) == {"valid", "test"} and all(0 <= v < 0.01 for v in overlap.values())
    assert results["near_copy"] == {"key": "final", "metric": "cos", "context": 32}
    kinds = {w["kind"] for w in results["warnings"]}
    assert not kinds & {"unk_share", "datastore_overlap", "overlap_mismatch"}
    valid, rows = results["valid_ppl"], results["protocols"]

    def on_the_base_lm(name: str) -> bool:  # a head on its features, read the base LM's way
        head = name in HEAD_CONFIGS or (name.startswith("learned_wds")
                                        and name.endswith("+base"))
        return head and layout(rows[name]) == layout(rows["base"])

    heads = [name for name in valid if on_the_base_lm(name)]
    assert {"gnn", "spalm", "learned_wds+base"} <= set(heads)
    assert {w["row"] for w in results["warnings"] if w["kind"] == "worse_than_base"} == {
        name for name in heads if valid[name] > valid["base"]}
    text = (workdir / "reports" / "tests" / "results.md").read_text()
    assert "Data: tokens unknown to the vocabulary (`<unk>`): train 9.8%, valid 12.0%, " \
           "test 10.9%; positions whose nearest train key is a near-copy" in text
    assert ("Warnings:" in text) == bool(results["warnings"])


def test_the_test_pipeline_s_retrieval_discriminates_and_its_plots_are_written(results,
                                                                               workdir):
    """Its base LM's keys are not degenerate (measured on valid at k = 64: median top-1 minus
    top-64 cosine 4.1e-3 for `final`, 4.8e-3 for `att`; no query within 1e-4; T moves valid ppl
    by over 2%): no retrieval warning. The report's plots are there."""
    sanity = results["retrieval_sanity"]
    assert set(sanity) == {"final", "att"}
    assert all(not s["degenerate"] and s["flat_share"] < 0.05 for s in sanity.values())
    assert not [w for w in results["warnings"] if w["kind"] == "degenerate_retrieval"]
    report = workdir / "reports" / "tests"
    assert {"knn_sweep_final.png", "knn_sweep_att.png", "knn_recall_buckets.png"} <= set(
        results["plots"])
    assert all((report / name).stat().st_size > 0 for name in results["plots"])


def test_base_lm_is_far_below_unigram_on_the_same_tokens(workdir):
    store = TokenStore.open(workdir / "tokens")
    _, valid = open_features(Workdir(workdir).features("valid"))
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
    hist = results["spalm_analysis"]["gate_histogram"]["test"]
    assert sum(hist["counts"]) == hist["tokens"] == results["tokens"]  # each token's mean gate


def test_spalm_with_its_last_block_fine_tuned_beats_the_base_lm(results):
    ppl = results["ppl"]
    assert ppl["spalm_ft"] < ppl["base"]
    hist = results["spalm_ft_analysis"]["gate_histogram"]["test"]
    assert sum(hist["counts"]) == hist["tokens"] == results["tokens"]


def test_retrieval_windows_carry_the_datastore_s_tokens_and_neighbours(workdir):
    from datamodules.features import FeatureBlocks, NeighborValues
    from datamodules.retrieval_windows import RetrievalWindowsDataModule
    from datamodules.splits import SplitArrays

    data = RetrievalWindowsDataModule(workdir=str(workdir), key="final", metric="cos",
                                      retrieved=4, eval_batch_size=4)
    assert (data.context, data.stride) == (64, 32)
    assert data.base_lm_fingerprint == load_base_lm(data.base_lm).fingerprint()
    batch = next(iter(data.test_dataloader()))
    wd = Workdir(workdir)
    _, test = open_features(wd.features("test"))
    positions = batch["positions"].flatten().numpy()
    np.testing.assert_array_equal(batch["target"].flatten().numpy(), test["targets"][positions])
    arrays = SplitArrays(wd)
    blocks = FeatureBlocks(arrays, "test", "final", block_size=10**6,
                           values=NeighborValues(arrays, "final", "cos", "test", 4))
    np.testing.assert_array_equal(batch["nbr_values"].reshape(-1, 4).numpy(),
                                  blocks[0]["nbr_values"].numpy()[positions])
    covered = read_manifest(wd.neighbors("final", "cos", "train"))["n"]
    too_long = RetrievalWindowsDataModule(workdir=str(workdir), train_tokens=covered + 1)
    with pytest.raises(ValueError, match="cover only the first"):
        too_long.train_dataloader()


def test_every_row_scores_the_same_tokens(workdir, results):
    scores = np.load(workdir / "reports" / "tests" / "test_logprobs.npz")
    assert all(len(scores[name]) == results["tokens"] for name in scores.files)
    assert all(np.isfinite(scores[name]).all() for name in scores.files)
    for name in scores.files:
        assert ppl_from_logprobs(scores[name]) == pytest.approx(results["ppl"][name])


def train_context(workdir) -> int:
    """C: how many tokens back a train feature has read, as the features recorded it (the
    pipeline's default leakage window)."""
    return int(Workdir(workdir).features_manifest("train")["config"]["context"])


def test_no_train_neighbour_inside_the_leakage_window(workdir):
    C = train_context(workdir)
    for key in ("final",):  # train queries are searched for the heads' key only
        path = Workdir(workdir).neighbors(key, "cos", "train")
        manifest = read_manifest(path)
        ids = np.asarray(open_array(path, "ids")).astype(np.int64)
        t = np.arange(len(ids))[:, None]
        valid = ids >= 0
        assert valid.mean() > 0.99
        ahead = ids - t                      # a neighbour p has read the targets t in [p - C, p]
        assert not np.any(valid & (ahead >= 0) & (ahead <= C))
        assert np.any(valid & (ahead < 0) & (ahead >= -C))  # behind the query: allowed, kept
        assert manifest["leakage_window"] == C and 0 < manifest["masked_fraction"] < 1


def reachable_ctx(graph, hops: int) -> np.ndarray:
    """bool [n_nbr, n_ctx]: which ctx nodes each nbr node's information reaches within
    ``hops`` message-passing steps, following every edge of the graph (the layers' reach)."""
    n_ctx, n_nbr = graph["ctx"].num_nodes, graph["nbr"].num_nodes
    offset = {"ctx": 0, "nbr": n_ctx}
    size = n_ctx + n_nbr
    step = np.eye(size, dtype=np.float32)                            # staying put
    for (src, _, dst), store in graph.edge_items():
        edges = store.edge_index.numpy()
        step[edges[0] + offset[src], edges[1] + offset[dst]] = 1
    # backwards from the ctx nodes (few): reached[j, u] = u reaches ctx node j in <= hops steps
    reached = step[:, :n_ctx].T                                      # [n_ctx, size]
    for _ in range(hops - 1):
        reached = np.minimum(reached @ step.T, 1)                    # 0/1 floats: BLAS, exact
    return (reached[:, n_ctx:] > 0).T


def leaks(graph, C: int) -> int:
    """How many (window node, ctx token) pairs break the rule: the node's information reaches
    the token in 3 layers and the node has read, or is, its target (q - C <= t <= q)."""
    q = graph["nbr"].train_pos.numpy()
    t = graph["ctx"].split_pos.numpy()
    read = (q[:, None] - C <= t[None, :]) & (t[None, :] <= q[:, None])        # [n_nbr, n_ctx]
    return int((reachable_ctx(graph, hops=3) & read).sum())


def test_window_features_read_on_a_device_are_the_host_decoders_bits(workdir):
    """GNN-LM's window-node features as a GPU reads them (the slice's PQ codes and codebooks
    copied to the device, one gather; the CPU stands in for the GPU here) are the host
    decoder's, bit for bit, at every train position, and they reconstruct the stored features
    with the codec's recorded error."""
    from gnnlm.gnn.pq import PQFeatures

    wd = Workdir(workdir)
    pq = PQFeatures(wd.pq("final"))
    positions = np.random.default_rng(0).permutation(len(pq.codes))
    decoded = pq.on_device(torch.device("cpu"))(torch.from_numpy(positions)).numpy()
    np.testing.assert_array_equal(decoded, pq(positions))
    stored = np.asarray(open_features(wd.features("train"))[1]["final"], dtype=np.float32)
    error = ((decoded - stored[positions]) ** 2).sum() / (stored ** 2).sum()
    assert error == pytest.approx(pq.manifest["relative_reconstruction_error"], rel=0.1)


def test_pq_codebooks_trained_by_torch_reconstruct_the_slice_as_faiss_s_do(workdir, tmp_path):
    """``pq.clustering: torch`` (a GPU's k-means of the codebooks; faiss encodes) on the slice's
    train features: its codec reconstructs the held-out features with the error of faiss's own
    k-means on the same sample, within 10%."""
    from gnnlm.gnn.pq import PQConfig, build_pq

    errors = {}
    for clustering in ("faiss", "torch"):
        wd = Workdir(tmp_path / clustering)
        wd.features("train").parent.mkdir(parents=True)
        wd.features("train").symlink_to(Workdir(workdir).features("train"))
        manifest = build_pq(wd, "final", PQConfig(m=16, opq=False, train_sample=16384,
                                                  clustering=clustering))
        assert manifest["clustering"] == clustering and manifest["held_out"] == 8192
        errors[clustering] = manifest["relative_reconstruction_error"]
    assert 0 < errors["torch"] < 0.5
    assert errors["torch"] == pytest.approx(errors["faiss"], rel=0.1)


@pytest.mark.parametrize("inter", ["window", "retrieved"])
def test_no_node_of_a_train_graph_has_read_a_target_it_reaches(workdir, results, inter):
    """The leakage property on real WikiText-2 train graphs, checked by reachability through
    the edges (not by the rule's own formula): no window node has read, or is, the target of a
    ctx token it reaches. The same blocks built without the rule do leak (the check can fail),
    and the report carries the share the rule masked."""
    from datamodules.graph import GraphDataModule
    from gnnlm.gnn.graph import GraphConfig, build_graph

    dm = GraphDataModule(workdir=str(workdir), key="final", metric="cos",
                         graph=GraphConfig(k=16, inter=inter))
    data = dm.dataset("train")
    C = train_context(workdir)
    assert dm.leakage_window == C
    ids = np.asarray(open_array(Workdir(workdir).neighbors("final", "cos", "train"), "ids"))
    unmasked = 0
    for i in (0, 1, 7, len(data) // 2, len(data) - 1):
        g = data[i]
        assert g["nbr"].num_nodes > 0 and leaks(g, C) == 0
        owners = reachable_ctx(g, 3)[np.arange(g["nbr"].num_nodes), g["nbr"].owner_local]
        assert owners.all()                                       # every node reaches its token
        t = g["ctx"].split_pos.numpy()
        unmasked += leaks(build_graph(t, ids[t], data.n_train, dm.graph), C)
        assert g["ctx"].x.shape[1] == dm.node_features().dim == dm.feature_dim
        assert "x" not in g["nbr"]              # read by position where the model runs
    assert unmasked > 0
    shares = results["gnn_leakage"]
    assert set(shares) == {"windows_replaced", "nodes_dropped"}
    assert 0 < shares["windows_replaced"] + shares["nodes_dropped"] < 0.05


def test_killed_features_build_resumes_to_the_same_bytes(workdir, tmp_path):
    model = load_base_lm(str(workdir / "models" / "base_lm" / "model.ckpt"))
    store = TokenStore.open(workdir / "tokens")
    done = read_manifest(Workdir(workdir).features("valid"))
    args = dict(context=done["config"]["context"], stride=done["config"]["stride"],
                max_tokens=done["config"]["max_tokens"], batch_size=16, chunk_windows=64)
    killed, fresh = Workdir(tmp_path / "killed"), Workdir(tmp_path / "fresh")
    assert build_features(model, store, killed, "valid", stop_after_chunks=2, **args) == {}
    assert not killed.features("valid").exists()
    assert killed.features("valid").with_name("valid.partial").exists()
    build_features(model, store, killed, "valid", **args)
    build_features(model, store, fresh, "valid", **args)
    for name in ("final", "att", "targets", "lm_logprob"):
        assert (killed.features("valid") / f"{name}.bin").read_bytes() == \
            (fresh.features("valid") / f"{name}.bin").read_bytes()
    # and the chunk size does not change the features
    np.testing.assert_allclose(open_array(fresh.features("valid"), "final"),
                               open_array(Workdir(workdir).features("valid"), "final"),
                               atol=2e-3)


def test_a_datastore_made_by_another_base_lm_is_refused_naming_both(workdir, tmp_path):
    model = load_base_lm(str(workdir / "models" / "base_lm" / "model.ckpt"))
    with torch.no_grad():
        model.ln_f.bias.add_(0.1)
    model._fingerprint = None
    wd = Workdir(workdir)
    with pytest.raises(ArtifactError, match=r"made by base LM .* not by .*"):
        open_features(wd.features("test"), expect_lm=model.identity())
    # the features stage refuses to overwrite the other model's datastore too, naming both
    store = TokenStore.open(workdir / "tokens")
    done = read_manifest(wd.features("test"))
    with pytest.raises(ArtifactError, match=f"inputs.base_lm_fingerprint: \"?"
                                            f"{done['inputs']['base_lm_fingerprint']}"):
        build_features(model, store, wd, "test",
                       context=done["config"]["context"], stride=done["config"]["stride"],
                       max_tokens=done["config"]["max_tokens"])


def test_k_larger_than_the_datastore_is_refused(workdir):
    from gnnlm.retrieval.search import Searcher

    searcher = Searcher.for_workdir(Workdir(workdir), "final", "cos")
    with pytest.raises(ValueError, match=f"datastore size {searcher.ntotal}"):
        searcher.search(np.zeros((1, searcher.d), dtype=np.float32), searcher.ntotal + 1)
    with pytest.raises(ValueError, match="dim"):
        searcher.search(np.zeros((1, searcher.d + 1), dtype=np.float32), 4)


def test_rerun_skips_every_stage_and_sweep_and_explain_work(run_dir, workdir, results):
    before = {p: p.stat().st_mtime for p in workdir.glob("*/**/manifest.json")}
    out = run_gnnlm(["pipeline", *PIPELINE], run_dir).stdout
    assert "+GNN+kNN" in out
    assert {p: p.stat().st_mtime for p in workdir.glob("*/**/manifest.json")} == before
    sweep = run_gnnlm(["sweep", *PIPELINE], run_dir).stdout
    assert "best on valid" in sweep
    summary = json.loads((workdir / "reports" / "tests" / "sweep" / "sweep.json").read_text())
    assert summary["test_ppl"] == pytest.approx(results["ppl"]["knn"], rel=1e-4)
    assert (workdir / "reports" / "tests" / "sweep" / "sweep_heatmap.png").stat().st_size > 0
    explained = run_gnnlm(["explain", *PIPELINE, "--text", "The game was released in",
                           "--top", "2"], run_dir).stdout
    assert explained.count("Extracted") == 2 and "[" in explained
    # the trained GNN-LM's next tokens, read through its window states at the chosen k
    chosen = results["gnn_eval_k"]["chosen"]
    assert "Next token, base LM: " in explained
    assert f"Next token, GNN-LM (k = {chosen}): " in explained


def test_a_moved_work_directory_is_reused_and_rebuild_rebuilds_what_it_names(run_dir, workdir):
    """Manifests identify inputs by content and keep paths relative: a work directory moved and
    named by another (relative) path is complete as it is; ``--rebuild=[...]`` rebuilds exactly
    the stages it names and those that read them (the ablations read the kNN caches)."""
    moved = run_dir / "elsewhere" / "moved"
    shutil.copytree(workdir, moved, symlinks=True)
    manifests = lambda: {p.relative_to(moved): p.stat().st_mtime  # noqa: E731
                         for p in moved.glob("*/**/manifest.json")}
    before = manifests()
    out = run_gnnlm(["pipeline", *PIPELINE, "--workdir=elsewhere/moved"], run_dir)
    assert manifests() == before and "built in" not in out.stderr
    assert "+GNN+kNN" in out.stdout
    run_gnnlm(["pipeline", *PIPELINE, "--workdir=elsewhere/moved", "--rebuild=[knn_cache]"],
              run_dir)
    after = manifests()
    changed = {p for p in before if after[p] != before[p]}
    assert {p.parts[0] for p in changed} == {"knn_cache", "ablations"}, changed
    shutil.rmtree(moved)


@pytest.mark.multiprocess
def test_ddp_fit_on_two_cpu_processes(run_dir, workdir):
    """GNN-LM training runs unchanged under DDP (gloo, 2 processes)."""
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/gnnlm.yaml",
             "configs/wikitext2/gnnlm_cpu.yaml", "configs/tests/tiny_gnn.yaml"]
    out = run_gnnlm(["fit", *(a for c in chain for a in ("-c", c)), "--trainer.strategy=ddp",
                     "--trainer.devices=2", "--trainer.max_epochs=1",
                     "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=4",
                     f"--trainer.default_root_dir={run_dir / 'ddp'}",
                     f"--data.init_args.workdir={workdir}"], run_dir, timeout=600)
    metrics = next((run_dir / "ddp").glob("lightning_logs/version_*/metrics.csv")).read_text()
    assert "val/ppl" in metrics
    log = out.stdout + out.stderr
    assert "distributed_backend=gloo" in log and "MEMBER: 2/2" in log


def _validation_ppl(run_dir, workdir, devices: int) -> float:
    chain = ["configs/trainer/cpu.yaml", "configs/wikitext2/base_lm.yaml",
             "configs/wikitext2/base_lm_cpu.yaml", "configs/tests/tiny_lm.yaml"]
    root = run_dir / f"validate{devices}"
    run_gnnlm(["validate", *(a for c in chain for a in ("-c", c)),
               f"--ckpt_path={workdir / 'models' / 'base_lm' / 'model.ckpt'}",
               f"--trainer.devices={devices}", "--trainer.strategy=ddp" if devices > 1 else
               "--trainer.strategy=auto", "--trainer.limit_val_batches=null",
               "--data.init_args.eval_tokens=20010",  # 625 windows: uneven over 2 ranks
               f"--trainer.default_root_dir={root}", f"--data.init_args.workdir={workdir}"],
              run_dir, timeout=600)
    metrics = next(root.glob("lightning_logs/version_*/metrics.csv")).read_text().splitlines()
    header = metrics[0].split(",")
    return float(metrics[-1].split(",")[header.index("val/ppl")])


def test_ddp_validation_counts_every_token_once(run_dir, workdir):
    """Lightning's default sampler would pad the last round with repeated windows under DDP;
    the data modules' evaluation sampler does not, so 2 processes give the 1-process value."""
    one, two = _validation_ppl(run_dir, workdir, 1), _validation_ppl(run_dir, workdir, 2)
    assert two == pytest.approx(one, rel=1e-6)


def test_ablation_table(results, workdir):
    """Xu et al.'s switches, one row each on the same prefix; a bigger datastore helps."""
    ablations = results["ablations"]
    rows = {r["row"]: r for r in ablations["rows"]}
    base = rows["base LM"]["test_ppl"]
    assert ablations["tokens"] == {"valid": 3000, "test": 3000}
    for m in ("cos", "ip", "l2"):
        assert f"kNN-LM, key final, {m}: exact neighbours + exact scores" in rows
    # labels say what was searched, from the caches' manifests: the slice's auto IVF,SQ8 index
    # re-ranks, so its scores are exact, and the approximate row searches it without re-ranking
    wd = Workdir(workdir)
    facts = search_facts(read_manifest(wd.knn_cache("final", "cos", "faiss", "test")), wd)
    assert facts["rerank"] > 0 and facts["scores_are_exact"]
    assert row_label("final", "cos", facts) in rows and row_label("final", "cos", facts).endswith(
        "+ exact scores")
    assert any(r.startswith("kNN-LM, key att, cos: ") for r in rows)
    approximate = [r for r in rows if r.endswith("+ approximate (index) scores")]
    assert len(approximate) == 1 and "re-ranked" not in approximate[0]
    assert not any("FAISS" in r for r in rows) and len(rows) == len(ablations["rows"])
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
