"""gnnlm.gnn.window_states: each retrieved window computed once gives what one window per retrieval
gives (``gnn_dense.conv_dense`` on ``build_graph`` blocks), for every layer option, with windows
clipped at the split's edges, tokens with fewer than k neighbours, and windows shared by many
tokens; the table is filled once per position and emptied when the weights change. On a
WikiText-2 slice (the test pipeline's work directory), the trained GNN-LM and every layer option
score each valid token the same to 1e-5 in float32 through the data module both ways, and the
pipeline's GNN row is those scores at the k it chose on valid."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from gnnlm.gnn.dense import DenseGraph, stack_dense, to_dense
from gnnlm.gnn.graph import METADATA, GraphConfig, build_context_graph, build_graph
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.window_states import WindowStates
from gnnlm.lit.gnn import GNNLM
from gnnlm.utils import devices
from gnnlm.workdir.checkpoints import load_checkpoint
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from tests.fakes import randomise

D_MODEL, N_TRAIN = 16, 200


def blocks(cfg: GraphConfig, seed: int = 0):
    """Three blocks (7, 5 and 1 tokens) as graphs with a window per retrieval and as context
    blocks, and the train node features they read."""
    rng = np.random.default_rng(seed)
    train = rng.standard_normal((N_TRAIN, D_MODEL))
    ids = rng.integers(0, N_TRAIN, (13, 9))
    ids[rng.random((13, 9)) < 0.3] = -1                               # fewer than k neighbours
    ids[:, :2] = rng.permutation(6)[:2]                               # windows many tokens share
    ids[0, 2:4] = [0, N_TRAIN - 1]                                    # clipped at both ends
    ctx_x = torch.from_numpy(rng.standard_normal((13, D_MODEL)))
    with_windows, context = [], []
    for a, b in ((0, 7), (7, 12), (12, 13)):
        g = build_graph(np.arange(100 + a, 100 + b), ids[a:b], N_TRAIN, cfg)
        g["ctx"].x, g["nbr"].x = ctx_x[a:b], torch.from_numpy(train[g["nbr"].train_pos])
        with_windows.append(g)
        c = build_context_graph(np.arange(100 + a, 100 + b), ids[a:b], N_TRAIN, cfg)
        c["ctx"].x = ctx_x[a:b]
        context.append(c)
    return Batch.from_data_list(with_windows), Batch.from_data_list(context), train


def stack_for(norm="none", edge_aggr="sum", layers=3):
    """A stack with every parameter random (``fakes.randomise``): W^ATT, W^FEA and μ of each
    relation differ, so reading one relation's for another's changes the numbers."""
    return randomise(GNNStack(D_MODEL, METADATA, num_layers=layers, heads=4, norm=norm,
                              edge_aggr=edge_aggr, zero_init_output=False,
                              readout=("ctx",)).double()).eval()


def features_of(train: np.ndarray):
    return lambda positions: train[positions]


@pytest.mark.parametrize("inter", ["window", "retrieved"])
@pytest.mark.parametrize("norm,edge_aggr", [("none", "sum"), ("pre", "mean"), ("post", "mean"),
                                            ("post", "sum")])
@pytest.mark.parametrize("ctx_window,layers", [(None, 3), (3, 2), (None, 1)])
def test_window_states_equal_a_window_per_retrieval(inter, norm, edge_aggr, ctx_window, layers):
    cfg = GraphConfig(left=1, right=2, k=4, ctx_window=ctx_window, inter=inter)
    with_windows, context, train = blocks(cfg)
    stack = stack_for(norm, edge_aggr, layers)
    want_ctx, want_nbr, want_graph = to_dense(with_windows, cfg)
    want = stack_dense(stack, want_ctx, want_nbr, want_graph)[0][want_graph.ctx_mask]
    states = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    ctx, _, graph = to_dense(context, cfg)
    assert graph.retrieved is not None and graph.retrieved.shape == (3, 7, 4)
    got = states(ctx.double(), graph)[graph.ctx_mask]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # every distinct retrieved position was computed once (none with a single layer)
    distinct = len(np.unique(context["ctx"].retrieved[context["ctx"].retrieved >= 0]))
    assert states.computed == (distinct if layers > 1 else 0)
    assert distinct < int((context["ctx"].retrieved >= 0).sum())      # windows were shared


def test_the_table_is_reused_and_emptied_when_the_weights_change():
    cfg = GraphConfig(k=4)
    _, context, train = blocks(cfg, seed=1)
    stack = stack_for()
    states = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    ctx, _, graph = to_dense(context, cfg)
    first = states(ctx, graph)
    computed = states.computed
    torch.testing.assert_close(states(ctx, graph), first, rtol=0, atol=0)
    assert states.computed == computed                                # read, not recomputed
    with torch.no_grad():
        stack.layers[0].o_lin["nbr"].weight.mul_(2.0)                 # an in-place update
    changed = states(ctx, graph)
    assert states.computed == computed and not torch.allclose(changed, first)
    fresh = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    torch.testing.assert_close(changed, fresh(ctx, graph), rtol=0, atol=0)


# Writes that ``_version`` does not see, each to what the table keeps (layer 0's window nodes:
# the intra relation and its μ) and to what the layers fold at every read (the inter relation).
def _write_through_data(stack):
    stack.layers[0].w_att["intra"].data.mul_(1.5)
    stack.layers[1].w_att["inter"].data.mul_(1.5)


def _copy_through_data(stack):
    stack.layers[0].mu["nbr__intra__nbr"].data.copy_(torch.full((4,), 0.25, dtype=torch.float64))
    stack.layers[1].w_fea["inter"].data.copy_(stack.layers[1].w_fea["inter"].data * -1)


def _swap_relations(stack):
    for layer, relation in ((stack.layers[0], "intra"), (stack.layers[1], "inter")):
        att, fea = layer.w_att[relation].data.clone(), layer.w_fea[relation].data.clone()
        layer.w_att[relation].data.copy_(fea)
        layer.w_fea[relation].data.copy_(att)


def _fused_adamw_step(stack):
    for p in stack.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(stack.parameters(), lr=0.1, fused=True).step()


def _load_state_dict(stack):
    other = randomise(stack_for(), seed=7)
    stack.load_state_dict(other.state_dict())


@pytest.mark.parametrize("write", [_write_through_data, _copy_through_data, _swap_relations,
                                   _fused_adamw_step, _load_state_dict])
def test_any_write_to_the_weights_empties_the_table(write):
    """However the weights are written (through ``.data``, which ``_version`` does not see, a
    fused optimiser step, a state dict), the next read equals a table computed afresh. Without
    autograd, as in evaluation: the folded relation maps are kept then too (``dense.fold``)."""
    cfg = GraphConfig(k=4)
    _, context, train = blocks(cfg, seed=1)
    stack = stack_for()
    states = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    ctx, _, graph = to_dense(context, cfg)
    with torch.no_grad():
        first = states(ctx, graph)
    versions = [p._version for p in stack.parameters()]
    write(stack)
    with torch.no_grad():
        changed = states(ctx, graph)
    # with autograd nothing folded is kept: the reference reads every weight as it is now
    fresh = WindowStates(stack, features_of(train), N_TRAIN, cfg)(ctx, graph).detach()
    torch.testing.assert_close(changed, fresh, rtol=0, atol=0)
    assert not torch.allclose(changed, first)
    if write in (_write_through_data, _copy_through_data, _swap_relations):
        assert [p._version for p in stack.parameters()] == versions  # what the old key missed


def test_a_full_table_starts_again_with_the_same_numbers():
    cfg = GraphConfig(k=4)
    _, context, train = blocks(cfg, seed=2)
    stack = stack_for()
    ctx, _, graph = to_dense(context, cfg)
    want = WindowStates(stack, features_of(train), N_TRAIN, cfg)(ctx, graph)
    retrieved = graph.retrieved
    per_block = [len(torch.unique(r[r >= 0])) for r in retrieved]
    distinct = len(torch.unique(retrieved[retrieved >= 0]))
    small = WindowStates(stack, features_of(train), N_TRAIN, cfg, max_windows=max(per_block))
    assert max(per_block) < distinct
    for block in (0, 1, 2, 0):  # one block at a time: the table fills, then starts again
        one = DenseGraph(graph.ctx_mask[block:block + 1], graph.nbr_mask[block:block + 1],
                         graph.center, graph.inter, graph.ctx_window, retrieved[block:block + 1])
        torch.testing.assert_close(small(ctx[block:block + 1], one), want[block:block + 1],
                                   rtol=1e-12, atol=1e-12)
    assert small.computed > distinct                                  # it did start again
    with pytest.raises(ValueError, match=f"retrieves {distinct} distinct windows but"):
        small(ctx, graph)


def test_a_gpu_without_room_for_every_window_keeps_fewer_with_the_same_numbers(monkeypatch,
                                                                               capsys):
    """A GPU allocates the table at once: by default it keeps what half its free memory holds
    (said once), and starts again when that fills, with the same numbers; a given
    ``max_windows`` is kept as given."""
    cfg = GraphConfig(k=4)
    _, context, train = blocks(cfg, seed=2)
    stack = stack_for()
    ctx, _, graph = to_dense(context, cfg)
    full = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    want = full(ctx, graph)
    assert full.max_windows == N_TRAIN and full._table is not None
    row_bytes = full._table[:, 0].numel() * full._table.element_size()
    per_block = [len(torch.unique(r[r >= 0])) for r in graph.retrieved]
    rows = max(per_block)
    assert rows < len(torch.unique(graph.retrieved[graph.retrieved >= 0]))
    room = 2 * (8 * (N_TRAIN + 1) + (1 + rows) * row_bytes)        # half of it: `rows` rows
    monkeypatch.setattr(devices, "free_memory", lambda device: room)
    small = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    for block in (0, 1, 2, 0):
        one = DenseGraph(graph.ctx_mask[block:block + 1], graph.nbr_mask[block:block + 1],
                         graph.center, graph.inter, graph.ctx_window,
                         graph.retrieved[block:block + 1])
        torch.testing.assert_close(small(ctx[block:block + 1], one), want[block:block + 1],
                                   rtol=1e-12, atol=1e-12)
    assert small.max_windows == rows and small._table.shape[1] == 1 + rows
    assert small.computed > len(torch.unique(graph.retrieved[graph.retrieved >= 0]))
    small.clear()                                                     # a new table: not said again
    torch.testing.assert_close(small(ctx[:1], one), want[:1], rtol=1e-12, atol=1e-12)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"keeping {rows} windows" in said[0], said
    given = WindowStates(stack, features_of(train), N_TRAIN, cfg, max_windows=N_TRAIN)
    torch.testing.assert_close(given(ctx, graph), want, rtol=0, atol=0)
    assert given.max_windows == N_TRAIN and not capsys.readouterr().err


def test_the_table_and_the_folded_maps_are_kept_per_autocast():
    """A model scored under bf16 autocast and then in float32 (or the reverse), with the same
    weights: each reads what a fresh table computes under its own autocast, not the other's
    windows and relation maps (bf16 maps read in float32 were an error)."""
    cfg = GraphConfig(left=1, right=2, k=4)
    _, context, train = blocks(cfg)
    stack = stack_for().float()
    ctx, _, graph = to_dense(context, cfg)

    def score(states: WindowStates, bf16: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return states(ctx.float(), graph)[graph.ctx_mask].float()

    def fresh(bf16: bool) -> torch.Tensor:
        for module in stack.modules():
            module.__dict__.pop("_folded", None)
        return score(WindowStates(stack, features_of(train), N_TRAIN, cfg), bf16)

    full, half = fresh(False), fresh(True)
    assert (full - half).abs().max() > 1e-3          # autocast changes the numbers
    states = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    for bf16, want in ((False, full), (True, half), (False, full), (True, half)):
        assert torch.equal(score(states, bf16), want)


def test_window_states_refuse_training_and_blocks_with_windows():
    cfg = GraphConfig(k=4)
    with_windows, context, train = blocks(cfg)
    stack = stack_for()
    states = WindowStates(stack, features_of(train), N_TRAIN, cfg)
    with pytest.raises(ValueError, match="build_context_graph"):
        states(*[to_dense(with_windows, cfg)[i] for i in (0, 2)])
    stack.train()
    with pytest.raises(RuntimeError, match="for evaluation"):
        states(*[to_dense(context, cfg)[i] for i in (0, 2)])
    with pytest.raises(ValueError, match="kind='hgt'"):
        WindowStates(GNNStack(D_MODEL, METADATA, kind="hgt"), features_of(train), N_TRAIN, cfg)


# -- on WikiText-2 --------------------------------------------------------------------------
TOKENS = 1536  # the first 24 blocks of 64 valid tokens


@pytest.fixture(scope="module")
def edited_workdir(workdir, tmp_path_factory) -> Workdir:
    """The test pipeline's work directory with valid neighbours edited: every 5th token keeps 3
    of its neighbours, every 7th retrieves the first and the last train positions (windows
    clipped at both edges of the split)."""
    root = tmp_path_factory.mktemp("edited")
    for entry in workdir.iterdir():
        if entry.name != "neighbors":
            (root / entry.name).symlink_to(entry)
    for folder in (workdir / "neighbors").iterdir():
        (root / "neighbors" / folder.name).mkdir(parents=True)
        for split in folder.iterdir():
            if split.name == "valid":
                shutil.copytree(split, root / "neighbors" / folder.name / split.name)
            else:
                (root / "neighbors" / folder.name / split.name).symlink_to(split)
    edited = Workdir(root)
    ids = open_array(edited.neighbors("final", "cos", "valid"), "ids", mode="r+")
    ids[:TOKENS:5, 3:] = -1
    rows = np.arange(0, TOKENS, 7)
    ids[rows, 0], ids[rows, 1] = 0, edited.n_positions("train") - 1
    ids.flush()
    return edited


def valid_logprobs(model: GNNLM, workdir: Workdir, eval_windows: str, k: int = 8,
                   inter: str = "window") -> np.ndarray:
    """log p(target) of the first TOKENS valid tokens through the data module's loader."""
    from datamodules.graph import GraphDataModule

    dm = GraphDataModule(workdir=str(workdir.root), node_features="pq", block_size=64,
                         eval_batch_size=8, num_workers=0, eval_tokens=TOKENS,
                         graph=GraphConfig(k=k, inter=inter), eval_windows=eval_windows)
    model.graph = dm.graph
    model.attach_output_embedding(*dm.output_embedding())
    model.attach_node_features(dm.node_features(), dm.n_train)
    out = np.full(TOKENS, np.nan, dtype=np.float32)
    with torch.no_grad():
        for batch in dm.val_dataloader():
            nll, _, positions = model.token_nll(batch, "predict")
            out[positions.numpy()] = -nll.numpy()
    assert np.isfinite(out).all()
    return out


