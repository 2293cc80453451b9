"""gnnlm.gnn.graph: exact edge sets on a hand-worked block, the leakage rule (checked against a loop
reference and by reachability over the graph's edges), the reference topology, batching."""
from collections import deque

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from gnnlm.gnn.graph import (
    CTX_INTRA,
    EDGE_TYPES,
    METADATA,
    NBR_INTER,
    NBR_INTRA,
    NODE_TYPES,
    GraphConfig,
    build_context_graph,
    build_graph,
    graph_sizes,
    leaky,
    select_neighbors,
)

# Hand-worked block: T = 3 valid tokens at split positions 10, 11, 12; K = 2; l = r = 1;
# n_train = 20. Token 0 retrieved 5 and 0 (window of 0 clipped at -1), token 1 retrieved 19
# (window clipped at 20) and nothing, token 2 retrieved 7 and 8 (windows overlap, kept twice).
CTX_POS = np.array([10, 11, 12])
NBR_IDS = np.array([[5, 0], [19, -1], [7, 8]])
N_TRAIN = 20
# nbr nodes in (token, rank, offset) order:
#   0:4 1:5 2:6 | 3:0 4:1 | 5:18 6:19 | 7:6 8:7 9:8 | 10:7 11:8 12:9
TRAIN_POS = [4, 5, 6, 0, 1, 18, 19, 6, 7, 8, 7, 8, 9]
OFFSET = [-1, 0, 1, 0, 1, -1, 0, -1, 0, 1, -1, 0, 1]
RANK = [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
OWNER = [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2]
ADJACENT = {(0, 1), (1, 2), (3, 4), (5, 6), (7, 8), (8, 9), (10, 11), (11, 12)}


def edge_set(data, edge_type):
    return set(map(tuple, data[edge_type].edge_index.t().tolist()))


def test_schema():
    assert METADATA == (NODE_TYPES, EDGE_TYPES)
    assert EDGE_TYPES == (("ctx", "intra", "ctx"), ("nbr", "intra", "nbr"),
                          ("nbr", "inter", "ctx"))
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2))
    assert set(data.node_types) == set(NODE_TYPES) and set(data.edge_types) == set(EDGE_TYPES)
    for node_type in NODE_TYPES:
        for key, value in data[node_type].items():
            assert "index" not in key and "batch" not in key and "pos" != key
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.int64
    for edge_type in EDGE_TYPES:
        assert data[edge_type].edge_index.dtype == torch.int64


def test_hand_worked_example():
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(left=1, right=1, k=2))
    assert data["ctx"].num_nodes == 3 and data["nbr"].num_nodes == 13
    assert data["ctx"].split_pos.tolist() == [10, 11, 12]
    assert data["nbr"].train_pos.tolist() == TRAIN_POS
    assert data["nbr"].offset.tolist() == OFFSET
    assert data["nbr"].rank.tolist() == RANK
    assert data["nbr"].owner_local.tolist() == OWNER
    assert edge_set(data, CTX_INTRA) == {(0, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 2)}
    loops = {(i, i) for i in range(13)}
    assert edge_set(data, NBR_INTRA) == loops | ADJACENT | {(b, a) for a, b in ADJACENT}
    assert data[NBR_INTRA].edge_index.shape[1] == 13 + 2 * 8  # no duplicates
    assert edge_set(data, NBR_INTER) == {(i, OWNER[i]) for i in range(13)}
    # the e-th inter edge starts at nbr node e: the owner survives batching through it
    assert data[NBR_INTER].edge_index[0].tolist() == list(range(13))


def test_ctx_window():
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2, ctx_window=2))
    assert edge_set(data, CTX_INTRA) == {(0, 0), (0, 1), (1, 1), (1, 2), (2, 2)}
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2, ctx_window=1))
    assert edge_set(data, CTX_INTRA) == {(0, 0), (1, 1), (2, 2)}


def test_k_truncation_and_window_sizes():
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(left=1, right=1, k=1))
    assert data["nbr"].train_pos.tolist() == [4, 5, 6, 18, 19, 6, 7, 8]
    assert data["nbr"].rank.tolist() == [0] * 8
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(left=0, right=2, k=2))
    assert data["nbr"].train_pos.tolist() == [5, 6, 7, 0, 1, 2, 19, 7, 8, 9, 8, 9, 10]
    assert data["nbr"].offset.tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2]


