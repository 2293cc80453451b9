"""The trained heads of a work directory, read back as the pipeline trained and scored them.

Each ``models/<folder>/`` holds the checkpoint ``gnnlm fit`` wrote; the checkpoint records the
LightningModule and the data module it was trained with (``gnnlm.workdir.checkpoints.
trained_classes``). Both are built again from their saved init arguments (only this package's
own heads and data modules: no code from the checkpoint runs), the module is filled with its
weights and frozen, and the data module reads the work directory. A ``TrainedHead`` is that
pair: ``gnnlm.inference.scoring`` scores a text with it through the pipeline's own ``predict``
(``gnnlm.pipeline.scoring.predict_tokens``), the text served in place of a split
(``datamodules.splits``), so every score of a head has one path.

Decoding reads the same modules one position at a time, through a view per kind of head:

- ``GNNHead``: GNN-LM (``gnnlm.lit.gnn.GNNLM``), its window-state table shared with scoring;
- ``FeatureHead``: SPALM's gate on the frozen features (``SpalmLM``) or a learned W_ds
  (``LearnedDatastoreLM``);
- ``FinetunedSpalm``: the gate over the base LM whose last block and final norm were trained
  (``SpalmFinetuneLM``);
- ``SegmentSpalm``: SPALM trained end to end and its transformer / Transformer-XL baselines
  (``SpalmXL``), which read segments with memory.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Optional, Union

from datamodules.base import WorkdirDataModule
from datamodules.graph import GraphDataModule
from gnnlm.gnn.graph import GraphConfig
from gnnlm.gnn.window_states import WindowStates
from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.datastore import attach_datastore
from gnnlm.lit.gnn import GNNLM
from gnnlm.lit.heads import LearnedDatastoreLM, SpalmFinetuneLM, SpalmLM
from gnnlm.lit.spalm import SpalmXL
from gnnlm.models import BaseLM
from gnnlm.models.gpt import GPT
from gnnlm.spalm.model import Spalm
from gnnlm.workdir.checkpoints import load_checkpoint, trained_classes
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest

# the heads a work directory's rows are trained as, and the data modules they read
SERVED_CLASSES = ("gnnlm.lit.gnn.GNNLM", "gnnlm.lit.heads.SpalmLM",
                  "gnnlm.lit.heads.LearnedDatastoreLM", "gnnlm.lit.heads.SpalmFinetuneLM",
                  "gnnlm.lit.spalm.SpalmXL", "datamodules.graph.GraphDataModule",
                  "datamodules.features.FeatureDataModule",
                  "datamodules.retrieval_windows.RetrievalWindowsDataModule",
                  "datamodules.spalm.SpalmDataModule")


@dataclass
class TrainedHead:
    """A trained head as the pipeline scored it: its LightningModule (``models/<folder>/``'s
    weights, in eval mode, frozen) and its data module over the work directory."""
    module: TokenLevelModule
    data: WorkdirDataModule
    folder: str
    manifest: dict

    @property
    def key(self) -> str:
        """The features whose neighbours the head reads."""
        return str(self.data.hparams.get("key", "final"))

    @property
    def metric(self) -> str:
        return str(self.data.hparams.get("metric", "cos"))


@dataclass
class GNNHead:
    """GNN-LM: blocks of ``block_size`` tokens; ``graph`` carries the k chosen on valid
    (``eval_k``: the valid perplexity of each k the pipeline tried, or None)."""
    trained: TrainedHead
    graph: GraphConfig
    block_size: int
    eval_k: Optional[dict]

    @property
    def module(self) -> GNNLM:
        assert isinstance(self.trained.module, GNNLM)
        return self.trained.module

    def window_states(self) -> WindowStates:
        """The module's window-state table: each retrieved window computed once, for every k,
        by scoring and decoding alike."""
        return self.module.window_states()


@dataclass
class FeatureHead:
    """A head on the frozen base LM's features, one position at a time: SPALM's gate
    (``gate``, reading ``retrieved`` neighbour values) or a learned W_ds (``wds``)."""
    trained: TrainedHead
    kind: str
    retrieved: int

    @property
    def module(self) -> Any:
        return self.trained.module.head


@dataclass
class FinetunedSpalm:
    """SPALM's gate over the base LM with its last block and final norm trained; the values
    come from the frozen LM's neighbours."""
    trained: TrainedHead
    retrieved: int

    @property
    def lm(self) -> BaseLM:
        assert isinstance(self.trained.module, SpalmFinetuneLM)
        return self.trained.module.lm

    @property
    def gate(self) -> Any:
        return self.trained.module.head


@dataclass
class SegmentSpalm:
    """SPALM end to end, or its transformer / Transformer-XL baselines (``k`` = 0), read as
    contiguous segments of ``segment`` tokens with Transformer-XL memory."""
    trained: TrainedHead
    k: int
    retrieved: int
    segment: int

    @property
    def model(self) -> Spalm:
        assert isinstance(self.trained.module, SpalmXL)
        return self.trained.module.model


