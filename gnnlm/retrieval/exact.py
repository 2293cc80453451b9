"""Exact top-k search in torch: fast on a GPU, and the float32 search's neighbours whichever
screening finds them.

The exact neighbours of a query are defined once, here: the k train keys with the highest
float32 similarity as ``ExactSearch.pair_scores`` computes it (a matrix product of 32 query rows
by 4,096 key columns, so every score comes out of a product of one shape: on a GPU four such
tiles per batched product; on the CPU the bits of one large product), ties going to the lower
train position. (A GPU's float32 products and a CPU's may round a score's last bit otherwise,
so keys within that of each other may order otherwise from one device to the other.)
``ExactSearch`` finds them in four steps:

1. **Screen.** A matrix product of a block of queries by every key, one top-M per block
   (M = k + a margin). ``screen="float16"`` runs it on float16 inputs (tensor cores; CUDA's
   default), ``"float32"`` on float32 ones. Before its output is rounded, a screening score
   differs from the exact one by at most ε, a rounding-error bound computed for each query
   (``_screening_queries``: the inputs' rounding to float16, float32 accumulation of d
   products on tensor cores, 3γ_d (``TENSOR_CORE_GAMMAS``: their adders truncate, where
   Higham's γ_d = d·u/(1 − d·u) bounds an IEEE sum), and the exact score's own γ_d); a
   float16 output adds at most half the gap to the next float16.
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
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import torch
from torch.nn import functional as F

from gnnlm.retrieval.settings import check_metric
from gnnlm.utils.devices import torch_device, why_not_resident
from gnnlm.utils.progress import say

SCREENS = ("auto", "float16", "float32")
ROWS = 32       # query rows of every re-scoring product: below ~8 rows the CPU sums otherwise
COLS = 4096     # key columns of every re-scoring product
U16, U32 = 2.0 ** -11, 2.0 ** -24   # unit round-off of float16 and float32
F16_SUBNORMAL = 2.0 ** -25          # float16's absolute rounding error below its normal range
SAFETY = 1.01   # on the error bound (a worst case already): its own float64 arithmetic
CPU_SCORE_ELEMENTS = 1 << 24        # screening scores per step on the CPU (64 MB of float32)
GPU_SCORE_BYTES = 8 << 30           # at most this much GPU memory for screening scores
COUNT_ELEMENTS = 1 << 28            # mask entries a widening count converts at once (1 GB)
TILE_BATCH = 4                      # tiles per batched product of the exact scores
RESCORE_BYTES = 1 << 30             # float32 keys one batched re-scoring step reads (a GPU)
WIDEST = 16     # a widened row re-scores at most this many times M keys (else: the next step)
# float16 products summed in float32 on NVIDIA's tensor cores: a block of n >= 4 products and
# the running sum are added at once, every term aligned to the largest one with the bits below
# its last place dropped, and the sum truncated to float32 (Fasi, Higham, Mikaitis & Pranesh,
# "Numerical behavior of NVIDIA tensor cores", 2021). With S = Σ|q_i k_i|, a block errs by
# less than (n + 1)·2^-23·S (what each term but the largest loses, and the sum's truncation),
# where an IEEE sum errs by up to 2^-24·S per product: over d products at most 2(1 + 1/n)
# <= 2.5 times γ_d·S; a split-K kernel's float32 sums of partial products add under 0.5 γ_d
TENSOR_CORE_GAMMAS = 3.0


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


def _gamma(d: int, u: float) -> float:
    return d * u / (1 - d * u)


@contextmanager
def full_precision() -> Iterator[None]:
    """float32 products in float32 (no TF32, which a Lightning run may have switched on) and
    float16 products accumulated in float32 (cuBLAS may otherwise reduce in float16)."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = saved


