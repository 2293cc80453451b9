"""SPALM trained end to end (gnnlm.spalm.model, gnnlm.lit.spalm, datamodules.spalm): W learns
through every path, the gate at 1 is Transformer-XL, memory flows between segments, the data
partitions every split with the right neighbour values, and the analyses count tokens."""
from __future__ import annotations

import json
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import torch

from gnnlm.lit.settings import OptimConfig
from gnnlm.lit.spalm import check_k_curve
from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.retrieval.index import IndexConfig, build_index
from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors, neighbor_values
from gnnlm.spalm.analysis import frequency_buckets, gate_histogram, markdown
from gnnlm.spalm.model import Spalm
from gnnlm.utils.metrics import target_nll
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array
from tests.fakes import save_lm_checkpoint, write_features

V, D = 20, 16


def _gpt(memory_length=0, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, context_length=16, n_layer=2, n_head=2, d_model=D,
                         d_ff=32, dropout=0.0, memory_length=memory_length))


def _batch(B=2, T=6, k=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g),
            torch.randint(-1, V, (B, T, k), generator=g))


# -- the model ----------------------------------------------------------------------------------
def test_w_learns_from_the_input_the_retrieved_values_and_the_output():
    """W.grad is the sum of its three contributions; each path cut alone removes one of them."""
    model = Spalm(_gpt(), gate_bias=0.0, memory_scale="learned")
    with torch.no_grad():
        model.gate.gate.weight.normal_(0, 0.3)           # a gate that depends on h
    inputs, targets, values = _batch()

    def w_grad(cut_values: bool, cut_output: bool) -> torch.Tensor:
        model.zero_grad()
        W = model.word_embedding
        h = model.lm(inputs).final
        logits, _ = model.gate(h.flatten(0, 1), values.flatten(0, 1),
                               W.detach() if cut_output else W, None,
                               value_weight=W.detach() if cut_values else W,
                               memory_scale=model.memory_scale)
        target_nll(logits, targets.flatten()).mean().backward()
        return W.grad.clone()

    model.zero_grad()
    out = model(inputs, values)
    target_nll(out.logits.flatten(0, 1), targets.flatten()).mean().backward()
    full = model.word_embedding.grad.clone()
    assert all(p.grad is not None for p in model.parameters())  # DDP: no unused parameter
    from_input = w_grad(cut_values=True, cut_output=True)
    from_values = w_grad(cut_values=False, cut_output=True) - from_input
    from_output = w_grad(cut_values=True, cut_output=False) - from_input
    torch.testing.assert_close(full, from_input + from_values + from_output)
    assert from_values.abs().sum() > 0 and from_output.abs().sum() > 0
    retrieved = torch.zeros(V, dtype=torch.bool)
    retrieved[values[values >= 0]] = True                # the value path reaches only their rows
    assert from_values[~retrieved].abs().sum() == 0 and from_values[retrieved].abs().sum() > 0
    assert model.lm.lm_head.weight is model.lm.wte.weight  # one W: input = output embedding
    assert model.log_memory_scale.grad is not None and model.log_memory_scale.grad != 0


def test_the_memory_scale_starts_at_the_norm_ratio_and_none_is_the_paper():
    """learned: s·m_t with s ≈ E‖h‖ / E‖y‖ at the start, trained with the gate; none: the
    paper's equations, no extra parameter."""
    gpt = _gpt().eval()
    with torch.no_grad():
        gpt.ln_f.weight.fill_(3.0)                       # h far larger than the embeddings
    learned = Spalm(gpt, gate_bias=0.0, memory_scale="learned").eval()
    paper = Spalm(gpt).eval()
    inputs, _, values = _batch()
    with torch.no_grad():
        h = gpt(inputs).final
        y_norm = gpt.wte.weight.norm(dim=-1).pow(2).mean().sqrt()
        s = float(learned.memory_scale)
        assert s == pytest.approx(float(h.norm(dim=-1).mean() / y_norm), rel=0.1)
        flat_h, flat_v, W = h.flatten(0, 1), values.flatten(0, 1), learned.word_embedding
        torch.testing.assert_close(
            learned(inputs, values).logits.flatten(0, 1),
            learned.gate(flat_h, flat_v, W, None, memory_scale=torch.tensor(s))[0])
        torch.testing.assert_close(paper(inputs, values).logits.flatten(0, 1),
                                   paper.gate(flat_h, flat_v, W, None)[0])
    assert paper.memory_scale is None and paper.memory_parameters() == list(
        paper.gate.parameters())
    assert learned.memory_parameters()[-1] is learned.log_memory_scale
    assert Spalm(gpt, long_term=False).memory_parameters() == []
    with pytest.raises(ValueError, match="memory_scale must be one of"):
        Spalm(gpt, memory_scale="fixed")


