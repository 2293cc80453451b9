"""Scoring a text as the pipeline scored its splits, for every row of a work directory.

A text (or a split's token ids) is read exactly as the pipeline read valid and test, so that on
a split's own tokens every row gives the report's per-token scores:

- the base LM reads sliding windows of context C, stride S (``gnnlm.models.encode``), the last
  window of the text shifted left to be full; its features are kept as the datastore keeps them
  (float16) for whatever reads them;
- retrieval searches each position's feature as the neighbours stage did
  (``gnnlm.retrieval.lookup``); kNN-LM is the cached path's maths on those neighbours
  (``gnnlm.retrieval.knn.knn_lm_logprob``, the target alone, Khandelwal et al. 2020),
  interpolated with the base LM or with a head's scores under that head's protocol (GNN+kNN,
  Transformer-XL + kNN-LM);
- GNN-LM reads blocks of its ``block_size`` tokens from the text's start, each retrieved window
  computed once (``gnnlm.gnn.window_states``, Meng et al. 2022 §2);
- SPALM's gate and a learned W_ds read the positions' features; SPALM with its last block trained
  runs that LM on the same windows;
- SPALM end to end and its Transformer-XL / transformer baselines read the text as the
  pipeline's ``eval_streams`` contiguous streams of segments, memory carried
  (``gnnlm.models.segments``): scores of a text depend on how many streams it is cut into, as
  the report's do.

Each row's ``Score`` carries its protocol (``gnnlm.models.protocols``). A head runs under the
autocast its row was scored in (``gnnlm.pipeline.precision``: bf16 for a GPU preset's heads), the
base LM and the searches in float32, as the features and neighbours stages ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.gnn.dense import context_layout
from gnnlm.gnn.graph import select_neighbors
from gnnlm.gnn.trained import TrainedGNN
from gnnlm.inference.heads import FeatureHead, FinetunedSpalm, SegmentSpalm
from gnnlm.inference.served import NotServed, RowSettings
from gnnlm.models import protocols
from gnnlm.models.base import BaseLM, float32
from gnnlm.models.encode import encode_windows, stream_tensor
from gnnlm.models.segments import StreamSegments
from gnnlm.pipeline import rows
from gnnlm.pipeline.precision import FLOAT32, served_in
from gnnlm.retrieval.knn import interpolate, knn_lm_logprob
from gnnlm.retrieval.lookup import stored
from gnnlm.retrieval.neighbors import neighbor_hits
from gnnlm.utils.metrics import ppl_from_logprobs, target_nll

if TYPE_CHECKING:
    from gnnlm.inference.model import TrainedLM

ENCODE_BATCH = 16   # windows per forward pass of an LM over a text
HEAD_ROWS = 4096    # positions per pass of a head over the vocabulary


@dataclass
class Score:
    """One row's scores of a text: ``logprobs`` float32 [n], log p of each token given what
    precedes it (position t predicts ``ids[t]``), under ``protocol``, with ``settings``."""
    row: str
    ids: np.ndarray
    logprobs: np.ndarray
    protocol: dict
    unk_share: Optional[float]
    settings: RowSettings

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def ppl(self) -> float:
        """exp(Σ NLL / tokens) over every token of the text."""
        return ppl_from_logprobs(self.logprobs)


class Inputs:
    """What the rows read of one text, each computed once: the base LM's features and log p of
    every position, the features as stored, and the neighbours of each key and similarity."""

    def __init__(self, lm: TrainedLM, ids: np.ndarray):
        self.lm, self.ids = lm, ids
        self.targets = torch.from_numpy(ids)
        self._neighbours: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._stored: dict[str, np.ndarray] = {}

    @cached_property
    def frozen(self) -> dict[str, np.ndarray]:
        """``final``, ``att`` float32 [n, d] and ``logprob`` [n] of the base LM (in float32, as
        the features stage encodes, also when a head's autocast asks for them first)."""
        with served_in(FLOAT32):
            return encode(self.lm.base_lm, self.ids, self.lm, with_logprob=True)

    def stored(self, key: str) -> np.ndarray:
        """The ``key`` features as the datastore holds them (float16 values, float32 array)."""
        if key not in self._stored:
            self._stored[key] = stored(self.frozen[key])
        return self._stored[key]

    def neighbours(self, key: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """``(sims, ids)`` [n, K] of every position, as a neighbours file holds them."""
        if (key, metric) not in self._neighbours:
            with served_in(FLOAT32):  # searched as the neighbours stage searched
                self._neighbours[(key, metric)] = self.lm.lookup(key, metric).search(
                    self.stored(key))
        return self._neighbours[(key, metric)]

    def values(self, key: str, metric: str, k: int) -> torch.Tensor:
        """The values of the first ``k`` neighbours of every position [n, k] (-1: none)."""
        ids = self.neighbours(key, metric)[1][:, :k]
        return torch.from_numpy(self.lm.lookup(key, metric).values(ids))


@torch.no_grad()
def encode(model: BaseLM, ids: np.ndarray, lm: TrainedLM, with_logprob: bool = False,
           batch_size: int = ENCODE_BATCH) -> dict[str, np.ndarray]:
    """Features of every position of ``ids`` under the datastore's sliding windows (as the
    features stage encodes a split: context and stride at most the text's length)."""
    n = len(ids)
    context = min(lm.context, n, model.context_length or n)
    batches = list(encode_windows(model, ids, lm.bos_id, context, min(lm.stride, context),
                                  batch_size=batch_size, with_logprob=with_logprob,
                                  bos_each_window=lm.bos_each_window))
    out = {"final": torch.cat([b.final for b in batches]).cpu().numpy(),
           "att": torch.cat([b.att for b in batches]).cpu().numpy()}
    if with_logprob:
        out["logprob"] = torch.cat([b.logprob for b in batches if b.logprob is not None]
                                   ).cpu().numpy()
    return out


def score(lm: TrainedLM, ids: np.ndarray, row: Union[str, list[str]], overrides: dict):
    """``row``'s ``Score`` of ``ids`` (a list of rows: a dict by row, sharing the base LM's
    features and the searches). With several rows, each override applies to the rows that read
    it."""
    inputs = Inputs(lm, ids)
    if isinstance(row, str):
        return _score(inputs, row, lm.settings(row, **overrides))
    given = {name for name, value in overrides.items() if value is not None}
    settings = {}
    for name in row:
        read = set(lm.settings(name).read())
        settings[name] = lm.settings(name, **{k: v for k, v in overrides.items() if k in read})
        given -= read
    if given:
        raise NotServed(f"{', '.join(sorted(given))} changes nothing: none of the rows "
                        f"{', '.join(row)} reads it.")
    return {name: _score(inputs, name, settings[name]) for name in row}


def _score(inputs: Inputs, row: str, settings: RowSettings) -> Score:
    lm = inputs.lm
    logprobs, protocol = row_logprobs(inputs, row, settings)
    return Score(row, inputs.ids, np.asarray(logprobs, dtype=np.float32), protocol,
                 lm.unk_share(inputs.ids), settings)


def row_logprobs(inputs: Inputs, row: str, settings: RowSettings) -> tuple[np.ndarray, dict]:
    """``row``'s log p of every token of the text, and the protocol it read them under."""
    lm = inputs.lm
    sliding = protocols.sliding_window(min(lm.context, len(inputs.ids)), lm.stride,
                                       lm.bos_each_window)
    if row == rows.BASE:
        return inputs.frozen["logprob"], sliding
    served = lm.served.row(row)
    if served.knn:  # kNN-LM over the base LM, or over a head (gnn+knn, <head>+knn)
        under, protocol = (inputs.frozen["logprob"], sliding) if served.head is None else \
            row_logprobs(inputs, served.head, settings)
        return knn_interpolated(inputs, row, under, settings), protocol
    head_row = served.head
    if head_row is not None and head_row != row:  # <head>+base: the head with the base LM
        alone = row_logprobs(inputs, head_row, lm.settings(head_row))[0]
        return interpolate(inputs.frozen["logprob"], alone, settings.weight), sliding
    head = lm.head(row)
    with served_in(lm.served.precision(row)):  # predict's autocast (bf16 under gpu.yaml)
        if isinstance(head, TrainedGNN):
            return gnn_logprobs(inputs, head, int(settings.gnn_k or head.graph.k)), sliding
        if isinstance(head, FeatureHead):
            return feature_head_logprobs(inputs, head), sliding
        if isinstance(head, FinetunedSpalm):
            return finetuned_spalm_logprobs(inputs, head), sliding
        if isinstance(head, SegmentSpalm):
            return segment_logprobs(inputs, head)
    raise NotServed(f"row {row!r} cannot be scored here.")


def knn_interpolated(inputs: Inputs, row: str, under: np.ndarray, settings: RowSettings
                     ) -> np.ndarray:
    """kNN-LM over the model whose log p(target) is ``under`` (the base LM's, or GNN-LM's):
    the kNN cache's arrays for this text, then the pipeline's own per-token maths."""
    lm = inputs.lm
    key, metric, scores = lm.served.retrieval(row)
    sims, ids = inputs.neighbours(key, metric)
    lookup = lm.lookup(key, metric)
    cache = {"lm_logprob": np.asarray(under, dtype=np.float32),
             "sims": lookup.knn_sims(inputs.stored(key), sims, ids, scores),
             "hits": neighbor_hits(ids, lookup.train_targets, inputs.ids)}
    return knn_lm_logprob(cache, *settings.knn(), settings.weight)


def _nll_of(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    return (-target_nll(logits, targets)).numpy()


@torch.no_grad()
def gnn_logprobs(inputs: Inputs, gnn: TrainedGNN, k: int) -> np.ndarray:
    """GNN-LM (Meng et al. 2022): blocks of ``block_size`` tokens, ``eval_batch_size`` blocks at
    a time, each token reading its first k retrieved windows, read out by the base LM's output
    embedding."""
    lm = inputs.lm
    n, B = len(inputs.ids), gnn.block_size
    states = lm.window_states()
    graph = states.config
    ctx = torch.from_numpy(inputs.stored(gnn.key))
    neighbour_ids = inputs.neighbours(gnn.key, gnn.metric)[1]
    weight, bias = lm.output_embedding
    out = np.empty(n, dtype=np.float32)
    starts = list(range(0, n, B))
    for first in range(0, len(starts), gnn.eval_batch_size):
        blocks = [(s, min(s + B, n)) for s in starts[first:first + gnn.eval_batch_size]]
        T = max(end - start for start, end in blocks)
        x = ctx.new_zeros(len(blocks), T, ctx.shape[1])
        mask = torch.zeros(len(blocks), T, dtype=torch.bool)
        retrieved = torch.full((len(blocks), T, k), -1, dtype=torch.int64)
        for b, (start, end) in enumerate(blocks):
            x[b, :end - start] = ctx[start:end]
            mask[b, :end - start] = True
            retrieved[b, :end - start] = torch.from_numpy(
                select_neighbors(neighbour_ids[start:end], k))
        h = states(x, context_layout(mask, retrieved, graph))[mask]        # [n_b, d]
        with float32(h):  # the softmax stays in float32, as in GNNLM.forward
            logits = lm.logit_transform(F.linear(h.float(), weight, bias))
        lo, hi = blocks[0][0], blocks[-1][1]
        out[lo:hi] = _nll_of(logits, inputs.targets[lo:hi])
    return out


@torch.no_grad()
def feature_head_logprobs(inputs: Inputs, head: FeatureHead) -> np.ndarray:
    """SPALM's gate on the frozen features (Yogatama et al. 2021 §2) or a learned W_ds
    (Xu et al. 2023 §4), ``block_size`` positions at a time."""
    lm = inputs.lm
    n = len(inputs.ids)
    h = torch.from_numpy(inputs.stored(head.key))
    weight, bias = lm.output_embedding
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, head.block_size):
        part = slice(start, min(start + head.block_size, n))
        if head.kind == "wds":
            logp = head.module(h[part])
            out[part] = logp.gather(1, inputs.targets[part, None])[:, 0].numpy()
            continue
        values = inputs.values(head.key, head.metric, head.retrieved)[part]
        logits, _ = head.module(h[part], values, weight, bias,
                                logit_transform=lm.logit_transform)
        out[part] = _nll_of(logits, inputs.targets[part])
    return out


@torch.no_grad()
def finetuned_spalm_logprobs(inputs: Inputs, head: FinetunedSpalm) -> np.ndarray:
    """SPALM's gate over the LM whose last block was trained with it: that LM reads the same
    windows as the base LM; the values come from the frozen LM's neighbours."""
    lm = inputs.lm
    final = torch.from_numpy(encode(head.lm, inputs.ids, lm, batch_size=head.batch_size)["final"])
    values = inputs.values(head.key, head.metric, head.retrieved)
    weight, bias = head.lm.output_embedding()
    out = np.empty(len(inputs.ids), dtype=np.float32)
    for start in range(0, len(out), HEAD_ROWS):
        part = slice(start, start + HEAD_ROWS)
        logits, _ = head.gate(final[part], values[part], weight.float(),
                              None if bias is None else bias.float(),
                              logit_transform=head.lm.logit_transform)
        out[part] = _nll_of(logits, inputs.targets[part])
    return out


@torch.no_grad()
def segment_logprobs(inputs: Inputs, head: SegmentSpalm) -> tuple[np.ndarray, dict]:
    """SPALM end to end or its baselines: the text as ``streams`` contiguous streams read a
    segment at a time, all streams together, memory carried from segment to segment."""
    lm = inputs.lm
    data = StreamSegments(stream_tensor(inputs.ids, lm.bos_id), head.streams, head.segment)
    values: Any = inputs.values(head.key, head.metric, head.retrieved) if head.k else None
    memory = None
    out = np.full(len(inputs.ids), np.nan, dtype=np.float32)
    for j in range(data.n_segments):
        items = [data[j * head.streams + s] for s in range(head.streams)]
        batch = {name: torch.stack([item[name] for item in items]) for name in items[0]}
        positions = batch["positions"]                                    # [S, T], -1: padding
        nbr = None
        if values is not None:
            nbr = torch.full((*positions.shape, head.k), -1, dtype=torch.int64)
            nbr[positions >= 0] = values[positions[positions >= 0], :head.k]
        result = head.model(batch["input"], nbr, memory if head.model.memory_length else None)
        memory = result.memory
        nll = target_nll(result.logits.flatten(0, 1), batch["target"].flatten())
        scored = positions.flatten() >= 0
        out[positions.flatten()[scored].numpy()] = (-nll[scored]).numpy()
    return out, protocols.segments(head.segment, head.streams, head.model.memory_length)
