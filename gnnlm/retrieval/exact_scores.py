"""The exact score of a query and a train key, defined once, and the exact neighbours it
defines.

A query's exact neighbours are the k train keys with the highest float32 similarity as
``ExactScores.pair_scores`` computes it, ties going to the lower train position. Every score
comes out of a matrix product of one shape, 32 query rows by 4,096 key columns, zero-padded: a
score does not depend on which other queries or keys were scored beside it. On a GPU four such
tiles go through one batched product; on the CPU one product per tile gives the bits of one
large product. (A GPU's float32 products and a CPU's may round a score's last bit otherwise, so
keys within that of each other may order otherwise from one device to the other.)

``ExactScores`` holds the keys, reads them as the scores do (float32 on the device, unit rows
for cos), scores candidates (``_rescore``), and finds the neighbours by the definition itself,
every key scored (``_exhaustive``). ``gnnlm.retrieval.exact.ExactSearch`` finds the same
neighbours fast.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.retrieval.settings import check_metric
from gnnlm.utils.devices import torch_device

ROWS = 32       # query rows of every re-scoring product: below ~8 rows the CPU sums otherwise
COLS = 4096     # key columns of every re-scoring product
TILE_BATCH = 4                      # tiles per batched product of the exact scores
RESCORE_BYTES = 1 << 30             # float32 keys one batched re-scoring step reads (a GPU)


def _host_rows(rows: np.ndarray) -> torch.Tensor:
    """Rows of a numpy array (a slice of a datastore's read-only float16 memmap, or rows
    gathered from it) as a tensor for torch to convert: numpy's float16 conversion is several
    times slower, and both are exact. A read-only view is copied (torch takes writable memory)."""
    rows = np.ascontiguousarray(rows)
    return torch.from_numpy(rows if rows.flags.writeable else rows.copy())


def _row_by_row(reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
                ) -> torch.Tensor:
    """``reduce(x)`` for rows ``x`` [r, d] whose row-wise sums must not depend on r. CUDA sums
    fewer than 16 rows with more threads to a row than 16 or more, i.e. in another order: a key
    or query read with few others (the last of a split, a prompt, a widened row) would round
    otherwise than in a full block. Fewer than ``ROWS`` rows are zero-padded to ``ROWS``."""
    r = x.shape[0]
    if r >= ROWS:
        return reduce(x)
    return reduce(torch.cat([x, x.new_zeros(ROWS - r, *x.shape[1:])]))[:r]


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [r, d] scaled to unit length, as cos reads keys and queries."""
    return _row_by_row(lambda t: F.normalize(t, dim=1, eps=1e-12), x)


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """|x|² [r] of rows ``x`` [r, d], as l2 reads them."""
    return _row_by_row(lambda t: (t * t).sum(1), x)


def negative_squared_distance(products: torch.Tensor, q_sq: torch.Tensor,
                               k_sq: torch.Tensor) -> torch.Tensor:
    """-|q - k|² = 2 q·k - |q|² - |k|² from the products, in place (``q_sq`` and ``k_sq``
    broadcast against them), as exact_search always computed it; clamped: rounding must not
    make a distance negative."""
    return products.mul_(2).sub_(q_sq).sub_(k_sq).clamp_(max=0.0)


