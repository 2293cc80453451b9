"""The GNN-LM LightningModule (gnnlm.lit.gnn): the dense and message-passing paths give the same
logits from the same weights, the loss is the token NLL of the frozen softmax, evaluation blocks
that name their windows score as the graphs with those windows do, and `gnnlm fit` links the
graph layout into the model and hands it the datastore's arrays."""
from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from gnnlm.gnn.graph import GraphConfig, build_context_graph, build_graph
from gnnlm.gnn.settings import GraphLayout
from gnnlm.lit.gnn import GNNLM
from tests.fakes import randomise, write_features, write_output_embedding
from tests.gnn.test_dense import D_MODEL, batch_of_graphs

V = 23


def _model(impl: str, graph: GraphConfig, seed: int = 0, dtype=torch.float32) -> GNNLM:
    """A GNN-LM in ``dtype`` with a random output embedding (float32, as attached always)."""
    torch.manual_seed(seed)
    model = GNNLM(vocab_size=V, feature_dim=D_MODEL, num_layers=3, heads=4, dropout=0.0,
                  zero_init_output=False, impl=impl, graph_layout=graph).to(dtype)
    g = torch.Generator().manual_seed(seed)
    model.attach_output_embedding(torch.randn(V, D_MODEL, generator=g),
                                  torch.randn(V, generator=g))
    return model


def base_lm_logits(h: torch.Tensor, model: GNNLM) -> torch.Tensor:
    """The frozen softmax's logits of ``h`` itself: what the base LM predicts."""
    weight, bias = model.output_embedding()
    return h.float() @ weight.T + bias


def _with_targets(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch["ctx"].y = torch.randint(0, V, (batch["ctx"].num_nodes,), generator=g)
    return batch


@pytest.mark.parametrize("inter", ["window", "retrieved"])
def test_dense_and_message_passing_give_the_same_logits(inter):
    cfg = GraphConfig(left=1, right=2, k=3, inter=inter)
    batch = _with_targets(batch_of_graphs(cfg, leakage_window=4))        # float64 features
    dense = _model("dense", cfg, dtype=torch.float64).eval()
    randomise(dense.gnn)                 # no parameter left at its identity initialisation
    pyg = _model("pyg", cfg, seed=1, dtype=torch.float64).eval()
    pyg.load_state_dict(dense.state_dict())
    pyg.attach_output_embedding(*dense.output_embedding())
    assert torch.equal(pyg.gnn.layers[0].w_att["intra"], dense.gnn.layers[0].w_att["intra"])
    with torch.no_grad():
        want, got = pyg(batch), dense(batch)
        plain = base_lm_logits(batch["ctx"].x, dense)
    assert got.shape == (batch["ctx"].num_nodes, V) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - plain).abs().max() > 0.1                                # the GNN did something


def test_the_loss_is_the_token_nll_of_the_frozen_softmax():
    cfg = GraphConfig(k=2)
    batch = _with_targets(batch_of_graphs(cfg, dtype=torch.float32))
    model = _model("dense", cfg).eval()
    with torch.no_grad():
        nll, mask, positions = model.token_nll(batch, "val")
        logits = model(batch)
    expected = -torch.log_softmax(logits, -1)[torch.arange(len(nll)), batch["ctx"].y]
    torch.testing.assert_close(nll, expected)
    assert torch.all(mask == 1) and torch.equal(positions, batch["ctx"].split_pos)
    out = model.predict_step(batch, 0)
    torch.testing.assert_close(out["logprob"], -nll)
    assert set(out) == {"positions", "logprob"}                          # no per-token extras
    # the base LM's output embedding stays out of the checkpoint: it belongs to the base LM
    assert not any(name.startswith("out_") for name in model.state_dict())
    # without zero_init_output=False the stack starts as the identity: the base LM itself
    start = GNNLM(vocab_size=V, feature_dim=D_MODEL, graph_layout=cfg).eval()
    start.attach_output_embedding(*model.output_embedding())
    with torch.no_grad():
        torch.testing.assert_close(start(batch), base_lm_logits(batch["ctx"].x, model))


@pytest.mark.parametrize("named_by, impl", [("ctx.retrieved", "dense"),
                                            ("nbr.train_pos", "dense"),
                                            ("nbr.train_pos", "pyg")])