def trained_gnn(workdir: Path) -> GNNLM:
    checkpoint = load_checkpoint(workdir / "models" / "gnn" / "model.ckpt")
    model = GNNLM(**{k: v for k, v in checkpoint["hyper_parameters"].items()
                     if not k.startswith("_")})
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


@pytest.mark.integration
def test_the_trained_gnn_scores_the_same_with_each_window_computed_once(workdir,
                                                                       edited_workdir):
    model = trained_gnn(workdir)
    scores = {}
    for name, wd in (("real", Workdir(workdir)), ("edited", edited_workdir)):
        per_retrieval = valid_logprobs(model, wd, "per_retrieval")
        scores[name] = valid_logprobs(model, wd, "once")
        np.testing.assert_allclose(scores[name], per_retrieval, rtol=0, atol=1e-5)
    # the edits reached the graphs: fewer and clipped windows change the scores
    assert np.abs(scores["real"] - scores["edited"]).max() > 1e-3


@pytest.mark.integration
@pytest.mark.parametrize("inter,norm,edge_aggr", [("window", "none", "sum"),
                                                  ("window", "pre", "mean"),
                                                  ("retrieved", "none", "sum"),
                                                  ("retrieved", "post", "mean")])
def test_every_layer_option_scores_the_same_on_wikitext(edited_workdir, inter, norm, edge_aggr):
    manifest = edited_workdir.features_manifest("train")
    torch.manual_seed(0)
    model = GNNLM(vocab_size=manifest["vocab_size"], feature_dim=manifest["dim"], heads=4,
                  dropout=0.0, norm=norm, edge_aggr=edge_aggr, zero_init_output=False).eval()
    per_retrieval = valid_logprobs(model, edited_workdir, "per_retrieval", inter=inter)
    once = valid_logprobs(model, edited_workdir, "once", inter=inter)
    np.testing.assert_allclose(once, per_retrieval, rtol=0, atol=1e-5)


@pytest.mark.integration
def test_the_pipeline_scored_the_gnn_at_the_k_chosen_on_valid(workdir, results):
    manifest = read_manifest(workdir / "models" / "gnn")
    curve = {int(k): ppl for k, ppl in manifest["eval_k"]["valid_ppl"].items()}
    chosen = manifest["eval_k"]["chosen"]
    assert len(curve) == 3 and chosen == min(curve, key=curve.get)
    assert results["gnn_eval_k"]["chosen"] == chosen
    assert results["valid_ppl"]["gnn"] == pytest.approx(curve[chosen], rel=1e-9)
    stored = np.asarray(open_array(workdir / "models" / "gnn", "valid_logprob"))[:TOKENS]
    recomputed = valid_logprobs(trained_gnn(workdir), Workdir(workdir), "per_retrieval",
                                k=chosen)
    np.testing.assert_allclose(stored, recomputed, rtol=0, atol=1e-5)
