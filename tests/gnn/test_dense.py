"""gnnlm.gnn.dense: the dense layout computes exactly what GNNLMConv's message passing does,
on batches of real-shaped retrieval graphs (clipped and short windows, missing neighbours,
nodes dropped for leakage, a short last block), forward and backward, for every option."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from gnnlm.gnn.dense import layout_sizes, stack_dense, to_dense
from gnnlm.gnn.graph import METADATA, GraphConfig, build_context_graph, build_graph
from gnnlm.gnn.layer import GNNStack
from tests.fakes import randomise

D_MODEL = 16


def batch_of_graphs(cfg: GraphConfig, leakage_window=None, seed=0, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    graphs = []
    for start, T in ((100, 7), (130, 5), (160, 1)):                  # a short last block
        ids = rng.integers(0, 200, (T, 9))
        ids[rng.random((T, 9)) < 0.3] = -1                            # missing neighbours
        ids[0, :3] = [0, 199, start + 1]                              # clipped, and leaky
        g = build_graph(np.arange(start, start + T), ids, 200, cfg, leakage_window)
        g["ctx"].x = torch.randn(T, D_MODEL, dtype=dtype)
        g["nbr"].x = torch.randn(g["nbr"].num_nodes, D_MODEL, dtype=dtype)
        graphs.append(g)
    return Batch.from_data_list(graphs)


def stack_for(norm="none", edge_aggr="sum", seed=0):
    torch.manual_seed(seed)
    return GNNStack(D_MODEL, METADATA, num_layers=3, heads=4, norm=norm, edge_aggr=edge_aggr,
                    zero_init_output=False, readout=("ctx",)).double()


def two_paths(norm="none", edge_aggr="sum") -> tuple[GNNStack, GNNStack]:
    """Two stacks with the same random weights: one passes messages, the other runs dense, so a
    throwaway edit of one path's parameters shows whether the comparison would notice."""
    mp = randomise(stack_for(norm, edge_aggr))
    dense = stack_for(norm, edge_aggr)
    dense.load_state_dict(mp.state_dict())
    for layer in mp.layers:  # nothing left at its identity initialisation
        for params in (layer.w_att, layer.w_fea):
            eye = torch.eye(layer.head_dim, dtype=torch.float64)
            assert all(not torch.allclose(w, eye.expand_as(w), atol=0.1) for w in params.values())
            assert not torch.allclose(params["intra"], params["inter"], atol=0.1)
        mus = list(layer.mu.values())
        assert all((m - 1).abs().max() > 0.05 for m in mus) and len(mus) >= 2
        assert all(not torch.allclose(a, b, atol=0.05) for a, b in zip(mus, mus[1:]))
    return mp, dense


@pytest.mark.parametrize("inter", ["window", "retrieved"])
@pytest.mark.parametrize("norm,edge_aggr", [("none", "sum"), ("pre", "mean"), ("post", "mean"),
                                            ("post", "sum")])
@pytest.mark.parametrize("ctx_window,context", [(None, None), (3, 4)])
def test_dense_equals_message_passing(inter, norm, edge_aggr, ctx_window, context):
    cfg = GraphConfig(left=1, right=2, k=3, ctx_window=ctx_window, inter=inter)
    batch = batch_of_graphs(cfg, context)
    mp, dense = (stack.eval() for stack in two_paths(norm, edge_aggr))
    want = mp(batch.x_dict, batch.edge_index_dict)["ctx"]
    ctx, nbr, graph = to_dense(batch, cfg)
    got = stack_dense(dense, ctx, nbr, graph)[0][graph.ctx_mask]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert (want - batch["ctx"].x).abs().max() > 0.1                  # the layers did something


def test_gradients_equal_message_passing():
    cfg = GraphConfig(k=3)
    batch = batch_of_graphs(cfg, leakage_window=4)
    for x in (batch["ctx"].x, batch["nbr"].x):
        x.requires_grad_(True)
    mp, dense = (stack.train() for stack in two_paths("pre", "sum"))  # dropout 0: deterministic
    mp(batch.x_dict, batch.edge_index_dict)["ctx"].pow(2).sum().backward()
    want = {n: p.grad.clone() for n, p in mp.named_parameters()}
    want_x = [batch["ctx"].x.grad.clone(), batch["nbr"].x.grad.clone()]
    batch["ctx"].x.grad = batch["nbr"].x.grad = None
    ctx, nbr, graph = to_dense(batch, cfg)
    stack_dense(dense, ctx, nbr, graph)[0][graph.ctx_mask].pow(2).sum().backward()
    for name, p in dense.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-10, rtol=1e-9, msg=name)
        assert want[name].abs().max() > 0, name                      # every parameter is reached
    torch.testing.assert_close(batch["ctx"].x.grad, want_x[0])
    torch.testing.assert_close(batch["nbr"].x.grad, want_x[1])