def test_the_defaults_are_the_paper_s_equations_and_each_deviation_is_named():
    """SPALM eq. (§2): g_t = σ(W_g h_t), no bias; z_t = (1 − g_t) ⊙ m_t + g_t ⊙ h_t, m_t as it
    is. The learned bias and memory scale are options, reported in the row's label."""
    from gnnlm.pipeline.scoring import predict_extras

    gpt = _gpt().eval()
    paper = Spalm(gpt).eval()
    assert paper.gate.gate.bias is None and paper.log_memory_scale is None
    assert [name for name, _ in paper.named_parameters() if not name.startswith("lm.")] == [
        "gate.gate.weight"]
    inputs, _, values = _batch()
    with torch.no_grad():
        h = gpt(inputs).final.flatten(0, 1)
        y = gpt.wte.weight[values.flatten(0, 1).clamp(min=0)]              # [n, k, d]
        attn = torch.softmax(torch.einsum("nkd,nd->nk", y, h).masked_fill(
            values.flatten(0, 1) < 0, float("-inf")), -1).nan_to_num(0.0)
        m = torch.einsum("nk,nkd->nd", attn, y)
        g = torch.sigmoid(h @ paper.gate.gate.weight.T)                     # 1/2 at the start
        expected = ((1 - g) * m + g * h) @ gpt.wte.weight.T
        out = paper(inputs, values)
    torch.testing.assert_close(out.logits.flatten(0, 1), expected)
    torch.testing.assert_close(out.gate, torch.full_like(out.gate, 0.5))
    both = SimpleNamespace(deviations=lambda: ["gate bias", "memory scale"])  # as SpalmXL says
    assert predict_extras(both) == {"deviations": ["gate bias", "memory scale"]}


def test_head_logits_are_float32_under_bf16_autocast():
    """A bf16 trainer preset runs the model under autocast; the softmaxes over the vocabulary
    must still be float32, as the base LM's log-probabilities are."""
    from gnnlm.models.multi_embedding import MultiEmbeddingSoftmax

    gpt = _gpt().eval()
    spalm, plain = Spalm(gpt).eval(), Spalm(gpt, long_term=False).eval()
    wds = MultiEmbeddingSoftmax(V, gpt.hidden_size, n=2)
    inputs, _, values = _batch()
    with torch.no_grad():
        reference = (spalm(inputs, values).logits, plain(inputs).logits,
                     wds(gpt(inputs).final.flatten(0, 1)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = gpt(inputs).final
            mixed = (spalm.head(h, values)[0], plain.head(h)[0], wds(h.flatten(0, 1)))
    for got, want in zip(mixed, reference):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # h itself came from bf16


def test_gate_one_is_exactly_transformer_xl_and_no_long_term_memory_is_the_gpt():
    gpt = _gpt(memory_length=6).eval()
    spalm, plain = Spalm(gpt).eval(), Spalm(gpt, long_term=False).eval()
    first, _, values = _batch(seed=1)
    second, _, values2 = _batch(seed=2)
    with torch.no_grad():
        ref_a = gpt(first)
        ref_b = gpt(second, memory=ref_a.memory)
        out_a = spalm(first, values, force_gate=1.0)
        out_b = spalm(second, values2, memory=out_a.memory, force_gate=1.0)
        plain_b = plain(second, memory=plain(first).memory)
    torch.testing.assert_close(out_b.logits, gpt.logits(ref_b.final), rtol=0, atol=0)
    torch.testing.assert_close(plain_b.logits, gpt.logits(ref_b.final), rtol=0, atol=0)
    assert plain.gate is None and plain_b.gate is None and torch.all(out_b.gate == 1)
    with pytest.raises(ValueError, match="pass nbr_values"):
        spalm(first)


def test_untied_embeddings_are_refused():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=V, context_length=16, n_layer=1, n_head=2, d_model=D,
                        d_ff=32, tie_embeddings=False))
    with pytest.raises(ValueError, match="tie_embeddings=True"):
        Spalm(gpt)