def test_leakage_rule_hand_worked():
    # C = 2. Token 0 (target 11) retrieved 9: window 8 9 10; node 10 has read 8..10, not 11 or
    # 12, so it stays. Token 1 (target 12) retrieved 14, which has read 12: it is skipped for the
    # next stored neighbour, 3 (window 2 3 4). A node q leaks to a later token too: token 0's
    # retrieved 13 (reads 11..13, reaches targets 11 and 12) is skipped for 9.
    data = build_graph([11, 12], [[13, 9], [14, 3]], 20, GraphConfig(k=1), leakage_window=2)
    assert data["nbr"].train_pos.tolist() == [8, 9, 10, 2, 3, 4]
    assert data["nbr"].owner_local.tolist() == [0, 0, 0, 1, 1, 1]
    assert (data.windows_masked, data.nodes_masked) == (2, 0)
    # window mates are dropped alone: the token with target 5 retrieved 4 (reads 1..4, kept);
    # its mate 5 is the target itself and is dropped, its mate 3 stays
    data = build_graph([5], [[4]], 10, GraphConfig(k=1), leakage_window=3)
    assert data["nbr"].train_pos.tolist() == [3, 4]
    assert (data.windows_masked, data.nodes_masked) == (0, 1)
    assert edge_set(data, NBR_INTRA) == {(0, 0), (1, 1), (0, 1), (1, 0)}
    # valid/test graphs (leakage_window None) keep everything
    data = build_graph([5], [[4]], 10, GraphConfig(k=1))
    assert data["nbr"].train_pos.tolist() == [3, 4, 5] and data.windows_masked == 0


def test_a_leakage_context_of_zero_masks_nothing():
    """``neighbors.leakage_window: 0`` is the no-masking ablation: C = 0 is not a rule that
    still drops each reachable target (node 5 below), the graph is the unmasked one."""
    for ctx_pos, nbr_ids, n_train in (([5], [[4]], 10), ([11, 12], [[13, 9], [14, 3]], 20),
                                      (CTX_POS, NBR_IDS, N_TRAIN)):
        cfg = GraphConfig(k=2)
        off, none = (build_graph(ctx_pos, nbr_ids, n_train, cfg, leakage_window=c)
                     for c in (0, None))
        assert (off.windows_masked, off.nodes_masked) == (0, 0)
        for store in ("ctx", "nbr"):
            assert set(off[store].keys()) == set(none[store].keys())
            for key, value in none[store].items():
                got = off[store][key]
                assert (torch.equal(got, value) if isinstance(value, torch.Tensor)
                        else got == value), (store, key)
        for edge_type in EDGE_TYPES:
            assert torch.equal(off[edge_type].edge_index, none[edge_type].edge_index)
    assert build_graph([5], [[4]], 10, GraphConfig(k=1), 0)["nbr"].train_pos.tolist() == [3, 4, 5]


def test_select_neighbors_skips_missing_and_masked_in_order():
    ids = np.array([[5, -1, 7, 8], [-1, -1, -1, -1]])
    keep = np.array([[True, True, False, True], [True] * 4])
    np.testing.assert_array_equal(select_neighbors(ids, 2, keep), [[5, 8], [-1, -1]])
    np.testing.assert_array_equal(select_neighbors(ids, 5), [[5, 7, 8, -1, -1], [-1] * 5])


def test_leaky_is_the_rule_over_every_later_target():
    ctx_pos = np.array([10, 11, 12, 20])
    q = np.arange(0, 30)
    for owner in range(4):
        reach = ctx_pos[owner:]
        expected = [(q_ - 3 <= reach).__and__(reach <= q_).any() for q_ in q]
        assert leaky(q, np.full_like(q, owner), ctx_pos, 3).tolist() == expected


def test_retrieved_inter_edges_link_only_the_retrieved_token():
    data = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2, inter="retrieved"))
    centres = [i for i, off in enumerate(OFFSET) if off == 0]
    assert edge_set(data, NBR_INTER) == {(i, OWNER[i]) for i in centres}
    loops = {(i, i) for i in range(13)}
    assert edge_set(data, NBR_INTRA) == loops | ADJACENT | {(b, a) for a, b in ADJACENT}
    assert graph_sizes(3, GraphConfig(k=2, inter="retrieved"))[NBR_INTER] == 6