def test_layout_places_every_node_in_its_slot():
    cfg = GraphConfig(left=1, right=1, k=2)
    batch = batch_of_graphs(cfg)
    ctx, nbr, graph = to_dense(batch, cfg)
    B, T = graph.ctx_mask.shape
    assert (B, T) == (3, 7) and graph.ctx_mask.sum() == batch["ctx"].num_nodes
    assert graph.nbr_mask.sum() == batch["nbr"].num_nodes
    assert nbr.shape == (3, 7, 2, 3, D_MODEL)
    torch.testing.assert_close(ctx[graph.ctx_mask], batch["ctx"].x)
    store = batch["nbr"]
    slots = (store.batch, store.owner_local, store.rank, store.offset + 1)
    torch.testing.assert_close(nbr[slots], store.x)
    assert not nbr[~graph.nbr_mask].any()                              # absent nodes are zero


def _without_layout_size(graphs):
    for g in graphs:
        del g.layout_size
    return graphs


def test_the_host_sizes_are_those_the_index_tensors_give():
    """Graphs carry their dense extent as Python ints (no read from the device): the layout
    built from them equals the one read from the node indices, for batches with a short last
    block, a block without neighbours, evaluation blocks without windows, and one graph; also
    once moved by PyG's ``.to`` (which turns each graph's (T, k) into a list)."""
    cfg = GraphConfig(left=1, right=2, k=3)
    rng = np.random.default_rng(0)

    def blocks(context_only=False):
        out = []
        for start, T, none in ((100, 7, False), (130, 4, True), (160, 1, False)):
            ids = np.full((T, 5), -1) if none else rng.integers(0, 200, (T, 5))
            g = (build_context_graph(np.arange(start, start + T), ids, 200, cfg) if context_only
                 else build_graph(np.arange(start, start + T), ids, 200, cfg, 4))
            g["ctx"].x = torch.randn(T, D_MODEL)
            g["nbr"].x = torch.randn(g["nbr"].num_nodes, D_MODEL)
            out.append(g)
        return out

    for graphs in (blocks(), blocks(context_only=True), blocks()[:1], blocks()[1:2]):
        copies = [g.clone() for g in graphs]
        with_sizes = Batch.from_data_list(graphs) if len(graphs) > 1 else graphs[0]
        read = (Batch.from_data_list(_without_layout_size(copies)) if len(copies) > 1
                else _without_layout_size(copies)[0])
        assert layout_sizes(with_sizes) == layout_sizes(read)
        moved = with_sizes.clone().to("cpu")
        assert layout_sizes(moved) == layout_sizes(read)
        got, want = to_dense(with_sizes, cfg), to_dense(read, cfg)
        for a, b, c in zip(got[:2], want[:2], to_dense(moved, cfg)[:2]):
            assert torch.equal(a, b) and torch.equal(c, b)
        assert torch.equal(got[2].ctx_mask, want[2].ctx_mask)
        assert torch.equal(got[2].nbr_mask, want[2].nbr_mask)
        assert got[2].ctx_slots is not None
        assert torch.equal(got[2].tokens(got[0]), got[0][got[2].ctx_mask])
        assert torch.equal(got[2].tokens(got[0]), with_sizes["ctx"].x)
    assert layout_sizes(Batch.from_data_list(blocks())) == (3, 7, 3)


def test_a_block_without_neighbours_reads_only_its_context():
    cfg = GraphConfig(k=2)
    g = build_graph([3, 4], np.full((2, 2), -1), 20, cfg)
    g["ctx"].x = torch.randn(2, D_MODEL, dtype=torch.float64)
    g["nbr"].x = torch.zeros(0, D_MODEL, dtype=torch.float64)
    stack = stack_for().eval()
    ctx, nbr, graph = to_dense(g, cfg)
    got = stack_dense(stack, ctx, nbr, graph)[0][graph.ctx_mask]
    torch.testing.assert_close(got, stack(g.x_dict, g.edge_index_dict)["ctx"])
    assert torch.isfinite(got).all()


def test_dense_path_refuses_the_hgt_baseline():
    cfg = GraphConfig(k=2)
    batch = batch_of_graphs(cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match="kind='hgt'"):
        stack_dense(GNNStack(D_MODEL, METADATA, kind="hgt"), *to_dense(batch, cfg))