# -- the work directory: features, neighbours, tokens, a base LM -----------------------------------
SIZES = {"train": 300, "valid": 77, "test": 61}
K, TRAIN_QUERIES = 8, 250


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("spalm")
        wd = Workdir(root / "work")
        ckpt, lm = save_lm_checkpoint(root / "lm.ckpt", vocab_size=V, n_layer=2, d_model=D,
                                      dropout=0.0)
        fingerprint = lm.model.fingerprint()
        rng = np.random.default_rng(0)
        for split, n in SIZES.items():
            final = (np.cumsum(0.3 * rng.standard_normal((n, D)), axis=0)).astype(np.float32)
            write_features(wd.features(split), final, targets=rng.integers(1, V, n).astype(
                np.int32), split=split, vocab_size=V, lm=("gpt", fingerprint))
        build_index(wd, "final", "cos", IndexConfig(factory="Flat", recall_queries=10))
        for split in SIZES:
            build_neighbors(wd, split, "final", "cos",
                            NeighborsConfig(K=K, train_queries=TRAIN_QUERIES), leakage_window=4,
                            device="cpu")
        tokens = ArtifactBuilder(wd.tokens, kind="tokens")
        with tokens:
            tokens.finish(extra={"vocab_size": V, "bos_id": 0})
        return wd, ckpt, fingerprint
    finally:
        faiss.omp_set_num_threads(before)


def _data(work, **kw):
    from datamodules.spalm import SpalmDataModule

    wd, ckpt, _ = work
    args = dict(workdir=str(wd.root), retrieved=K, block_size=5, batch_size=3,
                eval_streams=4, base_lm_path=ckpt)
    return SpalmDataModule(**{**args, **kw})


def test_data_partitions_every_split_with_its_neighbour_values(work):
    from gnnlm.retrieval.features import open_features

    wd = work[0]
    data = _data(work)
    assert data.n_positions("train") == TRAIN_QUERIES and data.stored_k == K
    train_targets = np.asarray(open_features(wd.features("train"))[1]["targets"])
    for split, loader in (("train", data.train_dataloader()), ("valid", data.val_dataloader()),
                          ("test", data.test_dataloader())):
        n = data.n_positions(split)
        targets = np.asarray(open_features(wd.features(split))[1]["targets"])
        ids = np.asarray(open_array(wd.neighbors("final", "cos", split), "ids"))
        seen = []
        for batch in loader:
            keep = batch["mask"].bool()
            positions = batch["positions"][keep]
            assert torch.all(batch["positions"][~keep] == -1)
            assert torch.all(batch["nbr_values"][~keep] == -1)
            seen.append(positions)
            p = positions.numpy()
            assert np.array_equal(batch["target"][keep].numpy(), targets[p])
            previous = np.where(p > 0, targets[np.maximum(p - 1, 0)], 0)  # [bos] + targets
            assert np.array_equal(batch["input"][keep].numpy(), previous)
            assert np.array_equal(batch["nbr_values"][keep].numpy(),
                                  neighbor_values(ids[p], train_targets))
        seen = torch.cat(seen)
        assert sorted(seen.tolist()) == list(range(n)), split   # every position exactly once


