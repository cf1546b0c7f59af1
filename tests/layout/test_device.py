"""Layouts on a GPU: the transforms and a plan give on device exactly what they give on the CPU."""

from __future__ import annotations

import pytest
import torch

from routereplay.layout import Ragged, attention_mask_of, pack, packed_zigzag_shard, ulysses_shard, unpack, unpad
from routereplay.layout.plan import gather, token_index

pytestmark = pytest.mark.gpu


def test_transforms_and_plans_on_cuda_match_the_cpu() -> None:
    lengths = [7, 3, 12, 5]
    routes_BSLK = torch.randint(0, 64, (4, 12, 3, 2), dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    mask_BS = attention_mask_of(lengths, 12, "left")
    on_cpu = pack(unpad(routes_BSLK, attention_mask=mask_BS), order=[2, 0, 3, 1], multiple=4)
    on_gpu = pack(unpad(routes_BSLK.cuda(), attention_mask=mask_BS.cuda()), order=[2, 0, 3, 1], multiple=4)
    assert on_gpu.values.is_cuda and torch.equal(on_gpu.values.cpu(), on_cpu.values)
    assert torch.equal(unpack(on_gpu).values.cpu(), unpack(on_cpu).values)
    for rank in range(2):
        assert torch.equal(packed_zigzag_shard(on_gpu, 2, rank).cpu(), packed_zigzag_shard(on_cpu, 2, rank))
    index_P = ulysses_shard(pack(unpad(token_index(4, 12, device="cuda"), attention_mask=mask_BS.cuda())).values, 3, 1)
    expected = ulysses_shard(pack(unpad(routes_BSLK, attention_mask=mask_BS)).values, 3, 1)
    assert torch.equal(gather(routes_BSLK.cuda(), index_P, source_dims=2).cpu(), expected)
    assert Ragged.from_lengths(routes_BSLK.cuda().reshape(48, 3, 2), [40, 8]).select([1]).values.is_cuda
