"""gnnlm.gnn.layer: GNNLMConv against a dense reference of eq. 1–4, identity start, gradients,
node types that survive every layer, and the HGTConv wrapper."""
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from gnnlm.gnn.graph import METADATA, GraphConfig, build_graph
from gnnlm.gnn.layer import GNNLMConv, GNNStack, HGTLayer

C, H = 8, 2


def small_graph():
    """3 ctx tokens, 13 nbr nodes (see tests/gnn/test_graph.py), all three edge types."""
    data = build_graph([10, 11, 12], [[5, 0], [19, -1], [7, 8]], 20, GraphConfig(k=2))
    return data, data.edge_index_dict


def features(data, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {t: torch.randn(data[t].num_nodes, C, generator=gen, dtype=dtype)
            for t in data.node_types}


# A graph with a node type that only sends ("lonely") and one with no nodes ("empty").
EXTRA_METADATA = (["ctx", "nbr", "lonely", "empty"],
                  [("ctx", "intra", "ctx"), ("nbr", "intra", "nbr"), ("nbr", "inter", "ctx"),
                   ("lonely", "inter", "ctx"), ("empty", "inter", "ctx"),
                   ("nbr", "inter", "empty")])


def extra_graph():
    x = {"ctx": torch.randn(3, C), "nbr": torch.randn(4, C), "lonely": torch.randn(2, C),
         "empty": torch.randn(0, C)}
    edges = {("ctx", "intra", "ctx"): torch.tensor([[0, 0, 1, 0, 1, 2], [0, 1, 1, 2, 2, 2]]),
             ("nbr", "intra", "nbr"): torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 1, 0]]),
             ("nbr", "inter", "ctx"): torch.tensor([[0, 1, 2, 3], [0, 0, 2, 2]]),
             ("lonely", "inter", "ctx"): torch.tensor([[0, 1], [1, 2]]),
             ("empty", "inter", "ctx"): torch.zeros(2, 0, dtype=torch.long),
             ("nbr", "inter", "empty"): torch.zeros(2, 0, dtype=torch.long)}
    return x, edges