def test_windows_named_by_position_score_as_the_graphs_with_their_features(named_by, impl):
    """Windows named by train position read the attached node features, and the logits are
    those of the same blocks built with their window features: evaluation blocks without
    window nodes (``ctx.retrieved``, ``eval_windows="once"``: each window computed once) and
    train graphs as the data module builds them (``nbr.train_pos`` and no ``x``: the same
    computation, so the same bits). Without node features the model says what to attach."""
    cfg = GraphConfig(left=1, right=1, k=3)
    n_train = 200
    rng = np.random.default_rng(0)
    table = rng.standard_normal((n_train, D_MODEL)).astype(np.float32)
    leakage = 8 if named_by == "nbr.train_pos" else None
    with_features, named = [], []
    for start, T in ((100, 7), (150, 4)):
        positions = np.arange(start, start + T)
        ids = rng.integers(0, n_train, (T, 5))
        ids[rng.random((T, 5)) < 0.2] = -1
        ctx = torch.from_numpy(rng.standard_normal((T, D_MODEL)).astype(np.float32))
        full = build_graph(positions, ids, n_train, cfg, leakage)
        full["nbr"].x = torch.from_numpy(table[full["nbr"].train_pos.numpy()])
        names = (build_graph(positions, ids, n_train, cfg, leakage) if leakage
                 else build_context_graph(positions, ids, n_train, cfg))
        for graph in (full, names):
            graph["ctx"].x = ctx
        with_features.append(full)
        named.append(names)
    model = _model(impl, cfg).eval()
    randomise(model.gnn)
    with pytest.raises(RuntimeError, match="attach_node_features"):
        model(Batch.from_data_list(named))
    model.attach_node_features(lambda positions: table[positions], n_train)
    with torch.no_grad():
        want = model(Batch.from_data_list(with_features))
        got = model(Batch.from_data_list(named))
    if leakage:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_dense_path_needs_the_graph_layout_and_dense_needs_gnnlm_layers():
    batch = _with_targets(batch_of_graphs(GraphConfig(k=2), dtype=torch.float32))
    model = _model("dense", None)
    with pytest.raises(RuntimeError, match="pass graph"):
        model(batch)
    with pytest.raises(ValueError, match="use impl='pyg'"):
        GNNLM(vocab_size=V, feature_dim=D_MODEL, kind="hgt")
    with pytest.raises(ValueError, match="feature_dim must be"):
        GNNLM(vocab_size=V)


# -- through `gnnlm fit`'s CLI: links and the datastore's arrays ----------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny work directory: features, an exact index, neighbours, PQ codes, the output
    embedding."""
    from gnnlm.gnn.pq import PQConfig, build_pq
    from gnnlm.retrieval.index import IndexConfig, build_index
    from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
    from gnnlm.workdir.layout import Workdir

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        wd = Workdir(tmp_path_factory.mktemp("gnn") / "work")
        rng = np.random.default_rng(0)
        for split, n in (("train", 300), ("valid", 40), ("test", 30)):
            final = np.cumsum(0.3 * rng.standard_normal((n, D_MODEL)), axis=0)
            write_features(wd.features(split), final.astype(np.float32),
                           targets=rng.integers(0, V, n).astype(np.int32), split=split,
                           vocab_size=V)
        build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=10))
        for split in ("train", "valid", "test"):
            build_neighbors(wd, split, "final", "cos", NeighborsConfig(K=4), leakage_window=4,
                            device="cpu")
        build_pq(wd, "final", PQConfig(m=2, opq=False, train_sample=300))
        write_output_embedding(wd, rng.standard_normal((V, D_MODEL)), rng.standard_normal(V))
        return wd
    finally:
        faiss.omp_set_num_threads(before)


def test_gnnlm_fit_links_the_layout_and_attaches_the_datastore(work, tmp_path):
    import pytorch_lightning as pl

    from gnnlm.lit.cli import GnnlmCLI, quiet_lightning
    from gnnlm.lit.datastore import AttachDatastore

    quiet_lightning()
    cli = GnnlmCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                   subclass_mode_data=True, run=False, save_config_kwargs={"overwrite": True},
                   args=["--model=gnnlm.lit.gnn.GNNLM", "--model.init_args.heads=2",
                         "--data=datamodules.graph.GraphDataModule",
                         f"--data.init_args.workdir={work.root}", "--data.init_args.graph.k=3",
                         "--data.init_args.graph.right=0", "--data.init_args.num_workers=0",
                         "--data.init_args.block_size=16", "--trainer.accelerator=cpu",
                         "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                         "--trainer.enable_model_summary=false",
                         f"--trainer.default_root_dir={tmp_path}"])
    model, data = cli.model, cli.datamodule
    assert data.graph == GraphConfig(left=1, right=0, k=3)        # k has one owner: the data
    assert model.graph == model.hparams.graph_layout == GraphLayout(left=1, right=0)
    assert (model.hparams.vocab_size, model.hparams.feature_dim) == (V, D_MODEL)
    assert not model.has_output_embedding and not model.has_node_features
    assert sum(isinstance(c, AttachDatastore) for c in cli.trainer.callbacks) == 1
    (metrics,) = cli.trainer.validate(model, datamodule=data, verbose=False)
    assert model.has_output_embedding and model.has_node_features
    weight, bias = data.output_embedding()
    torch.testing.assert_close(model.out_weight, weight.float())
    assert metrics["val/tokens"] == 40 and np.isfinite(metrics["val/ppl"])
    states = model._window_states
    assert states is not None and states._table is not None      # validation filled it
    model.on_train_batch_start(None, 0)   # training reads window nodes: the table is released
    assert states._table is None and states.weights_key is None
    # a device the node features were refused on is asked again when the next stage starts
    reader = model._node_features[0]
    reader._resident[torch.device("cpu")] = None
    cli.trainer.validate(model, datamodule=data, verbose=False)
    assert torch.device("cpu") not in reader._resident
