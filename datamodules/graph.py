"""LightningDataModule that turns blocks of a split into GNN-LM graphs (PyG ``HeteroData``).

One sample = a block of ``block_size`` consecutive target tokens of a split (GNN-LM §2.2): the
block's tokens become ``ctx`` nodes with their frozen base-LM features; each token's top-k
retrieved train positions, widened to windows p−l … p+r, become ``nbr`` nodes named by their
train position (``nbr.train_pos``). Graphs are built in DataLoader workers from the artifacts of
``gnnlm pipeline`` under ``workdir``: the ``key`` features and their neighbours under ``metric``.
The window nodes' features (the PQ codes of the ``key`` features decoded, or the raw float16
ones: ``node_features()``) are read by the GNN-LM module on its own device
(``gnnlm.gnn.node_features``), so a batch copied to a GPU carries no float32 window features.

Train graphs follow the leakage rule of ``gnnlm.gnn.graph``: no node has read, or is, the target of
any ctx token it can reach (retrieved tokens that would are replaced by the next of the K stored
neighbours). A leakage window of 0 (``neighbors.leakage_window: 0``, recorded in the train
neighbours' manifest, or this module's ``leakage_window=0``) is the no-masking ablation: train
graphs then drop and replace nothing, ``leakage_window`` is None and the leakage counts are 0.
Blocks partition each split, so evaluation scores every token exactly once, the same tokens as
the base LM and kNN-LM.

Valid/test blocks leave their windows out (``eval_windows="once"``, ``gnnlm.gnn.graph.
build_context_graph``): each token names the k train positions it retrieved, and the GNN-LM
module computes each retrieved window once (``gnnlm.gnn.window_states``), whichever tokens, batches
and evaluations retrieve it. ``"per_retrieval"`` gives every retrieval its own window nodes, as
in training: the same numbers, at the cost of one window per retrieval.

The k curriculum (GNN-LM §4.1: train with small k, then fine-tune with a larger k) is
``k_schedule``: ``[[0, 8], [2, 16]]`` uses k=8 from epoch 0 and k=16 from epoch 2; it needs
``reload_dataloaders_every_n_epochs: 1``. Evaluation uses ``graph.k``, which must be the
schedule's last k, unless ``connect(eval_k=...)`` sets another: a trained GNN-LM reads any number
of windows, and ``eval_ks`` lists the values ``gnnlm pipeline`` scores on valid to choose the one
it reports. This module is the one owner of k: the model reads the k of each batch.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset
from torch_geometric.data import HeteroData
from torch_geometric.loader import DataLoader

from datamodules.base import WorkdirDataModule, loader_options
from datamodules.sampling import eval_sampler
from datamodules.splits import SplitArrays, TextArrays
from gnnlm.gnn.graph import GraphConfig, build_context_graph, build_graph
from gnnlm.gnn.pq import PQFeatures, RawFeatures
from gnnlm.gnn.settings import GraphLayout
from gnnlm.workdir.manifests import read_manifest


class GraphBlocks(Dataset):
    """Block i of a split → one HeteroData with ``ctx`` features ``x`` and targets ``y``, and
    window nodes named by train position (their features are read where the model runs); with
    ``windows=False``, the block without its windows (``ctx.retrieved`` instead: evaluation
    only)."""

    def __init__(self, arrays: SplitArrays, split: str, key: str, metric: str, windows: bool,
                 block_size: int, graph: GraphConfig, leakage_window: Optional[int],
                 max_tokens: Optional[int] = None):
        if not windows and leakage_window:
            raise ValueError("Blocks without window nodes are evaluation blocks: the leakage "
                             "rule of train graphs drops nodes per token.")
        self.arrays, self.split, self.key, self.metric = arrays, split, key, metric
        self.windows, self.block_size, self.graph = windows, block_size, graph
        # 0 masks nothing (the no-masking ablation): recorded as None, no rule at all
        self.leakage_window = leakage_window if leakage_window else None
        self.n_train = arrays.n("train")
        # train neighbours may cover only a prefix (neighbors.train_queries)
        covered, stored = arrays.neighbor_shape(key, metric, split)
        if stored < graph.k:
            raise ValueError(f"The graph keeps k={graph.k} neighbours per token but "
                             f"{arrays.neighbors_location(key, metric, split)} holds only "
                             f"K={stored}: lower graph.k or rebuild the neighbours with a "
                             f"larger K.")
        self.n = min(covered, max_tokens or covered)
        if self.n == 0:
            raise ValueError(f"Split {split!r} has no positions to build graphs from.")

    def __len__(self) -> int:
        return -(-self.n // self.block_size)

    def __getitem__(self, i: int) -> HeteroData:
        feats = self.arrays.features(self.split)
        ctx_feats, targets = feats[self.key], feats["targets"]
        ids = self.arrays.neighbor_ids(self.key, self.metric, self.split)
        ctx_pos = np.arange(i * self.block_size, min((i + 1) * self.block_size, self.n))
        # all K stored neighbours: leaky ones are skipped for the next (train graphs)
        nbr_ids = np.asarray(ids[ctx_pos[0]: ctx_pos[-1] + 1], dtype=np.int64)
        if self.windows:
            data = build_graph(ctx_pos, nbr_ids, self.n_train, self.graph, self.leakage_window)
        else:
            data = build_context_graph(ctx_pos, nbr_ids, self.n_train, self.graph)
        data["ctx"].x = torch.from_numpy(np.asarray(ctx_feats[ctx_pos], dtype=np.float32))
        data["ctx"].y = torch.from_numpy(np.asarray(targets[ctx_pos], dtype=np.int64))
        return data


class GraphDataModule(WorkdirDataModule):
    reads = frozenset({"neighbors", "pq"})  # retrieval artifacts read (pq: node_features)

    def __init__(self, workdir: str = "runs/wikitext2", key: str = "final", metric: str = "cos",
                 node_features: Literal["pq", "raw"] = "pq",
                 block_size: int = 64, graph: GraphConfig = GraphConfig(),
                 k_schedule: Optional[list[tuple[int, int]]] = None,
                 leakage_window: Optional[int] = None, batch_size: int = 4,
                 eval_batch_size: int = 8, num_workers: int = 2,
                 train_tokens: Optional[int] = None, eval_tokens: Optional[int] = None,
                 predict_split: str = "test",
                 eval_windows: Literal["once", "per_retrieval"] = "once",
                 eval_ks: Optional[list[int]] = None):
        """Blocks of each split as GNN-LM graphs (Meng et al. 2022, §2.2).

        Args:
            workdir: the work directory of ``gnnlm pipeline`` whose artifacts are read.
            key: the node feature and the retrieval key (GNN-LM uses ``final``).
            metric: the similarity the neighbours of ``key`` were searched with.
            node_features: window nodes' features: PQ-decoded (``pq``) or the stored ones
                (``raw``), read by the model where it runs (``node_features()``).
            block_size: consecutive target tokens per graph.
            graph: window sizes, neighbours per token k and inter edges of every graph.
            k_schedule: ``[[epoch, k], ...]``, the k curriculum (None: ``graph.k`` throughout).
            leakage_window: C, tokens back a train feature has read (None: the train
                neighbours'; 0: no masking).
            batch_size: train graphs per batch.
            eval_batch_size: valid/test graphs per batch.
            num_workers: DataLoader worker processes that build the graphs.
            train_tokens: keep only this prefix of train (None: what the neighbours cover).
            eval_tokens: keep only this prefix of valid/test (None: every position).
            predict_split: the split ``predict`` scores.
            eval_windows: valid/test windows computed once per retrieved position (``once``)
                or one per retrieval (``per_retrieval``): the same numbers.
            eval_ks: windows per token that ``gnnlm pipeline`` scores valid with after
                training (the best is reported on test).
        """
        super().__init__(workdir, predict_split)
        self.save_hyperparameters()
        self.graph = graph if isinstance(graph, GraphConfig) else GraphConfig(**dict(graph))
        self.check_arguments(graph=self.graph, k_schedule=k_schedule, eval_windows=eval_windows,
                             eval_ks=eval_ks)
        self.key, self.metric, self.block_size = key, metric, block_size
        self.node_feature_kind = node_features
        self.leakage_window_given = leakage_window
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_workers = num_workers
        self.train_tokens, self.eval_tokens = train_tokens, eval_tokens
        self.eval_windows, self.eval_ks = eval_windows, eval_ks
        self.k_schedule: list[tuple[int, int]] = sorted((int(epoch), int(k))
                                                        for epoch, k in k_schedule or [])
        # the k of valid/test graphs (None: graph.k): connect(eval_k=...), one of eval_ks
        self.eval_k: Optional[int] = None
        self.check_train_neighbors(key, metric)
        with self.reading_artifacts("features, neighbours, PQ codes"):
            train_manifest = self.workdir.features_manifest("train")
            self.train_neighbors = read_manifest(self.workdir.neighbors(key, metric, "train"),
                                                 kind="neighbors")
        self.use_features(train_manifest)
        self.n_train = train_manifest["n"]

    @classmethod
    def check_arguments(cls, **args: Any) -> None:
        """``WorkdirDataModule.check_arguments``, and the k curriculum (from epoch 0, ending
        at ``graph.k``, the k evaluation uses), ``eval_windows`` and ``eval_ks``."""
        super().check_arguments(**args)
        graph, given = args.get("graph"), args.get("k_schedule")
        if given and graph is not None:
            schedule = sorted((int(epoch), int(k)) for epoch, k in given)
            if schedule[0][0] != 0 or schedule[-1][1] != graph.k:
                shown = [list(step) for step in given]  # as YAML writes it (parsed: tuples)
                raise ValueError(f"k_schedule must start at epoch 0 and end with graph.k = "
                                 f"{graph.k}, the k evaluation uses (got {shown}).")
        windows = args.get("eval_windows")
        if windows is not None and windows not in ("once", "per_retrieval"):
            raise ValueError(f"eval_windows must be 'once' or 'per_retrieval' "
                             f"(got {windows!r}).")
        eval_ks = args.get("eval_ks")
        if eval_ks is not None and (not eval_ks or min(eval_ks) < 1):
            raise ValueError(f"eval_ks must list positive numbers of windows per token "
                             f"(got {list(eval_ks)}).")

    @property
    def graph_layout(self) -> GraphLayout:
        """What the model is linked with: the graphs' shape without k, which stays here."""
        return self.graph.layout

    def connect(self, predict_split: Optional[str] = None, text: Optional[TextArrays] = None,
                eval_k: Optional[int] = None) -> None:
        """Settings known only at run time (None: unchanged): ``predict_split`` and ``text``
        (``WorkdirDataModule.connect``), and ``eval_k``, the windows per token of valid/test
        graphs (``gnnlm pipeline`` tries each of ``eval_ks`` on valid, then scores with the
        best)."""
        super().connect(predict_split=predict_split, text=text)
        if eval_k is not None:
            if eval_k < 1:
                raise ValueError(f"eval_k must be a positive number of windows per token "
                                 f"(got {eval_k}).")
            self.eval_k = eval_k

    # -- pieces ----------------------------------------------------------------------------
    def node_features(self) -> PQFeatures | RawFeatures:
        """The train features the window nodes read (``GNNLM.attach_node_features``; the
        ``gnnlm`` commands attach them)."""
        if self.node_feature_kind == "pq":
            return PQFeatures(self.workdir.pq(self.key))
        return RawFeatures(self.workdir.features("train"), self.key)

    def current_k(self, epoch: Optional[int]) -> int:
        """K for a training epoch (when ``epoch`` is None, evaluation's: ``eval_k`` if set, else
        ``graph.k``)."""
        if epoch is None:
            return self.eval_k or self.graph.k
        if not self.k_schedule:
            return self.graph.k
        return max(s for s in self.k_schedule if s[0] <= epoch)[1]

    @property
    def leakage_window(self) -> Optional[int]:
        """C of the leakage rule: how many tokens back a train feature has read (default: the
        W the train neighbours were masked with, the features' context length). None when
        masking is off: 0 given or recorded (the ablation ``neighbors.leakage_window: 0``), or
        train neighbours recorded as unmasked."""
        window = (self.leakage_window_given if self.leakage_window_given is not None
                  else self.train_neighbors["leakage_window"])
        return window if window else None  # 0 is "no masking", not a rule with C = 0

    def dataset(self, split: str, k: Optional[int] = None) -> GraphBlocks:
        """Train blocks with their windows under the leakage rule; valid/test blocks without
        their windows (``eval_windows="once"``) or with one per retrieval."""
        graph = dataclasses.replace(self.graph, k=k or self.current_k(None))
        train = split == "train"
        with_windows = train or self.eval_windows == "per_retrieval"
        return GraphBlocks(self.arrays, split, self.key, self.metric, with_windows,
                           self.block_size, graph, self.leakage_window if train else None,
                           self.train_tokens if train else self.eval_tokens)

    # -- loaders ---------------------------------------------------------------------------
    def _loader(self, split: str, train: bool, k: Optional[int] = None) -> DataLoader:
        data = self.dataset(split, k)
        return DataLoader(data, batch_size=self.batch_size if train else self.eval_batch_size,
                          shuffle=train, num_workers=self.workers(split), **loader_options(),
                          persistent_workers=False,
                          sampler=None if train else eval_sampler(self, data))

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer else None
        return self._loader("train", True, self.current_k(epoch))

    def eval_dataloader(self, split: str) -> DataLoader:
        return self._loader(split, False)
