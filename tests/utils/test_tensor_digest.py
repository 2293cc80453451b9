"""gnnlm.utils.tensor_digest: any change of a tensor's bits changes its digest, on both paths
(sha256 of the bytes on the CPU; the weighted sum of bit patterns computed on a GPU, run here on
CPU tensors)."""
from __future__ import annotations

import pytest
import torch

from gnnlm.utils.tensor_digest import tensor_digest, weighted_bit_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool])
def test_one_element_changed_changes_both_digests(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(6, 5, generator=g) > 0) if dtype == torch.bool else (
        torch.randn(6, 5, generator=g) * 100).to(dtype)
    before = (tensor_digest([t]), int(weighted_bit_sum(t)))
    changed = t.clone()
    if dtype == torch.bool:
        changed[3, 2] = ~changed[3, 2]
    elif dtype.is_floating_point:  # the next representable number: one bit
        changed[3, 2] = torch.nextafter(changed[3, 2], torch.tensor(float("inf"), dtype=dtype))
    else:
        changed[3, 2] += 1
    assert tensor_digest([changed]) != before[0]
    assert int(weighted_bit_sum(changed)) != before[1]
    assert (tensor_digest([t.clone()]), int(weighted_bit_sum(t.clone()))) == before


def test_permuted_or_swapped_tensors_change_the_digest():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    assert tensor_digest([a, b]) != tensor_digest([b, a])
    assert int(weighted_bit_sum(a)) != int(weighted_bit_sum(a.t().contiguous()))
    assert tensor_digest([a, None]) != tensor_digest([a])
    assert tensor_digest([a.t()]) == tensor_digest([a.t().contiguous()])  # bits, not layout
