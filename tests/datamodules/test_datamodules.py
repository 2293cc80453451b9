"""Data modules on a small fake work directory: every split is served exactly once, with the
features, targets and retrieved values of the artifacts; the LM windows score every position."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gnnlm.gnn.graph import GraphConfig
from gnnlm.gnn.pq import PQConfig, PQFeatures, build_pq
from gnnlm.lit.gnn import GNNLM
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors, neighbor_values
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array
from gnnlm.workdir.refusals import ArtifactError
from tests.fakes import write_features, write_output_embedding

SIZES = {"train": 600, "valid": 170, "test": 130}
D, V, K, W = 16, 20, 8, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Features of every split, an exact index, neighbours (train masked with W = 4), PQ codes
    and the output embedding, as ``gnnlm pipeline`` lays them out."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return _build_work(Workdir(tmp_path_factory.mktemp("work")))
    finally:
        faiss.omp_set_num_threads(before)


def _build_work(wd: Workdir):
    rng = np.random.default_rng(0)
    data = {}
    for split, n in SIZES.items():
        walk = np.cumsum(0.3 * rng.standard_normal((n, D)), axis=0) + rng.standard_normal(D)
        final = walk.astype(np.float32)
        targets = rng.integers(0, V, n).astype(np.int32)
        write_features(wd.features(split), final, att=-final, targets=targets,
                       lm_logprob=None if split == "train" else -rng.uniform(1, 4, n),
                       split=split, vocab_size=V)
        data[split] = (final, targets)
    build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=20))
    for split in SIZES:
        build_neighbors(wd, split, "final", "cos", NeighborsConfig(K=K), leakage_window=W,
                        device="cpu")
    build_pq(wd, "final", PQConfig(m=2, opq=False, train_sample=600))
    weight, bias = rng.standard_normal((V, D)), rng.standard_normal(V)
    write_output_embedding(wd, weight, bias)
    return wd, data, (weight, bias)


def all_items(loader):
    return [item for item in loader]


# -- FeatureDataModule -------------------------------------------------------------------------
def test_feature_blocks_partition_every_split(work):
    from datamodules.features import FeatureDataModule

    wd, data, (weight, bias) = work
    dm = FeatureDataModule(workdir=str(wd.root), key="final", metric="cos", retrieved=3,
                           block_size=64)
    assert (dm.feature_dim, dm.vocab_size) == (D, V)
    loaders = {"train": dm.train_dataloader(), "valid": dm.val_dataloader(),
               "test": dm.test_dataloader()}
    train_targets = data["train"][1]
    for split, loader in loaders.items():
        items = all_items(loader)
        positions = torch.cat([b["positions"] for b in items]).numpy()
        assert sorted(positions) == list(range(SIZES[split])), split
        assert max(len(b["positions"]) for b in items) == 64
        order = np.argsort(positions)
        h = torch.cat([b["h"] for b in items]).numpy()[order]
        target = torch.cat([b["target"] for b in items]).numpy()[order]
        values = torch.cat([b["nbr_values"] for b in items]).numpy()[order]
        final, targets = data[split]
        np.testing.assert_array_equal(h, final.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(target, targets)
        ids = np.asarray(open_array(wd.neighbors("final", "cos", split), "ids"))
        np.testing.assert_array_equal(values, neighbor_values(ids[:, :3], train_targets))
        assert values.shape == (SIZES[split], 3)
    w, b = dm.output_embedding()
    np.testing.assert_allclose(w.numpy(), weight, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), bias, rtol=1e-6)


def test_feature_batches_have_the_documented_dtypes(work):
    from datamodules.features import FeatureDataModule

    wd = work[0]
    batch = next(iter(FeatureDataModule(workdir=str(wd.root), retrieved=2, block_size=8)
                      .val_dataloader()))
    assert batch["h"].dtype == torch.float32 and batch["target"].dtype == torch.int64
    assert batch["nbr_values"].shape == (8, 2)
    assert batch["nbr_values"].dtype == torch.int64                  # NeighborValues' contract


def test_feature_data_without_retrieval_and_with_prefixes(work):
    from datamodules.features import FeatureDataModule

    wd = work[0]
    dm = FeatureDataModule(workdir=str(wd.root), key="att", block_size=50, train_tokens=120,
                           eval_tokens=70)
    train = all_items(dm.train_dataloader())
    assert sorted(torch.cat([b["positions"] for b in train]).tolist()) == list(range(120))
    assert all("nbr_values" not in b for b in train)
    valid = all_items(dm.val_dataloader())
    assert torch.cat([b["positions"] for b in valid]).tolist() == list(range(70))
    att = open_array(wd.features("valid"), "att")
    np.testing.assert_array_equal(valid[0]["h"].numpy(), np.asarray(att[:50], np.float32))
    dm.connect(predict_split="valid")
    assert len(dm.predict_dataloader().dataset) == 2
    with pytest.raises(ValueError, match="predict_split must be one of train, valid, test"):
        dm.connect(predict_split="dev")


def test_feature_data_refuses_more_values_than_retrieved_and_missing_work(work, tmp_path):
    from datamodules.features import FeatureDataModule

    wd = work[0]
    dm = FeatureDataModule(workdir=str(wd.root), retrieved=K + 1)
    with pytest.raises(ValueError, match=rf"retrieved={K + 1} .* holds K={K}"):
        dm.train_dataloader()
    with pytest.raises(ValueError, match="retrieved must be >= 0"):
        FeatureDataModule(workdir=str(wd.root), retrieved=-1)
    with pytest.raises(ArtifactError, match="run its retrieval stages first"):
        FeatureDataModule(workdir=str(tmp_path / "empty"))


# -- GraphDataModule ---------------------------------------------------------------------------
def test_evaluation_blocks_name_their_windows_by_position(work):
    from datamodules.graph import GraphDataModule

    wd, data, _ = work
    dm = GraphDataModule(workdir=str(wd.root), block_size=40, graph=GraphConfig(k=3),
                         eval_batch_size=3, num_workers=0)
    assert dm.n_train == SIZES["train"]
    for split, loader in (("valid", dm.val_dataloader()), ("test", dm.test_dataloader())):
        final, targets = data[split]
        ids = np.asarray(open_array(wd.neighbors("final", "cos", split), "ids"))
        positions = []
        for batch in loader:
            ctx = batch["ctx"]
            split_pos = ctx.split_pos.numpy()
            positions.append(split_pos)
            assert batch["nbr"].num_nodes == 0                        # no window nodes
            np.testing.assert_array_equal(ctx.y.numpy(), targets[split_pos])
            np.testing.assert_array_equal(ctx.x.numpy(),
                                          final[split_pos].astype(np.float16).astype(np.float32))
            np.testing.assert_array_equal(ctx.retrieved.numpy(), ids[split_pos, :3])
        np.testing.assert_array_equal(np.concatenate(positions), np.arange(SIZES[split]))


def test_graph_loaders_partition_every_split(work):
    from datamodules.graph import GraphDataModule

    wd, data, _ = work
    dm = GraphDataModule(workdir=str(wd.root), key="final", metric="cos", node_features="pq",
                         block_size=40, graph=GraphConfig(k=3), batch_size=2, eval_batch_size=3,
                         num_workers=0, eval_windows="per_retrieval")
    assert (dm.feature_dim, dm.vocab_size, dm.leakage_window) == (D, V, W)
    pq = PQFeatures(wd.pq("final"))
    model = GNNLM(vocab_size=V, feature_dim=D)
    model.attach_node_features(dm.node_features(), dm.n_train)
    loaders = {"train": dm.train_dataloader(), "valid": dm.val_dataloader(),
               "test": dm.test_dataloader()}
    for split, loader in loaders.items():
        final, targets = data[split]
        ids = np.asarray(open_array(wd.neighbors("final", "cos", split), "ids"))
        positions = []
        for batch in loader:
            split_pos = batch["ctx"].split_pos.numpy()
            positions.append(split_pos)
            np.testing.assert_array_equal(batch["ctx"].y.numpy(), targets[split_pos])
            np.testing.assert_array_equal(batch["ctx"].x.numpy(),
                                          final[split_pos].astype(np.float16).astype(np.float32))
            nbr = batch["nbr"]
            train_pos = nbr.train_pos.numpy()
            # window nodes carry their positions; the model reads their features where it runs
            assert "x" not in nbr and nbr.num_nodes == len(train_pos)
            model.read_node_features(batch)
            np.testing.assert_array_equal(nbr.x.numpy(), pq(train_pos))
            # the ctx row that retrieved each window node, across the batch's graphs
            ctx_graph = batch["ctx"].batch.numpy()
            first_ctx = np.searchsorted(ctx_graph, np.arange(ctx_graph.max() + 1))
            nbr_graph = nbr.batch.numpy()
            owner = first_ctx[nbr_graph] + nbr.owner_local.numpy()
            retrieved = train_pos - nbr.offset.numpy()                 # the window's centre
            assert np.all(nbr.rank.numpy() < 3)
            stored = ids[split_pos[owner]]                             # [n_nbr, K]
            assert np.all((stored == retrieved[:, None]).any(axis=1))  # one of its neighbours
            if split != "train":
                np.testing.assert_array_equal(retrieved, stored[np.arange(len(owner)),
                                                                nbr.rank.numpy()])
            else:
                # no node has read (or is) the target of a ctx token it reaches: the one that
                # retrieved it and every later token of its block
                for node in range(len(train_pos)):
                    reach = (ctx_graph == nbr_graph[node]) & (np.arange(len(split_pos))
                                                               >= owner[node])
                    t = split_pos[reach]
                    assert not np.any((t >= train_pos[node] - W) & (t <= train_pos[node])), (
                        train_pos[node], t)
        positions = np.concatenate(positions)
        assert sorted(positions) == list(range(SIZES[split])), split
        assert len(positions) == SIZES[split]


@pytest.mark.usefixtures("one_faiss_thread")
def test_a_leakage_window_of_zero_masks_no_train_graph(work, tmp_path):
    """``neighbors.leakage_window: 0`` (recorded in the train neighbours' manifest) or the data
    module's ``leakage_window=0``: the no-masking ablation, so train graphs drop and replace
    nothing and the module records masking as off."""
    from datamodules.graph import GraphDataModule
    from gnnlm.gnn.graph import build_graph

    wd = work[0]
    unmasked = Workdir(tmp_path / "unmasked")
    shutil.copytree(wd.root, unmasked.root)
    manifest = build_neighbors(unmasked, "train", "final", "cos",
                               NeighborsConfig(K=K, leakage_window=0), rebuild=True, device="cpu")
    assert manifest["leakage_window"] == 0 and manifest["dropped"] == 0
    for root, given in ((unmasked.root, None), (wd.root, 0)):
        dm = GraphDataModule(workdir=str(root), block_size=40, graph=GraphConfig(k=3),
                             num_workers=0, node_features="raw", leakage_window=given)
        assert dm.leakage_window is None
        data = dm.dataset("train")
        assert data.leakage_window is None
        ids = np.asarray(open_array(Workdir(root).neighbors("final", "cos", "train"), "ids"))
        for i in range(len(data)):
            g = data[i]
            t = g["ctx"].split_pos.numpy()
            plain = build_graph(t, ids[t], dm.n_train, data.graph)
            assert (g.windows_masked, g.nodes_masked) == (0, 0)
            assert torch.equal(g["nbr"].train_pos, plain["nbr"].train_pos)
    # unmasked neighbours find the query's own position (its target): a rule would drop it
    ids = np.asarray(open_array(unmasked.neighbors("final", "cos", "train"), "ids"))
    assert (ids[:, 0] == np.arange(len(ids))).mean() > 0.5


def test_k_schedule_picks_k_per_epoch(work):
    from datamodules.graph import GraphDataModule

    wd = work[0]
    dm = GraphDataModule(workdir=str(wd.root), block_size=50, graph=GraphConfig(k=6),
                         k_schedule=[[2, 6], [0, 2]], num_workers=0, node_features="raw")
    assert [dm.current_k(e) for e in (0, 1, 2, 5)] == [2, 2, 6, 6]
    assert dm.current_k(None) == 6                                    # evaluation
    for epoch, k in ((0, 2), (3, 6)):
        dm.trainer = SimpleNamespace(current_epoch=epoch, world_size=1)
        loader = dm.train_dataloader()
        assert loader.dataset.graph.k == k
        ranks = torch.cat([b["nbr"].rank for b in loader])
        assert ranks.max().item() == k - 1
    assert dm.val_dataloader().dataset.graph.k == 6
    dm.connect(eval_k=4)                                     # a trained model reads any k
    assert dm.val_dataloader().dataset.graph.k == 4
    assert dm.train_dataloader().dataset.graph.k == 6
    dm.connect(predict_split="valid")                        # other settings stay as they were
    assert dm.eval_k == 4 and dm.predict_split == "valid"
    with pytest.raises(ValueError, match="eval_k must be a positive number"):
        dm.connect(eval_k=0)


def test_graph_data_refuses_bad_schedules_and_k(work):
    from datamodules.graph import GraphDataModule

    wd = work[0]
    with pytest.raises(ValueError, match="end with graph.k = 6"):
        GraphDataModule(workdir=str(wd.root), graph=GraphConfig(k=6), k_schedule=[[0, 2], [1, 4]])
    with pytest.raises(ValueError, match="start at epoch 0"):
        GraphDataModule(workdir=str(wd.root), graph=GraphConfig(k=6), k_schedule=[[1, 6]])
    dm = GraphDataModule(workdir=str(wd.root), graph=GraphConfig(k=K + 1), num_workers=0)
    with pytest.raises(ValueError, match=rf"k={K + 1} .* only K={K}"):
        dm.val_dataloader()
    with pytest.raises(ValueError, match="eval_windows must be"):
        GraphDataModule(workdir=str(wd.root), eval_windows="shared")
    with pytest.raises(ValueError, match="eval_ks must list"):
        GraphDataModule(workdir=str(wd.root), eval_ks=[0, 8])


# -- LMDataModule windows ----------------------------------------------------------------------
def test_sliding_windows_score_every_position_once():
    from datamodules.lm import SlidingWindows

    stream = torch.arange(1000, 1000 + 58)                           # 57 positions
    data = SlidingWindows(stream, context=16, stride=6)
    scored = []
    for item in DataLoader(data, batch_size=4):
        assert torch.equal(item["target"], item["input"] + 1)        # target = next in stream
        assert torch.equal(item["input"], stream[item["positions"]])
        scored.append(item["positions"][item["mask"].bool()])
    scored = torch.cat(scored)
    assert scored.tolist() == list(range(57))
    short = SlidingWindows(stream[:6], context=16, stride=6)          # shorter than a window
    assert len(short) == 1 and short[0]["mask"].sum() == 5


def test_blocks_cover_the_stream_without_overlap():
    from datamodules.lm import Blocks

    stream = torch.arange(50)
    data = Blocks(stream, block_size=8)
    assert len(data) == 6                                            # (50 - 1) // 8
    for i in range(len(data)):
        item = data[i]
        assert torch.equal(item["input"], stream[i * 8:(i + 1) * 8])
        assert torch.equal(item["target"], stream[i * 8 + 1:(i + 1) * 8 + 1])
        assert torch.equal(item["positions"], torch.arange(i * 8, (i + 1) * 8))
    with pytest.raises(ValueError, match="shorter than one block"):
        Blocks(stream[:5], block_size=8)


def test_stream_segments_continue_each_stream_batch_after_batch():
    from datamodules.lm import StreamSegments

    n_streams, segment = 3, 5
    stream = torch.arange(1, 40)                                      # 38 positions
    data = StreamSegments(stream, n_streams, segment)
    batches = list(DataLoader(data, batch_size=n_streams, shuffle=False))
    assert len(batches) == data.n_segments
    per_stream = [[] for _ in range(n_streams)]
    for j, batch in enumerate(batches):
        for s in range(n_streams):
            kept = batch["mask"][s].bool()
            per_stream[s].append(batch["target"][s][kept])
            if j > 0 and kept.any():                                 # picks up where it stopped
                previous = batches[j - 1]["input"][s][-1]
                assert batch["input"][s][0] == previous + 1
    targets = torch.cat([torch.cat(parts) for parts in per_stream])
    assert targets.tolist() == stream[1:].tolist()                    # every target once, in order
    assert sum(int(b["mask"].sum()) for b in batches) == 38


def test_lm_data_module_serves_windows_or_segments(tmp_path):
    from datamodules.lm import LMDataModule, SlidingWindows, StreamSegments

    corpus = tmp_path / "tiny"
    corpus.mkdir()
    for split, n in (("train", 40), ("valid", 9), ("test", 7)):
        (corpus / f"{split}.txt").write_text("".join(f"a b c w{i % 5}\n" for i in range(n)))
    args = dict(corpus="tiny", corpus_path=str(corpus), workdir=str(tmp_path / "work"),
                block_size=8, eval_context=8, eval_stride=4, batch_size=2, eval_batch_size=3)
    dm = LMDataModule(**args, segments=False)
    assert dm.vocab_size == dm.store.vocab_size and Workdir(tmp_path / "work").tokens.is_dir()
    valid = dm.val_dataloader()
    assert isinstance(valid.dataset, SlidingWindows)
    scored = torch.cat([b["positions"][b["mask"].bool()] for b in valid])
    assert sorted(scored.tolist()) == list(range(9 * 5))             # 5 tokens per line
    train = dm.train_dataloader()
    assert all(b["input"].shape == (2, 8) for b in train)
    segments = LMDataModule(**args, segments=True)
    test = segments.test_dataloader()
    assert isinstance(test.dataset, StreamSegments) and test.dataset.n_streams == 3
    assert sum(int(b["mask"].sum()) for b in test) == 7 * 5


def test_windows_and_blocks_open_with_bos_for_models_trained_so():
    from datamodules.lm import Blocks, SlidingWindows

    stream = torch.arange(1, 22)                       # [bos] + 20 tokens
    windows = SlidingWindows(stream, 8, 4, bos_id=0)
    plain = SlidingWindows(stream, 8, 4)
    for w in range(len(windows)):
        item, reference = windows[w], plain[w]
        assert item["input"][0] == 0 and torch.equal(item["input"][1:], reference["input"][1:])
        assert torch.equal(item["mask"], reference["mask"]) and item["mask"][0] == float(w == 0)
    assert plain[1]["input"][0] != 0                   # the stream itself is untouched
    blocks = Blocks(stream, 5, bos_id=0)
    assert [b["input"][0].item() for b in blocks] == [0, 0, 0, 0]
    assert [b["mask"][0].item() for b in blocks] == [1.0, 0.0, 0.0, 0.0]  # BOS alone: unscored
    assert torch.equal(blocks[2]["target"], Blocks(stream, 5)[2]["target"])