def test_evaluation_streams_are_the_same_on_any_number_of_processes(work):
    """Every stream starts cold, so the number of streams is part of the protocol: valid/test
    read eval_streams streams in all, split among the processes, never batch x processes."""
    one = _data(work)
    items = {}
    for world in (1, 2, 4):
        data = _data(work)
        served = []
        for rank in range(world):
            data.trainer = SimpleNamespace(world_size=world, global_rank=rank)
            loader = data.val_dataloader()
            assert loader.batch_size == 4 // world
            served += [tuple(loader.dataset[i]["positions"].tolist())
                       for i in loader.sampler]
            assert len(loader.dataset) == len(one.segments("valid", 4))
        items[world] = sorted(set(served))
        assert data.scoring_protocol(5) == {"kind": "segments", "segment": 5, "streams": 4,
                                            "memory": 5}
    assert items[1] == items[2] == items[4]
    data = _data(work, eval_streams=3)
    data.trainer = SimpleNamespace(world_size=2, global_rank=0)
    with pytest.raises(ValueError, match="eval_streams = 3 must be a multiple of the 2 "):
        data.val_dataloader()


def test_data_refuses_what_the_neighbours_cannot_serve(work):
    with pytest.raises(ValueError, match="train neighbours cover only the first 250"):
        _data(work, train_tokens=TRAIN_QUERIES + 1).train_dataloader()
    with pytest.raises(ValueError, match="choose 1 <= retrieved <= K"):
        _data(work, retrieved=K + 1).val_dataloader()
    data = _data(work, retrieved=0)
    batch = next(iter(data.val_dataloader()))
    assert "nbr_values" not in batch and data.n_positions("train") == TRAIN_QUERIES


# -- the LightningModule ---------------------------------------------------------------------------
def _module(work, **kw):
    from gnnlm.lit.spalm import SpalmXL

    _, ckpt, fingerprint = work
    args = dict(base_lm=ckpt, base_lm_fingerprint=fingerprint, vocab_size=V, k=4,
                memory_length=5, optim=OptimConfig(lr=1e-2, warmup_steps=1))
    return SpalmXL(**{**args, **kw})


def test_warm_start_is_the_base_lm_and_every_parameter_trains(work):
    from gnnlm.models import load_gpt_checkpoint

    base = load_gpt_checkpoint(work[1])
    warm, scratch = _module(work), _module(work, init="scratch")
    torch.testing.assert_close(warm.model.lm.wte.weight, base.wte.weight)
    assert not torch.equal(scratch.model.lm.wte.weight, base.wte.weight)
    assert all(p.requires_grad for p in warm.parameters())
    assert _module(work, k=0).model.gate is None
    with pytest.raises(ValueError, match="not the one the datastore was built with"):
        _module(work, base_lm_fingerprint="another")
    with pytest.raises(ValueError, match="init must be one of"):
        _module(work, init="lukewarm")


