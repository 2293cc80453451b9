"""An IVF index trained and filled with torch's k-means on torch's device: a GPU without faiss-gpu.

faiss-cpu spends most of an IVF-PQ build in k-means (the coarse centroids over d dimensions, then
m product-quantizer codebooks over the residuals) and in assigning every key to its list, each a
dense matrix product a GPU does in seconds (``gnnlm.retrieval.kmeans``). Here torch does those
parts and faiss the rest, so the index written is an ordinary faiss CPU index:

- ``train_ivf``: the coarse quantizer's centroids by k-means as faiss's ``IndexIVF.train`` would
  run it (its iterations, seed, and spherical centroids for inner products), put into the
  quantizer; an ``IndexIVFPQ`` (residuals, 8-bit codes, no polysemous training) also gets its
  codebooks from ``batched_kmeans`` over the residuals; any other encoder (SQ8, Flat) is
  trained by faiss with the quantizer already trained (faiss then trains only the encoder);
- ``add_assigned``: each key's list chosen in torch, the codes computed and stored by faiss
  (``IndexIVF.add_core`` with the assignment given).

Indexes behind a transform (OPQ) are trained by faiss (``trains_on_torch``).
"""
from __future__ import annotations

import faiss
import numpy as np
import torch

from gnnlm.retrieval.kmeans import assign, batched_kmeans, kmeans


def ivf_of(index: faiss.Index) -> faiss.IndexIVF | None:
    """The index as an ``IndexIVF`` when it is one at the top (no transform before it)."""
    ivf = faiss.downcast_index(index)
    return ivf if isinstance(ivf, faiss.IndexIVF) else None


def trains_on_torch(index: faiss.Index) -> bool:
    """Whether torch can train this index: an IVF index with a flat coarse quantizer."""
    ivf = ivf_of(index)
    return ivf is not None and isinstance(faiss.downcast_index(ivf.quantizer), faiss.IndexFlat)


def _metric(ivf: faiss.IndexIVF) -> str:
    return "ip" if ivf.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"


def train_ivf(index: faiss.Index, sample: np.ndarray, device: torch.device) -> None:
    """Train ``index`` (``trains_on_torch``) on ``sample`` float32 [n, d], k-means on
    ``device``."""
    ivf = ivf_of(index)
    if ivf is None:
        raise ValueError("train_ivf trains IVF indexes (see trains_on_torch).")
    x = torch.from_numpy(np.ascontiguousarray(sample, dtype=np.float32)).to(device)
    metric = _metric(ivf)
    centroids = kmeans(x, ivf.nlist, ivf.cp.niter, metric=metric, spherical=ivf.cp.spherical,
                       seed=ivf.cp.seed)
    ivf.quantizer.reset()
    ivf.quantizer.add(centroids.cpu().numpy())
    pq = ivf
    if (isinstance(pq, faiss.IndexIVFPQ) and pq.by_residual and pq.pq.nbits == 8
            and not getattr(pq, "do_polysemous_training", False)):
        residual = x - centroids[assign(x, centroids, metric)]                 # [n, d]
        subspaces = residual.view(len(x), pq.pq.M, pq.pq.dsub).transpose(0, 1)  # [M, n, dsub]
        codebooks = batched_kmeans(subspaces.contiguous(), pq.pq.ksub, pq.pq.cp.niter,
                                   seed=pq.pq.cp.seed)                          # [M, 256, dsub]
        faiss.copy_array_to_vector(codebooks.cpu().numpy().ravel(), pq.pq.centroids)
        pq.is_trained = True
        pq.precompute_table()  # what faiss's own training ends with (when the tables apply)
    else:
        index.train(sample)    # the quantizer is trained: faiss trains only the encoder


def add_assigned(index: faiss.Index, keys: np.ndarray, device: torch.device) -> None:
    """Add ``keys`` float32 [n, d] to a trained IVF ``index``, their lists assigned in torch on
    ``device`` (the next ids in order)."""
    ivf = ivf_of(index)
    if ivf is None:
        raise ValueError("add_assigned adds to IVF indexes (see trains_on_torch).")
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    centroids = torch.from_numpy(ivf.quantizer.reconstruct_n(0, ivf.nlist)).to(device)
    assigned = assign(torch.from_numpy(keys).to(device), centroids, _metric(ivf))
    lists = np.ascontiguousarray(assigned.cpu().numpy(), dtype=np.int64)
    ivf.add_core(len(keys), faiss.swig_ptr(keys), None, faiss.swig_ptr(lists))