Head = Union[GNNHead, FeatureHead, FinetunedSpalm, SegmentSpalm]


def _saved(checkpoint: dict, name: str, cls: type) -> dict:
    """The init arguments of ``cls`` saved under ``name`` (the CLI also records there what it
    linked from the other side, which ``cls`` may not take)."""
    takes = inspect.signature(cls).parameters
    return {k: v for k, v in dict(checkpoint.get(name) or {}).items() if k in takes}


def _class(path: Optional[str], where: str) -> type:
    if path not in SERVED_CLASSES:
        served = ", ".join(c.rsplit(".", 1)[1] for c in SERVED_CLASSES)
        raise ValueError(f"{where} holds a {path or 'unrecorded'} checkpoint, which gnnlm "
                         f"cannot serve (it serves {served}).")
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def load_trained(workdir: Workdir, folder: str, base_lm: BaseLM, base_lm_spec: str,
                 base_lm_options: Optional[dict]) -> TrainedHead:
    """The head trained as ``models/<folder>/`` with its data module. ``base_lm`` is the work
    directory's frozen base LM, checked to be the one the head was trained on;
    ``base_lm_spec``/``base_lm_options`` say where it is for heads that load it themselves."""
    path = workdir.model(folder)
    manifest = read_manifest(path, kind="trained_model")
    checkpoint = load_checkpoint(path / manifest["ckpt"])
    model_path, data_path = trained_classes(checkpoint)
    if model_path is None and manifest.get("model_class"):  # a checkpoint without the record
        model_path = next((c for c in SERVED_CLASSES
                           if c.endswith("." + manifest["model_class"])), None)
    model_class, data_class = _class(model_path, str(path)), _class(data_path, str(path))
    hp = _saved(checkpoint, "hyper_parameters", model_class)
    data_hp = _saved(checkpoint, "datamodule_hyper_parameters", data_class)
    trained_on = hp.get("base_lm_fingerprint")
    if trained_on and trained_on != base_lm.fingerprint():
        raise ValueError(f"{path} was trained on the datastore of base LM weights {trained_on}, "
                         f"not on this work directory's ({base_lm.fingerprint()}): rerun "
                         f"`gnnlm pipeline` to train it again.")
    if model_class is SpalmXL and not isinstance(base_lm, GPT):
        raise ValueError(f"{path} is SPALM end to end, built on the built-in GPT, but the "
                         f"work directory's base LM is {base_lm.name}.")
    if model_class is GNNLM and hp.get("kind", "gnnlm") != "gnnlm":
        raise ValueError(f"{path} holds the HGT baseline (kind {hp['kind']!r}), which is scored "
                         f"with one window per retrieval only: its rows are not served here.")
    # the base LM where this work directory has it now (it may have moved since training)
    if "base_lm" in hp:
        hp["base_lm"] = base_lm_spec
    if "base_lm_options" in hp:
        hp["base_lm_options"] = base_lm_options
    data_hp["workdir"] = str(workdir.root)
    if "base_lm_path" in data_hp:
        data_hp["base_lm_path"] = None  # the one the features record
    module = model_class(**hp)
    module.load_state_dict(checkpoint["state_dict"])
    module.eval().requires_grad_(False)
    data = data_class(**data_hp)
    attach_datastore(module, data)
    return TrainedHead(module, data, folder, manifest)


def load_head(workdir: Workdir, folder: str, base_lm: BaseLM, base_lm_spec: str,
              base_lm_options: Optional[dict]) -> Head:
    """``load_trained``'s head in the view decoding reads."""
    trained = load_trained(workdir, folder, base_lm, base_lm_spec, base_lm_options)
    module, data = trained.module, trained.data.hparams
    if isinstance(module, GNNLM):
        assert isinstance(trained.data, GraphDataModule)
        graph = trained.data.graph
        eval_k = trained.manifest.get("eval_k")
        chosen = int((eval_k or {}).get("chosen") or data.get("eval_k") or graph.k)
        return GNNHead(trained, dataclasses.replace(graph, k=chosen),
                       int(data.get("block_size", 64)), eval_k)
    if isinstance(module, (SpalmLM, LearnedDatastoreLM)):
        return FeatureHead(trained, "gate" if isinstance(module, SpalmLM) else "wds",
                           int(data.get("retrieved", 0)))
    if isinstance(module, SpalmFinetuneLM):
        return FinetunedSpalm(trained, int(data.get("retrieved", 4)))
    assert isinstance(module, SpalmXL)
    return SegmentSpalm(trained, int(module.k), int(data.get("retrieved", 0)),
                        int(data.get("block_size", 512)))