def randomise(layer, seed=0):
    """Non-trivial μ, W^ATT, W^FEA (they start at ones and identities)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith(("w_att", "w_fea", "mu")):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if name.startswith("norm"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def reference(layer, x_dict, edge_index_dict):
    """Eq. 1–4 read literally: one target node, one edge type, one head at a time (with the
    layer's norm and its sum or mean over the edge types that reach the node)."""
    D = C // H

    def lin(module, v):
        return v @ module.weight.T + (0 if module.bias is None else module.bias)

    def norm(t, v):
        return F.layer_norm(v, (C,), layer.norm[t].weight, layer.norm[t].bias)

    h = {t: norm(t, x) for t, x in x_dict.items()} if layer.norm_mode == "pre" else x_dict
    out = {}
    for n_type, x in x_dict.items():
        agg = torch.zeros_like(x)
        reached = torch.zeros(x.shape[0], dtype=x.dtype)
        for (s_type, rel, d_type), edge_index in edge_index_dict.items():
            if d_type != n_type:
                continue
            mu = layer.mu[f"{s_type}__{rel}__{d_type}"]
            for n in range(x.shape[0]):
                sources = edge_index[0][edge_index[1] == n].tolist()
                if not sources:
                    continue
                reached[n] += 1
                Q = lin(layer.q_lin[n_type], h[n_type][n])
                for head in range(H):
                    cut = slice(head * D, (head + 1) * D)
                    scores, feats = [], []
                    for s in sources:
                        K = lin(layer.k_lin[s_type], h[s_type][s])
                        V = lin(layer.v_lin[s_type], h[s_type][s])
                        scores.append(K[cut] @ layer.w_att[rel][head] @ Q[cut]
                                      * mu[head] / math.sqrt(D))
                        feats.append(V[cut] @ layer.w_fea[rel][head])
                    att = torch.softmax(torch.stack(scores), dim=0)
                    agg[n, cut] += (att[:, None] * torch.stack(feats)).sum(0)
        if layer.edge_aggr == "mean":
            agg = agg / reached.clamp(min=1)[:, None]
        out[n_type] = lin(layer.o_lin[n_type], agg) + x
        if layer.norm_mode == "post":
            out[n_type] = norm(n_type, out[n_type])
    return out


@pytest.mark.parametrize("norm,edge_aggr", [("none", "sum"), ("pre", "sum"), ("post", "mean"),
                                            ("none", "mean")])
def test_matches_loop_reference(norm, edge_aggr):
    torch.manual_seed(0)
    data, edges = small_graph()
    layer = GNNLMConv(C, METADATA, heads=H, norm=norm, edge_aggr=edge_aggr,
                      zero_init_output=False).double()
    randomise(layer)
    x = features(data, torch.float64)
    got, want = layer(x, edges), reference(layer, x, edges)
    assert set(got) == set(want) == {"ctx", "nbr"}
    for t in want:
        torch.testing.assert_close(got[t], want[t], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[t], x[t])


def test_matches_reference_with_extra_node_types():
    torch.manual_seed(1)
    x, edges = extra_graph()
    layer = GNNLMConv(C, EXTRA_METADATA, heads=H, zero_init_output=False)
    randomise(layer)
    got, want = layer(x, edges), reference(layer, x, edges)
    for t in want:
        torch.testing.assert_close(got[t], want[t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["none", "pre"])
def test_zero_init_stack_is_the_identity(norm):
    data, edges = small_graph()
    x = features(data)
    stack = GNNStack(C, METADATA, num_layers=3, heads=H, dropout=0.1, norm=norm)
    out = stack(x, edges)
    for t in x:
        assert torch.equal(out[t], x[t])


@pytest.mark.parametrize("kind", ["gnnlm", "hgt"])
def test_every_node_type_survives_three_layers(kind):
    torch.manual_seed(2)
    x, edges = extra_graph()
    stack = GNNStack(C, EXTRA_METADATA, num_layers=3, heads=H, kind=kind,
                     zero_init_output=False)
    out = stack(x, edges)
    assert set(out) == set(x)
    for t in x:
        assert out[t].shape == x[t].shape and torch.isfinite(out[t]).all()
    assert not torch.allclose(out["ctx"], x["ctx"])
    out["ctx"].sum().backward()  # an empty type and empty edge sets still differentiate


def test_empty_neighbour_set():
    data = build_graph([3, 4], np.full((2, 5), -1), 20, GraphConfig(k=5))
    x = features(data)
    for kind in ("gnnlm", "hgt"):
        out = GNNStack(C, METADATA, heads=H, kind=kind, zero_init_output=False)(
            x, data.edge_index_dict)
        assert out["nbr"].shape == (0, C) and out["ctx"].shape == (2, C)


def test_gradients_reach_every_parameter_once_w_o_moves():
    torch.manual_seed(3)
    data, edges = small_graph()
    x = features(data)
    target = {t: torch.randn_like(v) for t, v in x.items()}
    stack = GNNStack(C, METADATA, num_layers=3, heads=H, norm="pre")
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        out = stack(x, edges)
        sum((out[t] * target[t]).sum() for t in out).backward()
        return {name: p.grad for name, p in stack.named_parameters()}

    grads = step()  # W^o = 0 blocks every path but its own
    for name, grad in grads.items():
        assert (grad.abs().sum() > 0) == (".o_lin." in name), name
    optimizer.step()
    for name, grad in step().items():
        assert grad is not None and grad.abs().sum() > 0, name


def test_hgt_layer_is_hgtconv_plus_carried_types():
    torch.manual_seed(4)
    x, edges = extra_graph()
    layer = HGTLayer(C, EXTRA_METADATA, heads=H)
    raw = layer.conv(x, edges)
    assert "lonely" not in raw or raw["lonely"] is None  # the pitfall the wrapper covers
    out = layer(x, edges)
    assert set(out) == set(x)
    assert torch.equal(out["lonely"], x["lonely"])
    torch.testing.assert_close(out["ctx"], raw["ctx"])
    torch.testing.assert_close(out["nbr"], raw["nbr"])


def test_bad_arguments():
    data, edges = small_graph()
    x = features(data)
    with pytest.raises(ValueError, match=r"\(got channels=10, heads=4\)"):
        GNNLMConv(10, METADATA, heads=4)
    with pytest.raises(ValueError, match=r"\(got channels=10, heads=4\)"):
        HGTLayer(10, METADATA, heads=4)
    with pytest.raises(ValueError, match=r"\(got 1.5\)"):
        GNNLMConv(C, METADATA, heads=H, dropout=1.5)
    with pytest.raises(ValueError, match=r"\(got 0\)"):
        GNNStack(C, METADATA, num_layers=0)
    with pytest.raises(ValueError, match=r"\(got 'gat'\)"):
        GNNStack(C, METADATA, kind="gat")
    with pytest.raises(ValueError, match=r"\(got 'batch'\)"):
        GNNLMConv(C, METADATA, heads=H, norm="batch")
    with pytest.raises(ValueError, match=r"\(got 'max'\)"):
        GNNStack(C, METADATA, edge_aggr="max")
    with pytest.raises(ValueError, match="kind='hgt'"):
        GNNStack(C, METADATA, kind="hgt", norm="post")
    for layer in (GNNLMConv(C, METADATA, heads=H), HGTLayer(C, METADATA, heads=H)):
        with pytest.raises(ValueError, match=r"\(got \('ctx', 'inter', 'nbr'\)\)"):
            layer(x, {**edges, ("ctx", "inter", "nbr"): torch.zeros(2, 0, dtype=torch.long)})
        with pytest.raises(ValueError, match=r"\(got 'doc'\)"):
            layer({**x, "doc": torch.randn(1, C)}, edges)
        with pytest.raises(ValueError, match=r"\(got x_dict with"):
            layer({"ctx": x["ctx"]}, edges)


def test_readout_restricts_the_last_layer_to_the_readout_types():
    """A stack read out at ``ctx`` gives the same ``ctx`` output as a full one with the same
    weights, and has no parameter the ``ctx`` output does not depend on (DDP needs that)."""
    torch.manual_seed(0)
    data = build_graph(np.arange(5, 10), np.array([[3, 40, -1]] * 5), 60, GraphConfig(k=3))
    x = {"ctx": torch.randn(5, 8), "nbr": torch.randn(data["nbr"].num_nodes, 8)}
    full = GNNStack(8, METADATA, num_layers=3, heads=2, zero_init_output=False)
    readout = GNNStack(8, METADATA, num_layers=3, heads=2, zero_init_output=False,
                       readout=("ctx",))
    missing, unexpected = readout.load_state_dict(full.state_dict(), strict=False)
    assert not missing and unexpected                  # only the last layer's nbr-target weights
    out = readout(x, data.edge_index_dict)
    torch.testing.assert_close(out["ctx"], full(x, data.edge_index_dict)["ctx"])
    assert set(out) == {"ctx", "nbr"}
    out["ctx"].sum().backward()
    assert all(p.grad is not None for p in readout.parameters())
