"""k-means in torch, for training an index on a GPU without faiss-gpu.

``kmeans`` is Lloyd's algorithm as faiss's ``Clustering`` runs it: a seeded random sample of the
points as the first centroids, a fixed number of iterations of assign-then-average, an empty
cluster refilled by splitting the largest one in two (its centroid nudged apart by a small
symmetric perturbation), and with ``spherical`` the centroids put back on the unit sphere after
each update (faiss does so for inner-product IVF quantizers). Assignment is by the largest inner
product (``metric="ip"``) or the smallest squared distance (``"l2"``), one matrix product per
block of points. ``batched_kmeans`` clusters several sets at once ([m, n, d] points into
[m, k, d] centroids): the m sub-spaces of a product quantizer in one call. On a GPU both run in
seconds where faiss-cpu takes tens of seconds (``benchmarks/bench_gpu.py``). Every run gives the
same bytes on one device: a cluster's sum adds its points in their order (on a GPU through
``index_put_``'s sorted accumulation, as ``index_add_`` there adds atomically in no fixed
order), and ties in assignment go to the first centroid. A GPU's bytes differ from a CPU's by
the rounding of their matrix products. (A stage that trains centroids writes them before it
encodes with them, so a resumed stage reads the ones it began with either way.)
"""
from __future__ import annotations

import torch

EPS = 1.0 / 1024          # the split's perturbation (faiss's ``EPS``)
BLOCK_ELEMENTS = 1 << 26  # distances per assignment step (256 MB of float32)


def assign(x: torch.Tensor, centroids: torch.Tensor, metric: str = "l2") -> torch.Tensor:
    """The nearest centroid of every point of ``x`` [..., n, d] among ``centroids`` [..., k, d]
    (leading dims batched): int64 [..., n]."""
    k = centroids.shape[-2]
    c_sq = (centroids * centroids).sum(-1)                              # [..., k]
    rows = max(1, BLOCK_ELEMENTS // max(1, k * (x.numel() // (x.shape[-2] * x.shape[-1]))))
    out = []
    for r0 in range(0, x.shape[-2], rows):
        block = x[..., r0:r0 + rows, :]
        scores = block @ centroids.transpose(-1, -2)                      # [..., r, k]
        if metric == "l2":  # argmin |x - c|² = argmax 2 x·c - |c|²
            scores = 2 * scores - c_sq.unsqueeze(-2)
        out.append(scores.argmax(-1))
    return torch.cat(out, dim=-1)


def cluster_sums(points: torch.Tensor, labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """The sum of each cluster's points [clusters, d], the same bytes every run: CUDA's
    ``index_add_`` adds by atomics in whatever order its threads reach them, where
    ``index_put_(accumulate=True)`` sorts the labels and adds each cluster's points in order
    (torch lists the one as nondeterministic on CUDA, not the other); on a CPU ``index_add_``
    adds in order, and ``index_put_`` is the one that does not."""
    sums = torch.zeros(clusters, points.shape[1], dtype=points.dtype, device=points.device)
    if points.device.type == "cuda":
        return sums.index_put_((labels,), points, accumulate=True)
    return sums.index_add_(0, labels, points)


def _update(x: torch.Tensor, labels: torch.Tensor, k: int, generator: torch.Generator
            ) -> torch.Tensor:
    """New centroids [m, k, d] of points ``x`` [m, n, d] labelled ``labels`` [m, n]; an empty
    cluster takes half of the largest one."""
    m, _, d = x.shape
    flat = (labels + torch.arange(m, device=x.device)[:, None] * k).reshape(-1)
    sums = cluster_sums(x.reshape(-1, d), flat, m * k)
    counts = torch.bincount(flat, minlength=m * k).reshape(m, k).to(x.dtype)
    centroids = (sums.reshape(m, k, d) / counts.clamp(min=1)[..., None])
    for s, j in torch.nonzero(counts == 0).tolist():  # rare: a loop is clear and cheap
        # split a cluster chosen in proportion to its size beyond one point (faiss's rule)
        weights = (counts[s] - 1).clamp(min=0).cpu().double()
        big = int(torch.multinomial(weights, 1, generator=generator))
        nudge = torch.full((d,), EPS, dtype=x.dtype, device=x.device)
        sign = torch.where(torch.arange(d, device=x.device) % 2 == 0, 1.0, -1.0).to(x.dtype)
        centroids[s, j] = centroids[s, big] * (1 + sign * nudge)
        centroids[s, big] = centroids[s, big] * (1 - sign * nudge)
        counts[s, j] = counts[s, big] = counts[s, big] / 2
    return centroids


def batched_kmeans(x: torch.Tensor, k: int, iterations: int, metric: str = "l2",
                   spherical: bool = False, seed: int = 0) -> torch.Tensor:
    """Centroids float32 [m, k, d] of the m point sets ``x`` [m, n, d] (n >= k), each
    clustered on its own (module docstring)."""
    if metric not in ("l2", "ip"):
        raise ValueError(f"metric must be 'l2' or 'ip' (got {metric!r}).")
    m, n, d = x.shape
    if n < k:
        raise ValueError(f"k-means needs at least k = {k} points (got {n}).")
    x = x.float()
    generator = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(m)])
    centroids = torch.gather(x, 1, first.to(x.device)[..., None].expand(m, k, d)).clone()
    for _ in range(iterations):
        centroids = _update(x, assign(x, centroids, metric), k, generator)
        if spherical:
            centroids = torch.nn.functional.normalize(centroids, dim=-1, eps=1e-12)
    return centroids


def kmeans(x: torch.Tensor, k: int, iterations: int, metric: str = "l2",
           spherical: bool = False, seed: int = 0) -> torch.Tensor:
    """Centroids float32 [k, d] of the points ``x`` [n, d]."""
    return batched_kmeans(x[None], k, iterations, metric, spherical, seed)[0]
