"""The trained heads of a work directory, read back as plain ``nn.Module``s (no Lightning).

Each ``models/<row>/`` holds the checkpoint ``gnnlm fit`` wrote; its manifest names the
LightningModule class (``model_class``). The module's saved init arguments rebuild the network,
its state dict fills it, and the data module's saved arguments say what the head reads: which
features (``key``), whose neighbours (``key``/``metric``), how many retrieved values
(``retrieved``), and how the pipeline served it (block sizes, segments, streams).

- ``SpalmLM``: SPALM's gate on the frozen features (``gnnlm.spalm.gate.SpalmGate``);
- ``LearnedDatastoreLM``: a learned W_ds on frozen features
  (``gnnlm.models.multi_embedding.MultiEmbeddingSoftmax``);
- ``SpalmFinetuneLM``: the gate over the base LM whose last block and final norm were trained;
- ``SpalmXL``: SPALM trained end to end and its transformer / Transformer-XL baselines
  (``gnnlm.spalm.model.Spalm``), which read segments with memory;
- ``GNNLM``: ``gnnlm.gnn.trained``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, TypeVar, Union

from torch import nn

from gnnlm.gnn.trained import TrainedGNN, load_trained_gnn
from gnnlm.models import BaseLM, load_base_lm
from gnnlm.models.gpt import GPT
from gnnlm.models.multi_embedding import MultiEmbeddingSoftmax
from gnnlm.spalm.gate import SpalmGate
from gnnlm.spalm.model import Spalm
from gnnlm.workdir.artifacts import read_manifest
from gnnlm.workdir.checkpoints import load_checkpoint, model_state
from gnnlm.workdir.layout import Workdir


@dataclass
class FeatureHead:
    """A head on the frozen base LM's features, one position at a time: SPALM's gate
    (``gate``, reading ``retrieved`` neighbour values) or a learned W_ds (``wds``)."""
    kind: str
    module: nn.Module
    key: str
    metric: str
    retrieved: int
    block_size: int


@dataclass
class FinetunedSpalm:
    """SPALM's gate over the base LM with its last block and final norm trained: ``lm`` is that
    LM, which reads the features' sliding windows; the values come from the frozen LM's
    neighbours."""
    lm: BaseLM
    gate: SpalmGate
    key: str
    metric: str
    retrieved: int
    batch_size: int


@dataclass
class SegmentSpalm:
    """SPALM end to end, or its transformer / Transformer-XL baselines (``k`` = 0), read as
    contiguous segments of ``segment`` tokens with Transformer-XL memory; the valid/test splits
    were cut into ``streams`` streams."""
    model: Spalm
    k: int
    key: str
    metric: str
    retrieved: int
    segment: int
    streams: int


Head = Union[TrainedGNN, FeatureHead, FinetunedSpalm, SegmentSpalm]


def _saved(checkpoint: dict, name: str) -> dict:
    return {k: v for k, v in dict(checkpoint.get(name) or {}).items() if not k.startswith("_")}


M = TypeVar("M", bound=nn.Module)


def _frozen(module: M) -> M:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


def load_head(workdir: Workdir, folder: str, base_lm: BaseLM, base_lm_spec: str,
              base_lm_options: Optional[dict]) -> Head:
    """The head trained as ``models/<folder>/``. ``base_lm`` is the work directory's frozen base
    LM (``base_lm_spec`` and ``base_lm_options`` load another copy of it for the fine-tuned
    SPALM; the end-to-end SPALM takes its architecture)."""
    path = workdir.model(folder)
    manifest = read_manifest(path, kind="trained_model")
    kind = manifest.get("model_class")
    if kind == "GNNLM":
        return load_trained_gnn(workdir, folder)
    checkpoint = load_checkpoint(path / manifest["ckpt"])
    hp, data = _saved(checkpoint, "hyper_parameters"), _saved(checkpoint,
                                                              "datamodule_hyper_parameters")
    trained_on = hp.get("base_lm_fingerprint")
    if trained_on and trained_on != base_lm.fingerprint():
        raise ValueError(f"{path} was trained on the datastore of base LM weights {trained_on}, "
                         f"not on this work directory's ({base_lm.fingerprint()}): rerun "
                         f"`gnnlm pipeline` to train it again.")
    key, metric = data.get("key", "final"), data.get("metric", "cos")
    if kind in ("SpalmLM", "LearnedDatastoreLM"):
        if kind == "SpalmLM":
            module: nn.Module = SpalmGate(hp["feature_dim"], hp.get("gate_bias"))
        else:
            module = MultiEmbeddingSoftmax(hp["vocab_size"], hp["feature_dim"],
                                           hp.get("embeddings_per_word", 1))
        module.load_state_dict(model_state(checkpoint, "head."))
        return FeatureHead("gate" if kind == "SpalmLM" else "wds", _frozen(module), key, metric,
                           int(data.get("retrieved", 0)), int(data.get("block_size", 512)))
    if kind == "SpalmFinetuneLM":
        lm = load_base_lm(base_lm_spec, base_lm_options)
        lm.load_state_dict(model_state(checkpoint, "lm."))
        gate = SpalmGate(lm.hidden_size, hp.get("gate_bias"))
        gate.load_state_dict(model_state(checkpoint, "head."))
        return FinetunedSpalm(_frozen(lm), _frozen(gate), key, metric,
                              int(data.get("retrieved", 4)), int(data.get("eval_batch_size", 32)))
    if kind == "SpalmXL":
        if not isinstance(base_lm, GPT):
            raise ValueError(f"{path} is SPALM end to end, built on the built-in GPT, but the "
                             f"work directory's base LM is {base_lm.name}.")
        # the base LM's architecture; the weights are the head's own
        config = dataclasses.replace(base_lm.cfg, memory_length=int(hp.get("memory_length", 0)),
                                     dropout=base_lm.cfg.dropout if hp.get("dropout") is None
                                     else hp["dropout"])
        k = int(hp.get("k", 0))
        model = Spalm(GPT(config), long_term=k > 0, gate_bias=hp.get("gate_bias"),
                      memory_scale=hp.get("memory_scale", "none"))
        model.load_state_dict(model_state(checkpoint, "model."))
        return SegmentSpalm(_frozen(model), k, key, metric, int(data.get("retrieved", 0)),
                            int(data.get("block_size", 512)), int(data.get("eval_streams", 16)))
    raise ValueError(f"{path} holds a {kind} checkpoint, which gnnlm cannot serve.")
