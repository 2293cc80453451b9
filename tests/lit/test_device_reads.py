"""A training step of the base LM, its Transformer-XL form, SPALM-XL, GNN-LM and the heads on
frozen features reads nothing back from the device, with the progress bar and the progress lines
on. On a GPU each such read (a tensor's value as a Python number, or a shape that depends on
values) waits for every queued kernel, so the host cannot queue the next step while the GPU runs
this one. Counted here on the CPU, by intercepting the tensor operations that would read,
wherever gnnlm or Lightning calls them."""
from __future__ import annotations

import traceback
from collections import Counter

import pytest
import pytorch_lightning as pl
import torch
from torch.overrides import TorchFunctionMode

from gnnlm.lit.progress_log import EpochBar, ProgressLog

# a value as a Python number, a shape that depends on values, and bincount (on CUDA it reads
# its input's largest value to size its output)
READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "nonzero",
         "masked_select", "unique", "argwhere", "bincount"}
STEPS = 12


class DeviceReads(TorchFunctionMode):
    """Counts, while ``on``, the operations of ``READS`` and indexing by a boolean mask, by
    where they were called. The CPU's AdamW reads its step counters (on a GPU the fused AdamW
    reads nothing): reads made by ``torch/optim`` itself are not counted (the training step
    runs inside the optimiser's closure: what it reads is)."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.reads: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.on and (name in READS or (
                name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool)):
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if not f.filename.endswith(("torch/overrides.py", "torch/_tensor.py")))
            if "torch/optim/" not in caller.filename:
                self.reads[f"{name} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


class Window(pl.Callback):
    """Counting on from the third step's start to the last step's start: whole steps, with
    every callback's hooks, after the first steps set things up."""

    def __init__(self, reads: DeviceReads):
        self.reads = reads

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.reads.on = 2 <= batch_idx < STEPS - 1


def steps_read(module: pl.LightningModule, batches: list[dict], monkeypatch) -> Counter:
    monkeypatch.setattr(EpochBar, "LOSS_SECONDS", 1e9)   # the bar's one read: the first step
    reads = DeviceReads()
    trainer = pl.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=0,
                         log_every_n_steps=1000,
                         callbacks=[EpochBar(), ProgressLog(enabled=True, every_seconds=1e9),
                                    Window(reads)])
    with reads:
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == STEPS
    return reads.reads


def lm_batches(vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input": torch.randint(0, vocab, (2, 8), generator=g),
             "target": torch.randint(0, vocab, (2, 8), generator=g),
             "mask": torch.ones(2, 8)} for _ in range(STEPS)]


def test_the_counter_sees_a_read():
    reads = DeviceReads()
    reads.on = True
    with reads:
        int(torch.ones(3).sum())
        torch.ones(3)[torch.tensor([True, False, True])]
    assert sum(reads.reads.values()) == 2


@pytest.mark.parametrize("memory_length", [0, 8])
def test_a_base_lm_training_step_reads_nothing_back(memory_length, monkeypatch):
    from gnnlm.lit.lm import LanguageModel

    torch.manual_seed(0)
    module = LanguageModel(vocab_size=30, context_length=8, n_layer=1, n_head=2, d_model=16,
                           d_ff=32, memory_length=memory_length)
    assert steps_read(module, lm_batches(30), monkeypatch) == Counter()


def test_a_spalm_xl_training_step_reads_nothing_back(tmp_path, monkeypatch):
    from gnnlm.lit.spalm import SpalmXL
    from tests.fakes import save_lm_checkpoint

    ckpt, _ = save_lm_checkpoint(tmp_path / "lm.ckpt", vocab_size=30, context_length=8,
                                 n_layer=1)
    module = SpalmXL(base_lm=ckpt, vocab_size=30, k=4, memory_length=8)
    batches = lm_batches(30)
    g = torch.Generator().manual_seed(1)
    for batch in batches:
        batch["nbr_values"] = torch.randint(-1, 30, (2, 8, 4), generator=g)
        batch["positions"] = torch.arange(16).view(2, 8)
    assert steps_read(module, batches, monkeypatch) == Counter()