def reference_graph(ctx_pos, nbr_ids, n_train, cfg, context):
    """Loop-by-loop reading of the schema; nodes named by (owner, rank, offset). With a
    ``context`` C, retrieved tokens that have read the target of their token or of a later one
    are skipped, and window nodes that have are dropped."""
    T = len(ctx_pos)

    def leaks(q, owner):
        return context is not None and any(q - context <= ctx_pos[i] <= q
                                           for i in range(owner, T))

    nodes, ctx_edges, intra, inter = {}, set(), set(), set()
    for i in range(T):
        for j in range(i + 1):
            if cfg.ctx_window is None or i - j < cfg.ctx_window:
                ctx_edges.add((j, i))
        chosen = [p for p in nbr_ids[i] if p >= 0 and not leaks(p, i)][:cfg.k]
        for rank, p in enumerate(chosen):
            for off in range(-cfg.left, cfg.right + 1):
                q = p + off
                if 0 <= q < n_train and not leaks(q, i):
                    nodes[(i, rank, off)] = q
    for (i, rank, off) in nodes:
        intra.add(((i, rank, off), (i, rank, off)))
        if cfg.inter == "window" or off == 0:
            inter.add(((i, rank, off), i))
        if (i, rank, off + 1) in nodes:
            intra.add(((i, rank, off), (i, rank, off + 1)))
            intra.add(((i, rank, off + 1), (i, rank, off)))
    return nodes, ctx_edges, intra, inter


@pytest.mark.parametrize("context,inter", [(None, "window"), (5, "window"), (5, "retrieved")])
def test_random_block_matches_loop_reference(context, inter):
    rng = np.random.default_rng(context or 0)
    T, K, n_train = 16, 8, 60
    cfg = GraphConfig(left=2, right=3, k=6, ctx_window=5, inter=inter)
    ctx_pos = 20 + np.arange(T) * 2  # gaps between positions are allowed
    nbr_ids = rng.integers(0, n_train, size=(T, K))
    nbr_ids[rng.random((T, K)) < 0.2] = -1
    data = build_graph(ctx_pos, nbr_ids, n_train, cfg, leakage_window=context)

    nbr = data["nbr"]
    names = list(zip(nbr.owner_local.tolist(), nbr.rank.tolist(), nbr.offset.tolist()))
    nodes, ctx_edges, intra, inter_edges = reference_graph(ctx_pos, nbr_ids, n_train, cfg,
                                                           context)
    assert dict(zip(names, nbr.train_pos.tolist())) == nodes and len(names) == len(nodes)
    assert edge_set(data, CTX_INTRA) == ctx_edges
    assert {(names[a], names[b]) for a, b in edge_set(data, NBR_INTRA)} == intra
    assert {(names[a], b) for a, b in edge_set(data, NBR_INTER)} == inter_edges
    if context:
        assert data.windows_masked + data.nodes_masked > 0


def reachable_ctx(data) -> list[set[int]]:
    """Per nbr node, the ctx nodes its information reaches: a BFS along every edge (source →
    target) of every edge type, any number of hops (as many layers as one likes)."""
    n_ctx = data["ctx"].num_nodes
    offset = {"ctx": 0, "nbr": n_ctx}
    out: list[list[int]] = [[] for _ in range(n_ctx + data["nbr"].num_nodes)]
    for src_type, _, dst_type in data.edge_types:
        src, dst = data[src_type, _, dst_type].edge_index.tolist()
        for a, b in zip(src, dst):
            out[a + offset[src_type]].append(b + offset[dst_type])
    reach = []
    for start in range(n_ctx, len(out)):
        seen, queue = {start}, deque([start])
        while queue:
            for v in out[queue.popleft()]:
                if v not in seen:
                    seen.add(v)
                    queue.append(v)
        reach.append({v for v in seen if v < n_ctx})
    return reach


def reachable_leaks(data, C: int) -> list[tuple[int, int]]:
    """(train position q, ctx target t) for every window node that has read, or is, the target t
    of a ctx token it reaches (q − C ≤ t ≤ q: the README's rule, read off the edges)."""
    q = data["nbr"].train_pos.tolist()
    t = data["ctx"].split_pos.tolist()
    return [(q[n], t[j]) for n, reach in enumerate(reachable_ctx(data)) for j in reach
            if q[n] - C <= t[j] <= q[n]]


