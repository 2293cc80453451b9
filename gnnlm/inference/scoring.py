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
- a trained head scores the text through the pipeline's own ``predict``
  (``gnnlm.pipeline.scoring.predict_tokens``), its data module serving the text in place of a
  split (``datamodules.splits``): GNN-LM's blocks of ``block_size`` tokens with each retrieved
  window computed once (Meng et al. 2022 §2), SPALM's gate and a learned W_ds on the positions'
  features, SPALM with its last block trained on the base LM's windows, and SPALM end to end
  and its Transformer-XL / transformer baselines on the pipeline's ``eval_streams`` contiguous
  streams of segments, memory carried (``gnnlm.models.segments``): scores of a text depend on
  how many streams it is cut into, as the report's do. The head runs in the precision its row
  was scored in (``gnnlm.pipeline.precision``), on the CPU like every other part of a served
  work directory: on a GPU machine too, so that scoring and decoding (whose heads run on the
  CPU) give one number, under one autocast.

Each row's ``Score`` carries its protocol (``gnnlm.models.protocols``). The base LM and the
searches run in float32, as the features and neighbours stages ran. Each row's scores are
computed once per call: ``gnn+knn`` reads the ``gnn`` row's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Union, cast

import numpy as np
import torch

from datamodules.graph import GraphDataModule
from datamodules.splits import TEXT, TextArrays
from gnnlm.inference.heads import GNNHead, Head, SegmentSpalm
from gnnlm.inference.parts import LMParts
from gnnlm.inference.served import NotServed, RowSettings, ServedRow
from gnnlm.models import protocols
from gnnlm.models.base import BaseLM
from gnnlm.models.encode import encode_windows
from gnnlm.pipeline.precision import FLOAT32, served_in
from gnnlm.pipeline.scoring import OwnScoringProtocol, predict_tokens
from gnnlm.retrieval.knn import interpolate, knn_lm_logprob
from gnnlm.retrieval.lookup import stored
from gnnlm.retrieval.neighbors import neighbor_hits
from gnnlm.utils.metrics import ppl_from_logprobs
from gnnlm.workdir import rows

ENCODE_BATCH = 16   # windows per forward pass of an LM over a text


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
    every position, the features as stored, the neighbours of each key and similarity, and each
    head's scores under each setting."""

    def __init__(self, lm: LMParts, ids: np.ndarray):
        self.lm, self.ids = lm, ids
        self._neighbours: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._stored: dict[str, np.ndarray] = {}
        self._scored: dict[tuple[str, RowSettings], tuple[np.ndarray, dict]] = {}

    @cached_property
    def frozen(self) -> dict[str, np.ndarray]:
        """``final``, ``att`` float32 [n, d] and ``logprob`` [n] of the base LM (in float32, as
        the features stage encodes, also when a head's autocast asks for them first)."""
        with served_in(FLOAT32):
            return encode(self.lm.base_lm, self.ids, self.lm, with_logprob=True)

    @cached_property
    def sliding(self) -> dict:
        """The protocol of the base LM's sliding windows over this text."""
        lm = self.lm
        return protocols.sliding_window(min(lm.context, len(self.ids)), lm.stride,
                                        lm.bos_each_window)

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

    def text_arrays(self, key: str, metric: str, reads_neighbours: bool) -> TextArrays:
        """The text's arrays as a split's artifacts would hold them, for a head's data module:
        its tokens, its ``key`` features as stored and (``reads_neighbours``) their
        neighbours."""
        arrays = TextArrays(self.ids, features={key: self.stored(key)})
        if reads_neighbours:
            arrays.neighbor_ids[(key, metric)] = self.neighbours(key, metric)[1]
        return arrays