def half_products_accumulate_in_float32(device: torch.device, d: int, seed: int = 0) -> bool:
    """Whether float16 matrix products on ``device`` stay within the error of float32
    accumulation on tensor cores (``TENSOR_CORE_GAMMAS``·γ_d, the bound the float16 screening
    rests on), tried on d-dimensional rows whose products are positive in the first half and
    negative in the second: their partial sums grow to about d/3 and cancel, so a float16
    accumulator's errors stand out from the small result's own rounding (summed pairwise in
    float16 they exceed the bound 5.6 times at d = 512 and 44 times at d = 64, where random
    rows' exceed it 1.2 and 14 times; float32 sums stay under a hundredth of it)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(ROWS, d, generator=gen).abs().half()
    b = torch.randn(256, d, generator=gen).abs()
    b[:, d // 2:] *= -1
    b = b.half()
    with full_precision():
        s = torch.mm(a.to(device), b.to(device).T).cpu().double()
    exact = a.double() @ b.double().T
    product = (torch.linalg.vector_norm(a.double(), dim=1)[:, None]
               * torch.linalg.vector_norm(b.double(), dim=1)[None])
    gamma = TENSOR_CORE_GAMMAS * _gamma(d, U32)
    # the output's rounding is of the score itself: a float16 sum's errors are of its partials
    bound = gamma * product + U16 * (exact.abs() + gamma * product) + F16_SUBNORMAL
    return bool(((s - exact).abs() <= bound).all())


def _next_up(t: torch.Tensor) -> torch.Tensor:
    """The next float16 above each finite float16 of ``t``, from its bits (older torch releases
    have no float16 ``nextafter`` on CUDA)."""
    bits = t.view(torch.int16).to(torch.int32)
    up = torch.where(t == 0, torch.ones_like(bits), torch.where(bits >= 0, bits + 1, bits - 1))
    return up.to(torch.int16).view(torch.float16)


def _next_down(t: torch.Tensor) -> torch.Tensor:
    """The next float16 or float32 below each finite value of ``t``."""
    if t.dtype == torch.float32:
        return torch.nextafter(t, torch.full_like(t, -math.inf))
    return -_next_up(-t)


def _host_rows(rows: np.ndarray) -> torch.Tensor:
    """Rows of a numpy array (a slice of a datastore's read-only float16 memmap, or rows
    gathered from it) as a tensor for torch to convert: numpy's float16 conversion is several
    times slower, and both are exact. A read-only view is copied (torch takes writable memory)."""
    rows = np.ascontiguousarray(rows)
    return torch.from_numpy(rows if rows.flags.writeable else rows.copy())


def _negative_squared_distance(products: torch.Tensor, q_sq: torch.Tensor,
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


class ExactSearch:
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
        check_metric(metric)
        self.keys, self.metric, self.chunk = keys, metric, int(chunk)
        self.device = torch_device(device)
        self.n, self.d = int(keys.shape[0]), int(keys.shape[1])
        self.screen = resolve_screen(screen, metric, self.device)
        if self.screen == "float16" and not half_products_accumulate_in_float32(self.device,
                                                                                self.d):
            say(f"[gnnlm] exact search: float16 products on {self.device} are not summed in "
                f"float32, so their error cannot be bounded: screening in float32 instead")
            self.screen = "float32"
        self.stats = {"queries": 0, "widened": 0, "rescreened": 0, "exhaustive": 0}
        # exact scores in batched products on a GPU, where each small product is a launch
        # and a loop over groups waits for the device; one product per tile on the host
        self.batched = self.device.type == "cuda"
        if self.device.type == "cuda" and not (isinstance(keys, torch.Tensor)
                                               and keys.device == self.device):
            self.keys = self._to_gpu(keys)
        self._table: Optional[torch.Tensor] = None    # float16 screening keys (float16 screen)
        self._k_sq: Optional[torch.Tensor] = None     # float32 |k|² (l2)
        self._key_norm = self._table_norm = self._table_error = 0.0
        self._prepare()

    # -- the keys ----------------------------------------------------------------------------
    def _to_gpu(self, keys: Any) -> Any:
        """The keys resident on the GPU in their stored dtype (float16 for a datastore) when
        they and a float16 screening table fit in half its free memory; else the keys as
        given, streamed from the host one chunk per step, screened in float32 (said once)."""
        itemsize = keys.element_size() if isinstance(keys, torch.Tensor) else keys.dtype.itemsize
        nbytes = int(keys.shape[0]) * int(keys.shape[1]) * itemsize
        table = int(keys.shape[0]) * int(keys.shape[1]) * 2 if self.screen == "float16" else 0
        why_not = why_not_resident(self.device, nbytes + table)
        if why_not is None:
            if isinstance(keys, torch.Tensor):
                return keys.to(self.device)
            return torch.from_numpy(np.ascontiguousarray(keys)).to(self.device)
        say(f"[gnnlm] exact search: the train keys ({(nbytes + table) / 2**30:.1f} GiB with "
            f"the screening table) {why_not}: they stream from the host chunk by chunk, "
            f"screened in float32 (much slower)")
        self.screen = "float32"
        return keys

    # -- the keys as the scores read them ----------------------------------------------------
    def _range(self, start: int, stop: int) -> torch.Tensor:
        """Keys [start, stop) as the exact scores read them: float32 on the device, unit rows
        for cos."""
        if isinstance(self.keys, torch.Tensor):
            rows = self.keys[start:stop].to(device=self.device, dtype=torch.float32)
        else:
            rows = _host_rows(self.keys[start:stop]).to(self.device, torch.float32)
        return F.normalize(rows, dim=1, eps=1e-12) if self.metric == "cos" else rows

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Keys at ``ids`` (sorted, on the device) as ``_range`` gives them."""
        if isinstance(self.keys, torch.Tensor):
            rows = self.keys.index_select(0, ids.to(self.keys.device)).to(
                device=self.device, dtype=torch.float32)
        else:
            rows = _host_rows(self.keys[ids.cpu().numpy()]).to(self.device, torch.float32)
        return F.normalize(rows, dim=1, eps=1e-12) if self.metric == "cos" else rows

    def _prepare(self) -> None:
        """One pass over the keys: the largest key norm (for ε), |k|² for l2, and for a float16
        screening its table (unit rows in float16 for cos), with its largest rounding error."""
        table, k_sq = [], []
        for start in range(0, self.n, self.chunk):
            rows = self._range(start, min(start + self.chunk, self.n))
            norms = torch.linalg.vector_norm(rows.double(), dim=1)
            self._key_norm = max(self._key_norm, float(norms.max()))
            if self.metric == "l2":
                k_sq.append((rows * rows).sum(1))
            if self.screen == "float16":
                half = rows.half()
                if not torch.isfinite(half).all():
                    raise ValueError("A key does not fit float16's range (|x| > 65504): "
                                     "search with screen='float32'.")
                table.append(half)
                self._table_norm = max(self._table_norm, float(
                    torch.linalg.vector_norm(half.double(), dim=1).max()))
                self._table_error = max(self._table_error, float(
                    torch.linalg.vector_norm(half.double() - rows.double(), dim=1).max()))
        if k_sq:
            self._k_sq = torch.cat(k_sq)
        if table:
            self._table = torch.cat(table)

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
        return F.normalize(q, dim=1, eps=1e-12) if self.metric == "cos" else q

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
            scores = _negative_squared_distance(scores, (q * q).sum(1)[:, None], k_sq[None])
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
                scores = _negative_squared_distance(
                    scores, (rows * rows).sum(1).view(g, ROWS, 1),
                    self._k_sq[union[g0:g0 + g, :t * COLS]].view(g, 1, -1))
            out[g0:g0 + g] = scores.gather(2, where[g0:g0 + g])
            g0 += g
        return out.view(groups * ROWS, m)[:b]

    # -- screening -----------------------------------------------------------------------------
    def _screening_queries(self, q: torch.Tensor, screen: str
                           ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(queries as screened [b, d], ε [b] float64, scale)``: ε bounds |v / scale − s|, a
        screening score before its output rounding against the exact one, for every key
        (module docstring). A float16 screening scales the queries by a power of two (exact)
        that keeps every score inside float16's range, then rounds them."""
        gamma = _gamma(self.d, U32)
        q_norm = torch.linalg.vector_norm(q.double(), dim=1)              # [b]
        if screen == "float32":  # the same inputs; two float32 sums in any order
            eps = 2 * gamma * q_norm * self._key_norm
            if self.metric == "l2":   # and the two subtractions of -|q - k|², on both sides
                k_sq_max = float(self._k_sq.max()) if self._k_sq is not None else 0.0
                eps = 2 * eps + 4 * U32 * (1 + gamma) * (
                    2 * q_norm * self._key_norm + q_norm ** 2 + k_sq_max)
            return q, SAFETY * eps, 1.0
        largest = float(q_norm.max()) * self._table_norm * (1 + U16)
        exponent = math.ceil(math.log2(largest / 2 ** 14)) if largest > 2 ** 14 else 0
        scale = 2.0 ** -exponent
        q_scaled = q * scale
        q16 = q_scaled.half()
        q16_norm = torch.linalg.vector_norm(q16.double(), dim=1)
        q_error = torch.linalg.vector_norm(q16.double() - q_scaled.double(), dim=1)
        scaled_norm = q_norm * scale
        product = q16_norm * self._table_norm                              # >= |q16 · k16|
        eps = (q_error * self._table_norm                     # the queries' rounding
               + scaled_norm * self._table_error              # the keys' rounding
               + TENSOR_CORE_GAMMAS * gamma * product         # float32 accumulation
               + gamma * scaled_norm * self._key_norm)        # the exact score's own rounding
        return q16, SAFETY * eps / scale, scale

    def _products(self, qs: torch.Tensor, screen: str, wanted: Optional[torch.Tensor] = None
                  ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The screening scores of queries ``qs`` (as ``_screening_queries`` gives them) with
        every key, one step at a time: ``(first query row, first key, scores [r, c])``. Each
        step's scores live in one buffer, overwritten by the next step. A block of rows that
        ``wanted`` [b] (which the caller may clear as it goes) no longer marks is skipped."""
        b = qs.shape[0]
        table = self._table if screen == "float16" else None
        span, rows = self._steps(b, qs.element_size(), table is not None)
        q_sq = (qs * qs).sum(1) if self.metric == "l2" else None  # l2: float32, qs is q
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
                    _negative_squared_distance(s, q_sq[r0:r0 + r, None],
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
            floor = floor.double() + (_next_up(floor).double() - floor.double()) / 2
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
        least = torch.where(least.double() > (kth.double() - eps) * scale, _next_down(least),
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
        ``chunk`` keys; on CUDA a score budget of a quarter of free memory (at most 8 GiB),
        spent on every key at once when a block of up to 2,048 queries fits (one top-k per
        block) and the float16 table is resident, else on ``chunk`` keys."""
        if self.device.type != "cuda":
            span = min(self.chunk, self.n)
            return span, max(ROWS, min(b, CPU_SCORE_ELEMENTS // span))
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = min(GPU_SCORE_BYTES, free // 4) // itemsize
        span = min(self.chunk, self.n)
        if resident_table:
            span = max(span, min(self.n, budget // max(ROWS, min(b, 2048))))
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