# Synthetic leaky retrievals, C = 4, targets with gaps of 10 (and one of 1 at the end). Per
# token i (target t): t + 2 has read t; t + 11 has read the next target (reached through the
# causal edges); t − 9 has read only an earlier target (never reached: kept); t − 1 is clean
# but its right mate t is the target itself (dropped alone); 3 reads nothing. Each row ends
# with far-away positions, which take the place of the skipped ones.
C_SYN = 4
CTX_SYN = np.array([20, 30, 40, 50, 60, 61])
NBR_SYN = np.stack([[t + 2, t + 11, t - 9, t - 1, 3, 100 + 3 * i, 120 + 3 * i, -1]
                    for i, t in enumerate(CTX_SYN)])


@pytest.mark.parametrize("inter", ["window", "retrieved"])
@pytest.mark.parametrize("ctx_window", [None, 2])
def test_no_window_node_has_read_a_target_it_can_reach(inter, ctx_window):
    """The leakage property checked by reachability over the edges (not by ``leaky``): on train
    graphs no surviving window node has read, or is, the target of a ctx token it can reach;
    the same blocks without the rule (or with C = 0, no masking) do leak, so the check bites."""
    cfg = GraphConfig(left=1, right=1, k=4, ctx_window=ctx_window, inter=inter)
    rng = np.random.default_rng(0)
    ctx_rand = 40 + np.cumsum(rng.integers(1, 4, 12))                   # gaps of 1 to 3
    nbr_rand = rng.integers(30, 90, (12, 10))                           # many near the block
    nbr_rand[rng.random((12, 10)) < 0.1] = -1
    for ctx_pos, nbr_ids, n_train in ((CTX_SYN, NBR_SYN, 140), (ctx_rand, nbr_rand, 95)):
        masked = build_graph(ctx_pos, nbr_ids, n_train, cfg, leakage_window=C_SYN)
        assert masked["nbr"].num_nodes > 0 and reachable_leaks(masked, C_SYN) == []
        # the rule assumes a node reaches its own token and every later one: the edges agree
        # (a ctx window of 2 still chains to the end of the block)
        T = len(ctx_pos)
        owners = masked["nbr"].owner_local.tolist()
        for owner, reach in zip(owners, reachable_ctx(masked)):
            assert reach == set(range(owner, T))
        assert masked.windows_masked > 0 and masked.nodes_masked > 0
        for unmasked in (build_graph(ctx_pos, nbr_ids, n_train, cfg),
                         build_graph(ctx_pos, nbr_ids, n_train, cfg, leakage_window=0)):
            assert len(reachable_leaks(unmasked, C_SYN)) > 0
            assert unmasked.windows_masked == unmasked.nodes_masked == 0

    # the known retrievals: leaky ones skipped, the clean ones kept, the leaky mate dropped alone
    data = build_graph(CTX_SYN, NBR_SYN, 140, cfg, leakage_window=C_SYN)
    nbr = data["nbr"]
    for i, t in enumerate(CTX_SYN):
        mine = nbr.owner_local == i
        retrieved = nbr.train_pos[mine & (nbr.offset == 0)].tolist()
        # t + 11 reads t + 7 … t + 11: the next target when it is t + 10 (not for the last two)
        next_read = i + 1 < len(CTX_SYN) and CTX_SYN[i + 1] == t + 10
        expected = ([] if next_read else [t + 11]) + [t - 9, t - 1, 3, 100 + 3 * i]
        assert retrieved == expected[:cfg.k], (i, retrieved)
        window = nbr.train_pos[mine & (nbr.rank == expected.index(t - 1))].tolist()
        assert window == [t - 2, t - 1]                                 # its mate t is dropped


def test_graph_sizes_bound_a_full_block():
    cfg = GraphConfig(left=1, right=2, k=3, ctx_window=4)
    T = 6
    nbr_ids = np.arange(T * 5).reshape(T, 5) + 10  # all present, none clipped
    data = build_graph(np.arange(T), nbr_ids, 100, cfg)
    sizes = graph_sizes(T, cfg)
    assert sizes["ctx"] == data["ctx"].num_nodes and sizes["nbr"] == data["nbr"].num_nodes
    for edge_type in EDGE_TYPES:
        assert sizes[edge_type] == data[edge_type].edge_index.shape[1]