def test_memory_is_carried_from_one_batch_to_the_next_and_reset_per_pass(work):
    model = _module(work).eval()
    data = _data(work)
    first, second = list(data.val_dataloader())[:2]
    with torch.no_grad():
        model.on_validation_epoch_start()
        model.token_nll(first, "val")
        carried, _, _ = model.token_nll(second, "val")
        model.on_validation_epoch_start()
        fresh, _, _ = model.token_nll(second, "val")
        joined = {"input": torch.cat([first["input"], second["input"]], 1),
                  "nbr_values": torch.cat([first["nbr_values"], second["nbr_values"]], 1)}
        whole = model.model(joined["input"], joined["nbr_values"][..., :4])
    expected = target_nll(whole.logits[:, 5:].flatten(0, 1), second["target"].flatten())
    torch.testing.assert_close(carried, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(fresh, carried)


def test_fit_and_predict_give_every_token_its_gate_and_the_k_curve(work):
    import pytorch_lightning as pl

    from gnnlm.pipeline.scoring import predict_extras, predict_tokens

    data = _data(work)
    model = _module(work, k_curve=[1, 2, 4, 8])
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    arrays = {s: predict_tokens(model, data, s, data.n_positions(s)) for s in ("valid", "test")}
    logprob = {s: a["logprob"] for s, a in arrays.items()}
    for split, values in logprob.items():
        assert set(arrays[split]) == {"logprob", "gate"}
        gates = arrays[split]["gate"]
        assert gates.shape == values.shape and gates.dtype == np.float32
        assert not np.isnan(gates).any() and np.all((gates > 0) & (gates < 1))
    assert "gate" not in predict_tokens(_module(work, k=0), _data(work), "test",
                                        data.n_positions("test"))   # no gate: nothing more
    extras = predict_extras(model)
    curve = extras["k_curve"]
    assert curve["k"] == [1, 2, 4, 8] and curve["tokens"] == SIZES["valid"]
    valid_ppl = float(np.exp(-logprob["valid"].mean()))
    assert curve["ppl"][2] == pytest.approx(valid_ppl, rel=1e-4)  # k = 4 is the trained model
    json.dumps(extras)


def linked(data) -> dict:
    """What ``gnnlm fit`` links from a SpalmDataModule into the model (``gnnlm.lit.cli``)."""
    return {"retrieved": data.retrieved, "stored_k": data.stored_k,
            "vocab_size": data.vocab_size, "base_lm": data.base_lm,
            "base_lm_fingerprint": data.base_lm_fingerprint}


def test_a_k_beyond_what_the_data_carries_or_the_store_holds_is_refused(work):
    """Refused when the model is built, from what the data module says it serves."""
    with pytest.raises(ValueError, match=r"k = \[16\] neighbours asked for, but 8 are stored"):
        _module(work, k_curve=[1, 16], **linked(_data(work)))
    with pytest.raises(ValueError, match="data carries data.retrieved = 2"):
        _module(work, k_curve=[1, 4], **linked(_data(work, retrieved=2)))
    with pytest.raises(ValueError, match="k = 0 neighbours|k >= 1"):
        _module(work, k_curve=[0, 1])
    _module(work, k=0, **linked(_data(work, retrieved=0)))        # no gate: nothing to serve


def test_the_gate_trains_at_its_own_rate_in_the_same_groups_as_before(work):
    """``gate_lr`` through ``adamw_warmup_cosine``'s lr_groups: the optimiser SpalmXL built
    itself before (LM matrices, LM vectors, then the gate's groups that have parameters, each
    with its lr and weight decay) and the same warmup + cosine schedule."""
    from gnnlm.lit.optim import warmup_cosine

    for kw in ({}, {"memory_scale": "learned", "gate_bias": 0.0}, {"k": 0}, {"gate_lr": None}):
        model = _module(work, **{"gate_lr": 3e-2, "optim": OptimConfig(
            lr=1e-2, weight_decay=0.1, warmup_steps=3), **kw})
        model._trainer = SimpleNamespace(estimated_stepping_batches=20)
        hp = SimpleNamespace(**vars(model.hparams["optim"]), gate_lr=model.hparams["gate_lr"])
        # the construction SpalmXL had before it used gnnlm.lit.optim
        gate = set(model.model.memory_parameters())
        groups = []
        for lr, params in ((hp.lr, [p for p in model.parameters() if p not in gate]),
                           (hp.gate_lr or hp.lr, [p for p in model.parameters() if p in gate])):
            groups += [{"params": [p for p in params if p.dim() >= 2], "lr": lr,
                        "weight_decay": hp.weight_decay},
                       {"params": [p for p in params if p.dim() < 2], "lr": lr,
                        "weight_decay": 0.0}]
        before = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr,
                                   betas=tuple(hp.betas))
        before_schedule = torch.optim.lr_scheduler.LambdaLR(
            before, lambda step, hp=hp: warmup_cosine(step, hp.warmup_steps, 20, hp.min_lr_ratio))
        config = model.configure_optimizers()
        after, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
        assert isinstance(after, torch.optim.AdamW) and config["lr_scheduler"]["interval"] == "step"
        assert len(after.param_groups) == len(before.param_groups) >= (2 if "k" in kw else 3)
        for step in range(25):                          # warmup, decay, and past the end
            for new, old in zip(after.param_groups, before.param_groups):
                assert [id(p) for p in new["params"]] == [id(p) for p in old["params"]]
                assert {k: v for k, v in new.items() if k != "params"} == {
                    k: v for k, v in old.items() if k != "params"}, step
            for optimizer, scheduler in ((after, schedule), (before, before_schedule)):
                optimizer.step()
                scheduler.step()
        assert after.param_groups[-1]["initial_lr"] == (
            hp.lr if "k" in kw else hp.gate_lr or hp.lr)


