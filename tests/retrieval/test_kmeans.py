"""gnnlm.retrieval.kmeans: a cluster's sum adds its points in their order, so k-means gives the
same bytes every run on one device (on a GPU, ``bench_gpu.py``'s ``pq_codebooks`` checks it:
``same_bytes_twice``)."""
from __future__ import annotations

import numpy as np
import torch

from gnnlm.retrieval.kmeans import batched_kmeans, cluster_sums


def test_a_cluster_s_sum_is_its_points_added_in_order():
    gen = torch.Generator().manual_seed(0)
    points = torch.randn(20_000, 16, generator=gen) * 3
    labels = torch.randint(0, 64, (20_000,), generator=gen)
    sums = cluster_sums(points, labels, 64)
    in_order = torch.zeros(64, 16).index_add_(0, labels, points)   # the CPU's ordered adds
    assert torch.equal(sums, in_order)
    exact = np.zeros((64, 16))
    np.add.at(exact, labels.numpy(), points.double().numpy())
    np.testing.assert_allclose(sums.numpy(), exact, rtol=1e-4, atol=1e-3)


def test_k_means_gives_the_same_bytes_every_run():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3000, 8, generator=gen)
    first, second = (batched_kmeans(x, 64, 10, seed=7) for _ in range(2))
    assert torch.equal(first, second)
    assert not torch.equal(first, batched_kmeans(x, 64, 10, seed=8))   # the seed matters