def test_batching_keeps_positions_and_offsets_edges():
    first = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2))
    second = build_graph([3, 4], [[15, 2], [-1, 9]], N_TRAIN, GraphConfig(k=2))
    batch = Batch.from_data_list([first, second])
    n1, t1 = first["nbr"].num_nodes, first["ctx"].num_nodes
    assert batch["nbr"].train_pos.tolist() == TRAIN_POS + second["nbr"].train_pos.tolist()
    assert batch["ctx"].split_pos.tolist() == [10, 11, 12, 3, 4]
    assert batch["nbr"].offset.tolist() == OFFSET + second["nbr"].offset.tolist()
    shift = {"ctx": t1, "nbr": n1}
    for src, rel, dst in EDGE_TYPES:
        expected = torch.cat([first[src, rel, dst].edge_index,
                              second[src, rel, dst].edge_index
                              + torch.tensor([[shift[src]], [shift[dst]]])], dim=1)
        assert torch.equal(batch[src, rel, dst].edge_index, expected)
    assert batch["nbr"].batch.tolist() == [0] * n1 + [1] * second["nbr"].num_nodes


def test_no_neighbours_gives_an_empty_nbr_set_that_batches():
    empty = build_graph([7, 8], np.full((2, 4), -1), N_TRAIN, GraphConfig(k=4))
    assert empty["nbr"].num_nodes == 0 and empty["nbr"].train_pos.shape == (0,)
    assert empty[NBR_INTRA].edge_index.shape == (2, 0)
    assert empty[NBR_INTER].edge_index.shape == (2, 0)
    assert edge_set(empty, CTX_INTRA) == {(0, 0), (0, 1), (1, 1)}
    full = build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(k=2))
    batch = Batch.from_data_list([empty, full])
    assert batch["nbr"].num_nodes == 13 and batch["ctx"].num_nodes == 5
    assert batch[NBR_INTER].edge_index[1].min().item() == 2  # owners moved past the empty block
    assert batch["nbr"].batch.tolist() == [1] * 13


def test_context_graph_names_the_windows_by_position():
    cfg = GraphConfig(left=1, right=1, k=2)
    data = build_context_graph(CTX_POS, NBR_IDS, N_TRAIN, cfg)
    assert data["ctx"].retrieved.tolist() == [[5, 0], [19, -1], [7, 8]]
    assert data["nbr"].num_nodes == 0
    # the same causal edges as the block with its windows
    assert edge_set(data, CTX_INTRA) == edge_set(build_graph(CTX_POS, NBR_IDS, N_TRAIN, cfg),
                                                 CTX_INTRA)
    batch = Batch.from_data_list([data, data])
    assert batch["ctx"].retrieved.shape == (6, 2)                     # positions are not offset
    assert batch["ctx"].retrieved[3:].tolist() == [[5, 0], [19, -1], [7, 8]]
    with pytest.raises(ValueError, match=r"\(got"):
        build_context_graph(CTX_POS, NBR_IDS, 19, cfg)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"\(got"):
        GraphConfig(left=-1)
    with pytest.raises(ValueError, match=r"\(got"):
        GraphConfig(k=0)
    with pytest.raises(ValueError, match=r"\(got"):
        GraphConfig(ctx_window=0)
    with pytest.raises(ValueError, match=r"\(got"):
        build_graph(CTX_POS, NBR_IDS[:2], N_TRAIN, GraphConfig())
    with pytest.raises(ValueError, match=r"\(got"):
        build_graph(CTX_POS, NBR_IDS, 19, GraphConfig())  # id 19 is outside the datastore
    with pytest.raises(ValueError, match=r"\(got"):
        build_graph(CTX_POS, NBR_IDS, N_TRAIN, GraphConfig(), leakage_window=-1)
    with pytest.raises(ValueError, match=r"\(got 'all'\)"):
        GraphConfig(inter="all")
    with pytest.raises(ValueError, match="increase"):
        build_graph([3, 2, 1], NBR_IDS, N_TRAIN, GraphConfig())