@torch.no_grad()
def encode(model: BaseLM, ids: np.ndarray, lm: LMParts, with_logprob: bool = False,
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


def score(lm: LMParts, ids: np.ndarray, row: Union[str, list[str]], overrides: dict):
    """``row``'s ``Score`` of ``ids`` (a list of rows: a dict by row, sharing the base LM's
    features, the searches and the heads' scores). With several rows, each override applies to
    the rows that read it."""
    inputs = Inputs(lm, ids)
    if isinstance(row, str):
        served = lm.served.row(row)
        return _score(inputs, served, lm.settings(served, **overrides))
    given = {name for name, value in overrides.items() if value is not None}
    settings = {}
    for name in row:
        served = lm.served.row(name)
        read = set(lm.settings(served).read())
        settings[name] = (served, lm.settings(
            served, **{k: v for k, v in overrides.items() if k in read}))
        given -= read
    if given:
        raise NotServed(f"{', '.join(sorted(given))} changes nothing: none of the rows "
                        f"{', '.join(row)} reads it.")
    return {name: _score(inputs, *settings[name]) for name in row}


def _score(inputs: Inputs, row: ServedRow, settings: RowSettings) -> Score:
    logprobs, protocol = row_logprobs(inputs, row, settings)
    return Score(row.name, inputs.ids, np.asarray(logprobs, dtype=np.float32), protocol,
                 inputs.lm.unk_share(inputs.ids), settings)


def row_logprobs(inputs: Inputs, row: ServedRow, settings: RowSettings
                 ) -> tuple[np.ndarray, dict]:
    """``row``'s log p of every token of the text, and the protocol it read them under."""
    if row.name == rows.BASE:
        return inputs.frozen["logprob"], inputs.sliding
    if row.row.knn:  # kNN-LM over the base LM, or over a head (gnn+knn, <head>+knn)
        under, protocol = (inputs.frozen["logprob"], inputs.sliding) if row.head is None else \
            head_logprobs(inputs, row, settings)
        return knn_interpolated(inputs, row, under, settings), protocol
    if row.row.interpolation:  # <head>+base: the head with the base LM
        alone, _ = head_logprobs(inputs, row, settings)
        return interpolate(inputs.frozen["logprob"], alone, settings.weight), inputs.sliding
    if row.head is None:
        raise NotServed(f"row {row.name!r} cannot be scored here.")
    return head_logprobs(inputs, row, settings)


def knn_interpolated(inputs: Inputs, row: ServedRow, under: np.ndarray, settings: RowSettings
                     ) -> np.ndarray:
    """kNN-LM over the model whose log p(target) is ``under`` (the base LM's, or GNN-LM's):
    the kNN cache's arrays for this text, then the pipeline's own per-token maths."""
    lm = inputs.lm
    key, metric, scores = row.retrieval
    sims, ids = inputs.neighbours(key, metric)
    lookup = lm.lookup(key, metric)
    cache = {"lm_logprob": np.asarray(under, dtype=np.float32),
             "sims": lookup.knn_sims(inputs.stored(key), sims, ids, scores),
             "hits": neighbor_hits(ids, lookup.train_targets, inputs.ids)}
    return knn_lm_logprob(cache, *settings.knn(), settings.weight)


def head_logprobs(inputs: Inputs, row: ServedRow, settings: RowSettings
                  ) -> tuple[np.ndarray, dict]:
    """The scores of the head ``row`` reads, computed once per text and setting: the
    pipeline's ``predict`` over the text (``predict_tokens``), the head's data module serving
    it in place of a split, in the precision the report scored it in, on the CPU."""
    head = inputs.lm.head(row)
    gnn_k = settings.gnn_k if isinstance(head, GNNHead) else None
    memo = (row.folder, RowSettings(gnn_k=gnn_k))
    if memo not in inputs._scored:
        inputs._scored[memo] = _predict(inputs, head, gnn_k, row.precision)
    return inputs._scored[memo]


def _predict(inputs: Inputs, head: Head, gnn_k: Optional[int], precision: str
             ) -> tuple[np.ndarray, dict]:
    trained = head.trained
    data = trained.data
    reads_neighbours = isinstance(head, GNNHead) or bool(getattr(data, "retrieved", 0))
    data.connect(text=inputs.text_arrays(trained.key, trained.metric, reads_neighbours))
    if isinstance(head, GNNHead):
        assert isinstance(data, GraphDataModule)
        data.connect(eval_k=int(gnn_k or head.graph.k))
    logprob = predict_tokens(trained.module, data, TEXT, len(inputs.ids), cast(Any, precision),
                             progress=False, inference_mode=False, accelerator="cpu")["logprob"]
    if isinstance(head, SegmentSpalm):  # the data module's segments of parallel streams
        assert isinstance(data, OwnScoringProtocol)
        return logprob, data.scoring_protocol(head.model.memory_length)
    return logprob, inputs.sliding
