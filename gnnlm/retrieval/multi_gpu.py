"""One FAISS index sharded over every GPU of a process.

``shard_over_gpus`` is for one process that sees several GPUs and an index too large for one:
``faiss.index_cpu_to_all_gpus`` with ``shard=True`` gives each GPU a slice of the database
vectors (or of the inverted lists), searches them all and merges the results, so every query
still sees the whole datastore. It needs faiss-gpu; without it the helpers refuse with a message
that says so, before any work.
"""
from __future__ import annotations

import faiss

from gnnlm.retrieval.search import GPU_MAX_K, Searcher
from gnnlm.utils.devices import faiss_has_gpu


def require_faiss_gpu(what: str) -> None:
    """Refuse ``what`` unless this faiss has GPU support and sees a GPU."""
    if not hasattr(faiss, "index_cpu_to_all_gpus") or not faiss_has_gpu():
        raise ValueError(
            f"{what} needs faiss-gpu and a GPU, but this faiss ({faiss.__version__}) has no GPU "
            f"support or sees no GPU (got {getattr(faiss, 'get_num_gpus', lambda: 0)()} GPUs). "
            f"Install the `gpu` extra (faiss-gpu, after uninstalling faiss-cpu), or search "
            f"without neighbors.shard_index.")


def shard_over_gpus(searcher: Searcher, k: int) -> Searcher:
    """``searcher`` (a CPU index, as ``Searcher.open`` gives it) with its faiss index sharded
    over every GPU of this process; re-ranking with the stored keys is kept. ``k`` is the width
    searches will ask for: GPU faiss refuses k and nprobe above ``GPU_MAX_K``."""
    require_faiss_gpu("A sharded multi-GPU index (neighbors.shard_index)")
    width = int(k * searcher.rerank) if searcher.rerank else k
    nprobe = searcher.nprobe or 0
    if width > GPU_MAX_K or nprobe > GPU_MAX_K:
        raise ValueError(f"GPU faiss searches at most k = nprobe = {GPU_MAX_K}; a sharded GPU "
                         f"index cannot serve this search (got k={width}, nprobe={nprobe}). "
                         f"Lower neighbors.K or search without neighbors.shard_index.")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    searcher.index = faiss.index_cpu_to_all_gpus(searcher.index, co=options)  # copies nprobe
    searcher.device = "cuda"
    return searcher
