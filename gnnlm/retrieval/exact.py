"""Exact top-k search in torch: fast on a GPU, and the float32 search's neighbours whichever
screening finds them.

The exact neighbours of a query are defined in ``gnnlm.retrieval.exact_scores``: the k train
keys with the highest float32 similarity as ``pair_scores`` computes it, ties going to the lower
train position. ``ExactSearch`` finds them in four steps:

1. **Screen.** A matrix product of a block of queries by every key, one top-M per block
   (M = k + a margin). ``screen="float16"`` runs it on float16 inputs (tensor cores; CUDA's
   default), ``"float32"`` on float32 ones. Before its output is rounded, a screening score
   differs from the exact one by at most ε, a rounding-error bound computed for each query
   (``gnnlm.retrieval.screening_error``); a float16 output adds at most half the gap to the
   next float16.
2. **Re-score** the M candidates exactly (``pair_scores``) and order them by score, then by
   position.
3. **Certify.** A key left out screened at most t̃ (the M-th screening score), so its exact
   score is at most t̃ + half a float16 gap + ε. Where the k-th exact score among the
   candidates is above that, no key left out can enter the top k, or tie with it: the row is
   exact.
4. **Widen** the rows step 3 cannot settle (their k-th and M-th scores closer than ε, as in a
   datastore whose states crowd): the k-th exact score τ among the candidates is a lower bound
   of the true k-th, so every key of the true top k screens at least (τ − ε) rounded down.
   One more screening in the same precision collects every such key, and re-scoring them all
   gives the exact top k without a further bound (``_widened``). Only rows with more than
   ``WIDEST`` × M such keys go on: a float16 row to a float32 screening (ε about 20x smaller),
   steps 1-4 again; a float32 row to every key (``_exhaustive``, ties across the k-th place
   resolved by position).

Both screenings return the same ids and float32 scores, bit for bit; only the time differs. How
many rows were widened, screened again in float32 or scored against every key is counted in
``stats``. Squared L2 distances cancel too much for a float16 screening to bound usefully:
``l2`` always screens in float32.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch

from gnnlm.retrieval.exact_scores import (
    ROWS,
    ExactScores,
    negative_squared_distance,
    squared_norms,
)
from gnnlm.retrieval.screening_error import (
    KeyNorms,
    full_precision,
    half_products_accumulate_in_float32,
    next_down,
    next_up,
    screening_queries,
)
from gnnlm.utils.devices import free_memory, same_device, torch_device, why_not_resident
from gnnlm.utils.progress import say

SCREENS = ("auto", "float16", "float32")
CPU_SCORE_ELEMENTS = 1 << 24        # screening scores per step on the CPU (64 MB of float32)
GPU_SCORE_BYTES = 8 << 30           # at most this much GPU memory for screening scores
# and fewer scores than 2^31 per step: past it, CUDA's kernels (product, top-k, comparison,
# nonzero) index in 64 bits, a path far less used than the one the table's shapes can keep to
GPU_SCORE_ELEMENTS = (1 << 31) - 1
COUNT_ELEMENTS = 1 << 28            # mask entries a widening count converts at once (1 GB)
WIDEST = 16     # a widened row re-scores at most this many times M keys (else: the next step)


def resolve_screen(screen: str, metric: str, device: torch.device) -> str:
    """``auto``: float16 on CUDA (tensor cores), float32 on the CPU (no fast float16 products);
    l2 is always screened in float32."""
    if screen not in SCREENS:
        raise ValueError(f"screen must be one of {SCREENS} (got {screen!r}).")
    if metric == "l2":
        return "float32"
    if screen == "auto":
        return "float16" if device.type == "cuda" else "float32"
    return screen


def default_margin(k: int, screen: str) -> int:
    """Candidates screened beyond k: k more in float16 (its ε is ~1e-3 of the similarity's
    scale: on WikiText-2's features a margin of k/4 left ~30% of queries to widen, one of k
    ~15%), a thirty-second more in float32 (ε ~1e-5 at d = 128)."""
    return max(64, k) if screen == "float16" else max(16, k // 32)


class ExactSearch(ExactScores):
    """The exact top-k of queries among ``keys`` [N, d] under ``metric`` (module docstring).

    Args:
        keys: the train keys, a float16 memmap or array, or a tensor (on the search's device:
            resident there; elsewhere: read one chunk at a time).
        metric: ``cos``, ``ip`` or ``l2`` (higher is better; l2 is the negative squared
            distance).
        device: where the products run (``auto``: CUDA when there is one).
        screen: ``auto``, ``float16`` or ``float32`` (``resolve_screen``).
        chunk: keys per float32 screening step.
    """

    def __init__(self, keys: Any, metric: str, device: str | torch.device = "cpu",
                 screen: str = "auto", chunk: int = 65536):
        on = torch_device(device)
        self.screen = resolve_screen(screen, metric, on)
        if self.screen == "float16" and not half_products_accumulate_in_float32(
                on, int(keys.shape[1])):
            say(f"[gnnlm] exact search: float16 products on {on} are not summed in "
                f"float32, so their error cannot be bounded: screening in float32 instead")
            self.screen = "float32"
        if on.type == "cuda" and not (isinstance(keys, torch.Tensor)
                                      and same_device(keys.device, on)):  # not yet resident
            keys = self._to_gpu(keys, on)
        super().__init__(keys, metric, on, chunk)
        self.stats = {"queries": 0, "widened": 0, "rescreened": 0, "exhaustive": 0}
        self._table, self.norms = self._screening_table()

    # -- the keys ----------------------------------------------------------------------------
    def _to_gpu(self, keys: Any, device: torch.device) -> Any:
        """The keys resident on the GPU in their stored dtype (float16 for a datastore) when
        they and a float16 screening table fit in half its free memory; else the keys as
        given, streamed from the host one chunk per step, screened in float32 (said once)."""
        itemsize = keys.element_size() if isinstance(keys, torch.Tensor) else keys.dtype.itemsize
        nbytes = int(keys.shape[0]) * int(keys.shape[1]) * itemsize
        table = int(keys.shape[0]) * int(keys.shape[1]) * 2 if self.screen == "float16" else 0
        why_not = why_not_resident(device, nbytes + table)
        if why_not is None:
            if isinstance(keys, torch.Tensor):
                return keys.to(device)
            return torch.from_numpy(np.ascontiguousarray(keys)).to(device)
        say(f"[gnnlm] exact search: the train keys ({(nbytes + table) / 2**30:.1f} GiB with "
            f"the screening table) {why_not}: they stream from the host chunk by chunk, "
            f"screened in float32 (much slower)")
        self.screen = "float32"
        return keys

    def _screening_table(self) -> tuple[Optional[torch.Tensor], KeyNorms]:
        """``(table, norms)``: for a float16 screening the keys in float16 (unit rows for cos),
        from one more pass over them, and what ε needs of the keys."""
        squared_largest = float(self._k_sq.max()) if self._k_sq is not None else 0.0
        if self.screen != "float16":
            return None, KeyNorms(self.largest_norm, squared_largest)
        table, table_largest, table_error = [], 0.0, 0.0
        for start in range(0, self.n, self.chunk):
            rows = self._range(start, min(start + self.chunk, self.n))
            half = rows.half()
            if not torch.isfinite(half).all():
                raise ValueError("A key does not fit float16's range (|x| > 65504): "
                                 "search with screen='float32'.")
            table.append(half)
            table_largest = max(table_largest, float(
                torch.linalg.vector_norm(half.double(), dim=1).max()))
            table_error = max(table_error, float(
                torch.linalg.vector_norm(half.double() - rows.double(), dim=1).max()))
        return (torch.cat(table) if table else None,
                KeyNorms(self.largest_norm, squared_largest, table_largest, table_error))

    # -- screening -----------------------------------------------------------------------------
    def _screening_queries(self, q: torch.Tensor, screen: str
                           ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(queries as screened, ε, scale)`` (``screening_error.screening_queries``)."""
        return screening_queries(q, screen, self.metric, self.norms)

    def _products(self, qs: torch.Tensor, screen: str, wanted: Optional[torch.Tensor] = None
                  ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The screening scores of queries ``qs`` (as ``_screening_queries`` gives them) with
        every key, one step at a time: ``(first query row, first key, scores [r, c])``. Each
        step's scores live in one buffer, overwritten by the next step. A block of rows that
        ``wanted`` [b] (which the caller may clear as it goes) no longer marks is skipped."""
        b = qs.shape[0]
        table = self._table if screen == "float16" else None
        span, rows = self._steps(b, qs.element_size(), table is not None)
        q_sq = squared_norms(qs) if self.metric == "l2" else None  # l2: float32, qs is q
        # one score buffer for every step: a fresh one per step (first-touched) cost ~30% on CPU
        buffer = qs.new_empty(min(rows, b) * span)
        for start in range(0, self.n, span):
            stop = min(start + span, self.n)
            kc = table[start:stop] if table is not None else self._range(start, stop)
            for r0 in range(0, b, rows):
                r = min(rows, b - r0)
                if wanted is not None and not bool(wanted[r0:r0 + r].any()):
                    continue
                s = torch.mm(qs[r0:r0 + r], kc.T, out=buffer[:r * (stop - start)].view(
                    r, stop - start))                                       # [r, c]
                if q_sq is not None and self._k_sq is not None:  # as pair_scores computes it
                    negative_squared_distance(s, q_sq[r0:r0 + r, None],
                                               self._k_sq[None, start:stop])
                yield r0, start, s

    def _screen(self, q: torch.Tensor, width: int, screen: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [b, width], bound [b], ε [b])``: ``width`` keys with the highest screening
        scores in precision ``screen`` (in no order); every key left out has an exact score
        of at most ``bound + ε`` (float64, in the exact scores' units)."""
        qs, eps, scale = self._screening_queries(q, screen)
        best: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for r0, start, s in self._products(qs, screen):
            top_s, top_i = s.topk(min(width, s.shape[1]), dim=1, sorted=False)
            if r0 in best:
                top_s, top_i = torch.cat([best[r0][0], top_s], 1), torch.cat(
                    [best[r0][1], top_i + start], 1)
                if top_s.shape[1] > width:
                    top_s, pos = top_s.topk(width, dim=1, sorted=False)
                    top_i = top_i.gather(1, pos)
            else:
                top_i = top_i + start
            best[r0] = (top_s, top_i)
        ids = torch.cat([best[r0][1] for r0 in sorted(best)])
        floor = torch.cat([best[r0][0] for r0 in sorted(best)]).min(dim=1).values
        if screen == "float16":  # a score that rounded to at most t̃ was below t̃'s next float16
            floor = floor.double() + (next_up(floor).double() - floor.double()) / 2
        return ids, floor.double() / scale, eps

    def _widened(self, q: torch.Tensor, kth: torch.Tensor, width: int, screen: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4 of the module docstring: ``(ids [b, m], valid [b, m])``, every key whose
        screening score could reach its row's ``kth`` [b] exact score (sorted by id; ``valid``
        marks them, the rest is padding), for rows with at most ``WIDEST * width`` such keys;
        other rows have no valid entry."""
        b = q.shape[0]
        qs, eps, scale = self._screening_queries(q, screen)
        # the least screening score (after its output rounding) of a key scoring kth or more
        least = ((kth.double() - eps) * scale).to(qs.dtype)
        least = torch.where(least.double() > (kth.double() - eps) * scale, next_down(least),
                            least)
        cap = WIDEST * width
        count = torch.zeros(b, dtype=torch.int64, device=self.device)
        keep = torch.ones(b, dtype=torch.bool, device=self.device)  # rows still under the cap
        rows, ids = [], []
        for r0, start, s in self._products(qs, screen, wanted=keep):
            hit = s >= least[r0:r0 + s.shape[0], None]
            # a bool sum on the host is twice as slow as the same bytes summed as uint8; a sum
            # to int32 first copies its input as int32 (over every key of a GPU step, twice the
            # float16 scores' memory), so it is summed a slice of columns at a time
            cols = max(1, COUNT_ELEMENTS // max(1, s.shape[0]))
            for c0 in range(0, hit.shape[1], cols):
                count[r0:r0 + s.shape[0]] += hit[:, c0:c0 + cols].view(torch.uint8).sum(
                    1, dtype=torch.int32)
            keep[r0:r0 + s.shape[0]] = count[r0:r0 + s.shape[0]] <= cap
            hit &= keep[r0:r0 + s.shape[0], None]  # a row over the cap: the next step settles it
            r, c = hit.nonzero(as_tuple=True)
            rows.append(r + r0)
            ids.append(c + start)
        row, idx = torch.cat(rows), torch.cat(ids)
        row, idx = row[keep[row]], idx[keep[row]]
        order = (row * self.n + idx).argsort()                             # by row, then id
        row, idx = row[order], idx[order]
        per_row = torch.bincount(row, minlength=b)
        first = torch.cumsum(per_row, 0) - per_row
        width_out = max(int(per_row.max()), 1)
        col = torch.arange(len(row), device=self.device) - first[row]
        cand = torch.zeros((b, width_out), dtype=torch.int64, device=self.device)
        valid = torch.zeros((b, width_out), dtype=torch.bool, device=self.device)
        cand[row, col], valid[row, col] = idx, True
        return cand, valid

    def _steps(self, b: int, itemsize: int, resident_table: bool) -> tuple[int, int]:
        """``(keys, queries)`` per screening product. On the CPU 2^24 scores (64 MB) over
        ``chunk`` keys; on CUDA a score budget of a quarter of free memory (at most 8 GiB, and
        under 2^31 scores), spent on every key at once (one top-k per block of queries) for as
        many queries as fit, up to 2,048, when the float16 table is resident, else on ``chunk``
        keys."""
        span = min(self.chunk, self.n)
        if self.device.type != "cuda":
            return span, max(ROWS, min(b, CPU_SCORE_ELEMENTS // span))
        free = free_memory(self.device) or 0
        budget = min(GPU_SCORE_BYTES // itemsize, free // 4 // itemsize, GPU_SCORE_ELEMENTS)
        if resident_table:
            block = max(ROWS, min(b, 2048, budget // self.n))
            span = max(span, min(self.n, budget // block))
        return span, max(ROWS, min(b, budget // span))

    # -- the search ----------------------------------------------------------------------------
    def _ordered(self, q: torch.Tensor, cand: torch.Tensor, k: int,
                 valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best of candidate ids [b, m] by exact score, ties to the lower id:
        ``(scores, ids)``; entries not ``valid`` never count."""
        scores = self._rescore(q, cand)
        if valid is not None:
            scores = scores.masked_fill(~valid, -math.inf)
        cand, perm = cand.sort(dim=1)                                      # ids ascending
        scores = scores.gather(1, perm)
        top_s, pos = scores.sort(dim=1, descending=True, stable=True)      # ties keep id order
        return top_s[:, :k], cand.gather(1, pos[:, :k])

    def _certified(self, q: torch.Tensor, k: int, width: int, screen: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-4 of the module docstring in ``screen`` precision: ``(scores, ids, exact)``,
        ``exact`` marking the rows they settled."""
        cand, bound, eps = self._screen(q, width, screen)
        top_s, top_i = self._ordered(q, cand, k)
        if width >= self.n:  # every key was a candidate
            return top_s, top_i, torch.ones(len(q), dtype=torch.bool, device=self.device)
        exact = top_s[:, -1].double() > bound + eps
        crowded = torch.nonzero(~exact).flatten()
        if len(crowded):
            cand, valid = self._widened(q[crowded], top_s[crowded, -1], width, screen)
            settled = valid.sum(1) >= k     # the k candidates are among them unless over cap
            rows = crowded[settled]
            if len(rows):
                top_s[rows], top_i[rows] = self._ordered(q[rows], cand[settled], k,
                                                         valid[settled])
                exact[rows] = True
                self.stats["widened"] += len(rows)
        return top_s, top_i, exact

    def search(self, queries: Any, k: int, margin: Optional[int] = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(sims float32 [n, k], ids int64 [n, k])``, best first; beyond the datastore's
        size, id -1 and similarity -inf."""
        sims, ids = self.search_tensors(queries, k, margin)
        return sims.cpu().numpy(), ids.cpu().numpy()

    @torch.no_grad()
    def search_tensors(self, queries: Any, k: int, margin: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``search``'s result on the search's device, for work that continues there (the
        neighbours' leakage mask)."""
        if k < 1:
            raise ValueError(f"k must be >= 1 (got {k}).")
        q = self._queries(queries)
        n, kk = q.shape[0], min(k, self.n)
        sims = torch.full((n, k), -math.inf, device=self.device)
        ids = torch.full((n, k), -1, dtype=torch.int64, device=self.device)
        if n == 0:
            return sims, ids
        width = min(self.n, kk + (default_margin(kk, self.screen) if margin is None
                                  else int(margin)))
        with full_precision():
            top_s, top_i, exact = self._certified(q, kk, width, self.screen)
            todo = torch.nonzero(~exact).flatten()
            self.stats["queries"] += n
            if len(todo) and self.screen == "float16":
                # a float32 screening (ε ~20x smaller) for rows float16 could not settle
                self.stats["rescreened"] += len(todo)
                s, i, ok = self._certified(q[todo], kk, min(self.n, kk + max(64, kk // 4)),
                                           "float32")
                top_s[todo], top_i[todo] = s, i
                todo = todo[~ok]
            if len(todo):
                self.stats["exhaustive"] += len(todo)
                top_s[todo], top_i[todo] = self._exhaustive(q[todo], kk)
        sims[:, :kk] = top_s
        ids[:, :kk] = top_i
        return sims, ids
