"""The next-token distribution of every row, for text that grows: from scratch or incrementally.

A ``Decoder`` reads B streams of one length (``[bos] + tokens``) and gives log p(next token)
[B, V] under one row after each append. What it reads at each new position is what the row read
when the pipeline scored it, with the base LM's windows taken from the unbounded sliding-window
protocol (``gnnlm.models.decode``):

- the base LM's features and log-softmax (the ``base`` row);
- one search of the new position's feature, as the pipeline searched
  (``gnnlm.retrieval.lookup``): kNN-LM's p_kNN on the words its neighbours hold
  (``gnnlm.retrieval.knn.knn_support``, Khandelwal et al. 2020), interpolated in log space;
- GNN-LM's context node of the new position in its block, reading its k windows
  (``gnnlm.gnn.incremental``, Meng et al. 2022 §2);
- SPALM's gate over the retrieved next tokens' embeddings (Yogatama et al. 2021 §2), on the
  frozen features, on the LM whose last block was trained, or inside SPALM end to end, whose own
  LM reads the text as one stream of segments with Transformer-XL memory carried;
- a learned W_ds (Xu et al. 2023 §4), alone or interpolated with the base LM.

``incremental=True`` keeps every state a token leaves: the LMs' key/value caches over their
current windows or segments, GNN-LM's context nodes of the current block. ``incremental=False``
recomputes everything each time from the stream (the base LM's windows, GNN-LM's block through
``WindowStates.forward``, SPALM's segments), which is what ``next_token_logprobs`` does; the two
agree to float rounding at every step (``tests/inference/test_inference.py``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from gnnlm.gnn.dense import context_layout
from gnnlm.gnn.graph import select_neighbors
from gnnlm.gnn.incremental import ContextStates
from gnnlm.inference.heads import FeatureHead, FinetunedSpalm, GNNHead, SegmentSpalm
from gnnlm.inference.parts import LMParts
from gnnlm.inference.served import NotServed, RowSettings, ServedRow
from gnnlm.models.base import BaseLM, Features, float32
from gnnlm.models.decode import StreamDecoder, stream_features
from gnnlm.models.gpt import GPT, KVCache
from gnnlm.pipeline.precision import FLOAT32, served_in
from gnnlm.retrieval.knn import interpolate, interpolate_support, knn_support
from gnnlm.retrieval.lookup import stored
from gnnlm.workdir import rows


class LMReader:
    """An LM's features at the newest positions of the streams, under the sliding windows."""

    def __init__(self, model: BaseLM, lm: LMParts, incremental: bool):
        self.model, self.lm = model, lm
        self.decoder = StreamDecoder(model, lm.context, lm.stride, lm.bos_id,
                                     lm.bos_each_window) if incremental else None
        self.stream: Optional[Tensor] = None

    def append(self, tokens: Tensor, features_from: int) -> Features:
        """Features (float32 [B, n', d]) of the appended positions from ``features_from`` on."""
        if self.decoder is not None:
            return self.decoder.append(tokens, features_from)
        first = 0 if self.stream is None else self.stream.shape[1]
        self.stream = tokens if self.stream is None else torch.cat([self.stream, tokens], dim=1)
        positions = range(max(first, features_from), self.stream.shape[1])
        return stream_features(self.model, self.stream, positions, self.lm.context,
                               self.lm.stride, self.lm.bos_id, self.lm.bos_each_window)


class GNNReader:
    """GNN-LM's output at the newest context node of its block: the block's nodes kept
    (``ContextStates``), or the whole block so far read again by ``WindowStates.forward``."""

    def __init__(self, lm: LMParts, gnn: GNNHead, incremental: bool):
        self.states, self.block_size = lm.window_states(), gnn.block_size
        self.context = ContextStates(self.states, gnn.block_size) if incremental else None
        self.block = -1
        self._ctx: list[Tensor] = []        # scratch: the block's inputs so far
        self._retrieved: list[Tensor] = []

    def append(self, first: int, ctx: Tensor, retrieved: Tensor) -> Tensor:
        """``ctx`` [B, n, d] and ``retrieved`` [B, n, k] of positions ``first`` … ``first + n −
        1``, all in one block: the stack's output [B, d] at the last of them."""
        block = first // self.block_size
        if block != self.block:
            self.block = block
            self._ctx, self._retrieved = [], []
            if self.context is not None:
                self.context.new_block()
        if self.context is not None:
            return self.context.append(ctx, retrieved)[:, -1]
        self._ctx.append(ctx)
        self._retrieved.append(retrieved)
        x, ids = torch.cat(self._ctx, dim=1), torch.cat(self._retrieved, dim=1)
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
        with torch.no_grad():
            return self.states(x, context_layout(mask, ids, self.states.config))[:, -1]