# -- the analyses ---------------------------------------------------------------------------------
def test_gate_histogram_counts_tokens_not_dimensions():
    gates = np.array([0.05, 0.5, 0.51, 0.99, np.nan], dtype=np.float32)
    hist = gate_histogram(gates, bins=10)
    assert hist["counts"] == [1, 0, 0, 0, 0, 2, 0, 0, 0, 1] and hist["tokens"] == 4
    assert hist["mean"] == pytest.approx(np.nanmean(gates), rel=1e-6)


def test_frequency_buckets_split_the_tokens_by_train_count():
    train_counts = np.array([0, 3, 50, 5000, 20000])
    targets = np.array([0, 1, 1, 2, 3, 4, 4])
    logprob = -np.arange(1, 8, dtype=np.float64)
    rows = frequency_buckets(targets, train_counts, logprob, np.full(7, 0.5), logprob - 1)
    assert [r["train_count"] for r in rows] == [[0, 0], [1, 9], [10, 99], [1000, 9999],
                                                [10000, None]]
    assert sum(r["tokens"] for r in rows) == 7 and rows[1]["tokens"] == 2
    assert rows[1]["ppl"] == pytest.approx(np.exp(2.5))
    assert rows[1]["baseline_ppl"] == pytest.approx(np.exp(3.5)) and rows[0]["gate_mean"] == 0.5
    section = {"frequency_buckets": {"split": "test", "baseline": "transformer_xl", "rows": rows},
               "k_curve": {"k": [1, 2], "ppl": [10.0, 9.0], "trained_k": 2, "tokens": 7},
               "gate_histogram": {"test": gate_histogram(np.full(7, 0.5))}}
    text = "\n".join(markdown(section))
    assert "| 1–9 | 2 |" in text and "| valid ppl | 10.00 | 9.00 |" in text


def test_k_curve_refuses_k_beyond_the_stored_neighbours():
    check_k_curve([1, 2, 4], stored=4)
    with pytest.raises(ValueError, match="1 <= k <= K"):
        check_k_curve([1, 8], stored=4)


def test_report_section_reads_the_head_artifact(work, tmp_path):
    from gnnlm.spalm.analysis import results_section

    wd = work[0]
    rng = np.random.default_rng(0)
    n = {s: SIZES[s] for s in ("valid", "test")}
    builder = ArtifactBuilder(wd.model("spalm_xl"), kind="trained_model",
                              config={"name": "spalm_xl"}, rebuild=True)
    with builder:
        for split, size in n.items():
            builder.array(f"{split}_gate", np.float32, (size,))[...] = rng.uniform(0, 1, size)
        curve = {"split": "valid", "trained_k": 4, "k": [1, 4], "tokens": n["valid"],
                 "ppl": [12.0, 11.0]}
        manifest = builder.finish(extra={"k_curve": curve})
    scores = {row: {s: -rng.uniform(0.1, 5, size) for s, size in n.items()}
              for row in ("spalm_xl", "transformer_xl")}
    section = results_section(wd, manifest, scores, plot=tmp_path / "gates.png")
    assert {s: h["tokens"] for s, h in section["gate_histogram"].items()} == n
    assert section["k_curve"] == curve and (tmp_path / "gates.png").is_file()
    rows = section["frequency_buckets"]["rows"]
    assert sum(r["tokens"] for r in rows) == n["test"]
    assert section["frequency_buckets"]["baseline"] == "transformer_xl"
    assert "perplexity against the number of neighbours" in "\n".join(markdown(section))