def _best(scores: torch.Tensor, ids: torch.Tensor, k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of ``scores`` [r, W] whose columns are the keys ``ids`` [W] (ascending), ties
    to the lower id: ``(scores [r, k], ids [r, k])``, best first. One top-k, then only the
    keys tied with the k-th are told apart, by position."""
    k = min(k, scores.shape[1])
    kth = scores.topk(k, dim=1).values[:, -1:]                         # [r, 1]
    above, tied = scores > kth, scores == kth
    room = k - above.sum(1, keepdim=True)                              # tied keys that fit
    crowded = (tied.sum(1, keepdim=True) > room).flatten()             # more ties than room
    keep = above | tied
    if crowded.any():  # there, the first ties by position only
        keep[crowded] = above[crowded] | (tied[crowded] & (tied[crowded].cumsum(1)
                                                           <= room[crowded]))
    rows, cols = keep.nonzero(as_tuple=True)                           # ids ascending per row
    best_s, best_i = scores[rows, cols].view(-1, k), ids[cols].view(-1, k)
    best_s, order = best_s.sort(dim=1, descending=True, stable=True)
    return best_s, best_i.gather(1, order)


def _merged(s1: torch.Tensor, i1: torch.Tensor, s2: torch.Tensor, i2: torch.Tensor, k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of two candidate lists [r, *] (scores, ids), ties to the lower id."""
    s, i = torch.cat([s1, s2], dim=1), torch.cat([i1, i2], dim=1)
    i, by_id = i.sort(dim=1)
    s, order = s.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    return s[:, :k], i.gather(1, order[:, :k])


class ExactScores:
    """The exact scores of queries and ``keys`` [N, d] under ``metric`` (module docstring).

    Args:
        keys: the train keys, a float16 memmap or array, or a tensor (on ``device``: resident
            there; elsewhere: read one chunk at a time).
        metric: ``cos``, ``ip`` or ``l2`` (higher is better; l2 is the negative squared
            distance).
        device: where the products run (``auto``: CUDA when there is one).
        chunk: keys per step of a pass over every key.

    One pass over the keys at construction keeps their largest norm (``largest_norm``: what a
    bound on a score's rounding reads) and, for l2, every key's |k|².
    """

    def __init__(self, keys: Any, metric: str, device: str | torch.device = "cpu",
                 chunk: int = 65536):
        check_metric(metric)
        self.keys, self.metric, self.chunk = keys, metric, int(chunk)
        self.device = torch_device(device)
        self.n, self.d = int(keys.shape[0]), int(keys.shape[1])
        # exact scores in batched products on a GPU, where each small product is a launch
        # and a loop over groups waits for the device; one product per tile on the host
        self.batched = self.device.type == "cuda"
        self._k_sq: Optional[torch.Tensor] = None     # float32 |k|² (l2)
        self.largest_norm = 0.0
        k_sq = []
        for start in range(0, self.n, self.chunk):
            rows = self._range(start, min(start + self.chunk, self.n))
            self.largest_norm = max(self.largest_norm, float(
                torch.linalg.vector_norm(rows.double(), dim=1).max()))
            if self.metric == "l2":
                k_sq.append(squared_norms(rows))
        if k_sq:
            self._k_sq = torch.cat(k_sq)

    # -- the keys as the scores read them ----------------------------------------------------
    def _range(self, start: int, stop: int) -> torch.Tensor:
        """Keys [start, stop) as the exact scores read them: float32 on the device, unit rows
        for cos."""
        if isinstance(self.keys, torch.Tensor):
            rows = self.keys[start:stop].to(device=self.device, dtype=torch.float32)
        else:
            rows = _host_rows(self.keys[start:stop]).to(self.device, torch.float32)
        return unit_rows(rows) if self.metric == "cos" else rows

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Keys at ``ids`` (sorted, on the device) as ``_range`` gives them."""
        if isinstance(self.keys, torch.Tensor):
            rows = self.keys.index_select(0, ids.to(self.keys.device)).to(
                device=self.device, dtype=torch.float32)
        else:
            rows = _host_rows(self.keys[ids.cpu().numpy()]).to(self.device, torch.float32)
        return unit_rows(rows) if self.metric == "cos" else rows

    # -- the exact scores ----------------------------------------------------------------------
    def _queries(self, queries: Any) -> torch.Tensor:
        if isinstance(queries, torch.Tensor):
            q = queries.detach().to(device=self.device, dtype=torch.float32)
        else:
            array = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
            q = torch.from_numpy(array).to(self.device)
        if q.ndim != 2 or q.shape[1] != self.d:
            raise ValueError(f"queries must be [n, {self.d}] like the keys "
                             f"(got {tuple(q.shape)}).")
        return unit_rows(q) if self.metric == "cos" else q

    def _tile_products(self, q_tiles: torch.Tensor, key_tiles: torch.Tensor) -> torch.Tensor:
        """``[n, 32, 4096]`` float32 products of query tiles ``q_tiles`` [n, 32, d] and key
        tiles ``key_tiles`` [n, 4096, d]: every exact score comes out of a product of one
        shape. Batched (``self.batched``: on a GPU), ``TILE_BATCH`` tiles per ``bmm``, the last
        call zero-padded; otherwise one ``mm`` per tile (on a CPU the same bits, and those of
        one large product)."""
        n = q_tiles.shape[0]
        out = torch.empty((n, ROWS, COLS), dtype=torch.float32, device=self.device)
        if not self.batched:
            for t in range(n):
                torch.mm(q_tiles[t], key_tiles[t].T, out=out[t])
            return out
        for t0 in range(0, n, TILE_BATCH):
            a = q_tiles[t0:t0 + TILE_BATCH].contiguous()
            b = key_tiles[t0:t0 + TILE_BATCH]
            m = a.shape[0]
            if m < TILE_BATCH:
                a = torch.cat([a, a.new_zeros(TILE_BATCH - m, ROWS, self.d)])
                b = torch.cat([b, b.new_zeros(TILE_BATCH - m, COLS, self.d)])
            out[t0:t0 + m] = torch.bmm(a, b.transpose(1, 2))[:m]
        return out

    def pair_scores(self, q: torch.Tensor, keys: torch.Tensor,
                    k_sq: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Exact float32 scores [r, u] of query rows ``q`` [r <= 32, d] and prepared key rows
        ``keys`` [u, d] (``k_sq`` [u]: their |k|² for l2), each from a [32, d] x [d, 4096]
        tile, zero-padded (``_tile_products``): a score does not depend on which other queries
        or keys were scored beside it."""
        r, u = q.shape[0], keys.shape[0]
        padded = q.new_zeros(ROWS, self.d)
        padded[:r] = q
        tiles = -(-u // COLS)
        if u % COLS:  # the last tile zero-padded to the full shape
            keys = torch.cat([keys, keys.new_zeros(tiles * COLS - u, self.d)])
        scores = self._tile_products(padded.expand(tiles, ROWS, self.d),
                                     keys.view(tiles, COLS, self.d))       # [tiles, 32, 4096]
        scores = scores.transpose(0, 1).reshape(ROWS, tiles * COLS)[:r, :u]
        if self.metric == "l2" and k_sq is not None:
            scores = negative_squared_distance(scores, squared_norms(q)[:, None], k_sq[None])
        return scores

    def _rescore(self, q: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """Exact scores [b, M] of queries ``q`` [b, d] and their candidate ids ``cand`` [b, M],
        as ``pair_scores`` gives them: the keys of each group of 32 queries are read once, as
        the union of their candidates."""
        if self.batched:
            return self._rescore_batched(q, cand)
        out = torch.empty(cand.shape, dtype=torch.float32, device=self.device)
        for g0 in range(0, q.shape[0], ROWS):
            group = cand[g0:g0 + ROWS]
            union, inverse = torch.unique(group, return_inverse=True)      # sorted
            k_sq = None if self._k_sq is None else self._k_sq[union]
            scores = self.pair_scores(q[g0:g0 + ROWS], self._rows(union), k_sq)  # [r, u]
            out[g0:g0 + ROWS] = scores.gather(1, inverse)
        return out

    def _rescore_batched(self, q: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """``_rescore`` for a GPU: the tiles of many groups go through the batched product
        together, with one host-device sync per call (for the unions' sizes) where the loop
        waited on each group's ``torch.unique``; the unions' padding is gathered too (key 0,
        never read), as masking it out would wait for the device again."""
        b, m = cand.shape
        groups = -(-b // ROWS)
        if groups * ROWS > b:  # the last group padded with copies of the first row
            q = torch.cat([q, q[:1].expand(groups * ROWS - b, self.d)])
            cand = torch.cat([cand, cand[:1].expand(groups * ROWS - b, m)])
        ids, order = cand.reshape(groups, ROWS * m).sort(dim=1)            # [G, 32·M]
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        slot = new.cumsum(1) - 1                            # each sorted id's place in its union
        tiles = [-(-int(size) // COLS) for size in (slot[:, -1] + 1).tolist()]  # the one sync
        union = torch.zeros((groups, max(tiles) * COLS), dtype=ids.dtype, device=self.device)
        union.scatter_(1, slot, ids)
        where = torch.empty_like(slot).scatter_(1, order, slot).view(groups, ROWS, m)
        out = torch.empty((groups, ROWS, m), dtype=torch.float32, device=self.device)
        budget = max(1, RESCORE_BYTES // (COLS * self.d * 4))   # in tiles of float32 keys
        g0 = 0
        while g0 < groups:  # a step: groups whose keys, at the widest union among them, fit
            g, t = 1, tiles[g0]
            while g0 + g < groups and (g + 1) * max(t, tiles[g0 + g]) <= budget:
                t = max(t, tiles[g0 + g])
                g += 1
            keys = self._rows(union[g0:g0 + g, :t * COLS].flatten()).view(g * t, COLS, self.d)
            qs = q[g0 * ROWS:(g0 + g) * ROWS].view(g, 1, ROWS, self.d).expand(
                g, t, ROWS, self.d).reshape(g * t, ROWS, self.d)
            scores = self._tile_products(qs, keys).view(g, t, ROWS, COLS).transpose(
                1, 2).reshape(g, ROWS, t * COLS)                           # [g, 32, union]
            if self.metric == "l2" and self._k_sq is not None:   # as pair_scores computes it
                rows = q[g0 * ROWS:(g0 + g) * ROWS]
                scores = negative_squared_distance(
                    scores, squared_norms(rows).view(g, ROWS, 1),
                    self._k_sq[union[g0:g0 + g, :t * COLS]].view(g, 1, -1))
            out[g0:g0 + g] = scores.gather(2, where[g0:g0 + g])
            g0 += g
        return out.view(groups * ROWS, m)[:b]

    def _exhaustive(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The definition itself: every key re-scored, the k best kept, ties to the lower id.
        Each chunk of keys is read once for every group of 32 queries."""
        groups = [q[g0:g0 + ROWS] for g0 in range(0, q.shape[0], ROWS)]
        best = [(torch.empty((len(g), 0), device=self.device),
                 torch.empty((len(g), 0), dtype=torch.int64, device=self.device)) for g in groups]
        for start in range(0, self.n, self.chunk):
            stop = min(start + self.chunk, self.n)
            keys, ids = self._range(start, stop), torch.arange(start, stop, device=self.device)
            k_sq = None if self._k_sq is None else self._k_sq[start:stop]
            for j, group in enumerate(groups):
                s, i = _best(self.pair_scores(group, keys, k_sq), ids, k)
                best[j] = _merged(*best[j], s, i, k)
        return torch.cat([s for s, _ in best]), torch.cat([i for _, i in best])