class SegmentReader:
    """The last position's final features of SPALM end to end's own LM, which reads one stream
    in segments with Transformer-XL memory: kept in a key/value cache that starts each segment
    from the previous one's memory, or every segment read again."""

    def __init__(self, head: SegmentSpalm, incremental: bool):
        self.gpt: GPT = head.model.lm
        self.segment, self.incremental = head.segment, incremental
        self.stream: Optional[Tensor] = None
        self._cache: Optional[KVCache] = None

    @torch.no_grad()
    def append(self, tokens: Tensor) -> Tensor:
        first = 0 if self.stream is None else self.stream.shape[1]
        self.stream = tokens if self.stream is None else torch.cat([self.stream, tokens], dim=1)
        end = self.stream.shape[1]
        if not self.incremental:
            memory, feats = None, None
            for start in range(0, end, self.segment):
                feats = self.gpt(self.stream[:, start:min(start + self.segment, end)],
                                 memory=memory)
                memory = feats.memory
            assert feats is not None
            return feats.final[:, -1].float()
        start, final = first, None
        while start < end:  # one step per run of positions within a segment
            stop = min(end, (start // self.segment + 1) * self.segment)
            if start % self.segment == 0 and start > 0:  # a new segment: the memory carried
                assert self._cache is not None
                memory = self.gpt.next_memory(self._cache) if self.gpt.memory_length else None
                self._cache = self.gpt.memory_cache(memory)
            feats, self._cache = self.gpt.step(self.stream[:, start:stop], self._cache)
            start, final = stop, feats.final[:, -1]
        assert final is not None
        return final.float()


class Decoder:
    """log p(next token) [B, V] of one row after each ``append`` to B streams of one length.

    Args:
        lm: the work directory's parts (``TrainedLM``).
        row: one of its report's rows (``lm.served.row(name)``).
        settings: the row's settings (``lm.settings(row, ...)``).
        incremental: keep each state a token leaves (generation), or recompute from the stream.
    """

    def __init__(self, lm: LMParts, row: ServedRow, settings: RowSettings, incremental: bool):
        self.lm, self.row, self.settings, self.incremental = lm, row, settings, incremental
        if incremental:
            lm.note_cache_rounding()
        self.frozen = LMReader(lm.base_lm, lm, incremental)
        # kNN-LM over the base LM (knn) or over a head (gnn+knn, <head>+knn)
        self.knn = row.retrieval if row.row.knn else None
        self.head = None if row.row.on_base_lm else lm.head(row)
        self.precision = row.precision  # the head runs as predict scored it
        self.with_base = row.row.interpolation and self.knn is None  # <head>+base
        self.gnn = GNNReader(lm, self.head, incremental) if isinstance(self.head, GNNHead) \
            else None
        self.tuned = LMReader(self.head.lm, lm, incremental) \
            if isinstance(self.head, FinetunedSpalm) else None
        self.segments = SegmentReader(self.head, incremental) \
            if isinstance(self.head, SegmentSpalm) else None
        self.length = 0
        # the frozen LM's features of positions ``_first`` on, read when a row first asks: the
        # tokens wait in ``_pending`` (a row that reads neither them nor retrieval never runs it)
        self._features: Optional[Features] = None
        self._pending: list[Tensor] = []
        self._first = 0
        self._found: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    # -- reading ------------------------------------------------------------------------------
    def start(self, tokens: Tensor) -> Tensor:
        """Read prompts ``tokens [B, m]`` (their stream opens with BOS): log p [B, V]."""
        bos = torch.full((tokens.shape[0], 1), self.lm.bos_id, dtype=torch.int64)
        return self.append(torch.cat([bos, tokens.to(torch.int64)], dim=1))

    def append(self, tokens: Tensor) -> Tensor:
        """Read ``tokens [B, n]`` after the streams so far: log p of the next token [B, V]."""
        first, self.length = self.length, self.length + tokens.shape[1]
        last = self.length - 1
        self.lm.note_slide(self.length)
        # GNN-LM reads every context node of the last position's block; the rest its last only
        lo = last if self.gnn is None else max(first, last - last % self.gnn.block_size)
        self._pending.append(tokens)
        self._features, self._first, self._found = None, lo, {}
        with torch.no_grad():
            return self.logprobs(tokens).float()

    def features(self) -> Features:
        """The frozen LM's features [B, n, d] of the positions from ``_first`` on."""
        if self._features is None:
            with served_in(FLOAT32):  # the datastore's float32, also inside a head's autocast
                self._features = self.frozen.append(torch.cat(self._pending, dim=1),
                                                    self._first)
            self._pending = []
        return self._features

    def neighbours(self, key: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """``(sims, ids)`` [B, n, K] of the positions read since ``_first`` (searched once)."""
        if (key, metric) not in self._found:
            queries = getattr(self.features(), key)                      # [B, n, d]
            B, n, d = queries.shape
            with served_in(FLOAT32):  # searched as the neighbours stage searched
                sims, ids = self.lm.lookup(key, metric).search(
                    queries.reshape(B * n, d).numpy())
            self._found[(key, metric)] = sims.reshape(B, n, -1), ids.reshape(B, n, -1)
        return self._found[(key, metric)]

    def _last(self, key: str) -> Tensor:
        """The frozen LM's ``key`` feature at the last position, as stored [B, d]."""
        return torch.from_numpy(stored(getattr(self.features(), key)[:, -1].numpy()))

    def _values(self, key: str, metric: str, k: int) -> Tensor:
        """The values of the last position's first ``k`` neighbours [B, k] (-1: none)."""
        ids = self.neighbours(key, metric)[1][:, -1, :k]
        return torch.from_numpy(self.lm.lookup(key, metric).values(ids))

    # -- the rows -----------------------------------------------------------------------------
    def logprobs(self, tokens: Tensor) -> Tensor:
        if self.knn is not None:
            under = self.base_logprobs() if self.head is None else self.head_logprobs(tokens)
            return interpolate_support(under, *self.knn_support(), self.settings.weight)
        if self.with_base:  # <head>+base: the head interpolated with the base LM
            return interpolate(self.base_logprobs(), self.head_logprobs(tokens),
                               self.settings.weight)
        if self.row.name == rows.BASE:
            return self.base_logprobs()
        return self.head_logprobs(tokens)

    def base_logprobs(self) -> Tensor:
        return torch.log_softmax(self.lm.base_lm.logits(self.features().final[:, -1]).float(), -1)

    def knn_support(self) -> tuple[Tensor, Tensor]:
        """p_kNN of the last position's neighbours where it is not zero: ``(words, log p)``
        [B, k] (``gnnlm.retrieval.knn.knn_support``)."""
        assert self.knn is not None
        key, metric, scores = self.knn
        sims, ids = (a[:, -1] for a in self.neighbours(key, metric))
        lookup = self.lm.lookup(key, metric)
        sims = lookup.knn_sims(self._last(key).numpy(), sims, ids, scores)
        return knn_support(sims, lookup.values(ids), *self.settings.knn())

    def _output(self, h: Tensor) -> Tensor:
        """log-softmax of ``h`` [B, d] through the base LM's output embedding."""
        weight, bias = self.lm.output_embedding
        with float32(h):  # the softmax stays in float32, as in GNNLM.forward
            return torch.log_softmax(self.lm.logit_transform(F.linear(h.float(), weight, bias)),
                                     -1)

    def gnn_logprobs(self) -> Tensor:
        assert isinstance(self.head, GNNHead) and self.gnn is not None
        gnn, k = self.head.trained, int(self.settings.gnn_k or self.head.graph.k)
        ctx = torch.from_numpy(stored(getattr(self.features(), gnn.key).numpy()))  # [B, n, d]
        ids = self.neighbours(gnn.key, gnn.metric)[1]                      # [B, n, K]
        retrieved = torch.from_numpy(select_neighbors(ids.reshape(-1, ids.shape[-1]), k))
        h = self.gnn.append(self._first, ctx, retrieved.view(*ids.shape[:2], k))
        return self._output(h)

    def head_logprobs(self, tokens: Tensor) -> Tensor:
        """The head's log p [B, V], under the autocast its row was scored in."""
        with served_in(self.precision):
            return self._head_logprobs(tokens)

    def _head_logprobs(self, tokens: Tensor) -> Tensor:
        head = self.head
        if isinstance(head, GNNHead):
            return self.gnn_logprobs()
        if head is None:
            raise NotServed(f"row {self.row.name!r} reads no head.")
        key, metric = head.trained.key, head.trained.metric
        if isinstance(head, FeatureHead):
            h = self._last(key)
            if head.kind == "wds":
                return head.module(h)
            weight, bias = self.lm.output_embedding
            logits, _ = head.module(h, self._values(key, metric, head.retrieved),
                                    weight, bias, logit_transform=self.lm.logit_transform)
            return torch.log_softmax(logits, -1)
        if isinstance(head, FinetunedSpalm):
            assert self.tuned is not None
            final = self.tuned.append(tokens, self.length - 1).final[:, -1]
            weight, out_bias = head.lm.output_embedding()
            logits, _ = head.gate(final, self._values(key, metric, head.retrieved),
                                  weight.float(), None if out_bias is None else out_bias.float(),
                                  logit_transform=head.lm.logit_transform)
            return torch.log_softmax(logits, -1)
        if isinstance(head, SegmentSpalm):
            assert self.segments is not None
            final = self.segments.append(tokens)
            values = self._values(key, metric, head.retrieved)[:, :head.k] \
                if head.k else None
            return torch.log_softmax(head.model.head(final, values)[0].float(), -1)
        raise NotServed(f"row {self.row.name!r} cannot be decoded here.")