def test_a_gnn_lm_training_step_reads_nothing_back(monkeypatch):
    from torch_geometric.data import Batch

    from gnnlm.gnn.graph import GraphConfig
    from gnnlm.lit.gnn import GNNLM
    from tests.gnn.test_dense import D_MODEL, batch_of_graphs

    cfg = GraphConfig(left=1, right=2, k=3)
    torch.manual_seed(0)
    module = GNNLM(vocab_size=30, feature_dim=D_MODEL, num_layers=2, heads=2, dropout=0.1,
                   graph_layout=cfg)
    module.attach_output_embedding(torch.randn(30, D_MODEL), torch.randn(30))
    batches = []
    for seed in range(STEPS):   # three train graphs under the leakage rule, a short last one
        batch = batch_of_graphs(cfg, leakage_window=4, seed=seed, dtype=torch.float32)
        batch["ctx"].y = torch.randint(0, 30, (batch["ctx"].num_nodes,))
        batches.append(batch)
    assert isinstance(batches[0], Batch) and int(batches[0].nodes_masked.sum()) > 0
    assert steps_read(module, batches, monkeypatch) == Counter()


@pytest.mark.parametrize("head", ["spalm", "learned_wds", "learned_wds[n=3]"])
def test_a_head_on_frozen_features_reads_nothing_back(head, monkeypatch):
    from gnnlm.lit.heads import LearnedDatastoreLM, SpalmLM

    torch.manual_seed(0)
    if head == "spalm":
        module = SpalmLM(vocab_size=30, feature_dim=8)
        module.attach_output_embedding(torch.randn(30, 8), torch.randn(30))
    else:
        module = LearnedDatastoreLM(vocab_size=30, feature_dim=8,
                                    embeddings_per_word=3 if head.endswith("[n=3]") else 1)
    g = torch.Generator().manual_seed(0)
    batches = [{"h": torch.randn(16, 8, generator=g),
                "target": torch.randint(0, 30, (16,), generator=g),
                "nbr_values": torch.randint(-1, 30, (16, 4), generator=g),   # -1: none
                "positions": torch.arange(16)} for _ in range(STEPS)]
    assert steps_read(module, batches, monkeypatch) == Counter()


class DeviceMoves(TorchFunctionMode):
    """Counts the tensors moved to a CUDA device with and without ``non_blocking``, skipping
    the move itself (no GPU here): a blocking copy to a GPU first waits for every kernel
    queued before it."""

    def __init__(self):
        super().__init__()
        self.moves: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to":
            to = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(to, (str, torch.device)) and torch.device(to).type == "cuda":
                self.moves["non_blocking" if kwargs.get("non_blocking") else "blocking"] += 1
                return args[0]
        return func(*args, **kwargs)


def test_every_training_batch_is_copied_to_a_gpu_without_waiting():
    """Lightning moves a batch of tensors with ``non_blocking`` copies, but a PyG batch by its
    own ``.to``, blocking unless told: GNN-LM's batches are moved as the others are."""
    from gnnlm.gnn.graph import GraphConfig
    from gnnlm.lit.gnn import GNNLM
    from gnnlm.lit.lm import LanguageModel
    from tests.gnn.test_dense import D_MODEL, batch_of_graphs

    cfg = GraphConfig(left=1, right=2, k=3)
    gnn = GNNLM(vocab_size=30, feature_dim=D_MODEL, num_layers=2, heads=2, graph_layout=cfg)
    lm = LanguageModel(vocab_size=30, context_length=8, n_layer=1, n_head=2, d_model=16,
                       d_ff=32)
    graphs = batch_of_graphs(cfg, leakage_window=4, seed=0, dtype=torch.float32)
    tensors = sum(isinstance(v, torch.Tensor) for store in graphs.stores for v in store.values())
    for module, batch, moved in ((gnn, graphs, tensors), (lm, lm_batches(30)[0], 3)):
        with DeviceMoves() as copies:
            module.transfer_batch_to_device(batch, torch.device("cuda"), 0)
        assert copies.moves == Counter(non_blocking=moved), type(module).__name__
