"""Parallel shards: every split has an inverse, CP zigzag matches its definition, and packed
sharding agrees with padded sharding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from routereplay.errors import BatchShapeError, ConfigError, DivisibilityError
from routereplay.layout import (
    Ragged,
    contiguous_shard,
    contiguous_unshard,
    from_router_order,
    from_sequence_first,
    pack,
    packed_zigzag_shard,
    packed_zigzag_unshard,
    sequence_parallel_scatter,
    to_router_order,
    to_sequence_first,
    ulysses_shard,
    ulysses_unshard,
    unpack,
    zigzag_shard,
    zigzag_unshard,
)
from tests.layout.strategies import raggeds, same_type

arrays = st.builds(
    lambda n, width, as_torch: (
        torch.arange(n * width).reshape(n, width) if as_torch else np.arange(n * width).reshape(n, width)
    ),
    st.integers(0, 40),
    st.integers(1, 3),
    st.booleans(),
)


@given(arrays, st.integers(1, 5))
def test_ulysses_unshard_of_shard_is_identity(x, world: int) -> None:
    shards = [ulysses_shard(x, world, r) for r in range(world)]
    assert all(same_type(s, x) for s in shards)
    assert len({s.shape[0] for s in shards}) == 1
    assert np.array_equal(np.asarray(ulysses_unshard(shards, x.shape[0])), np.asarray(x))
    padding = sum(int((np.asarray(s) == -1).all(axis=1).sum()) for s in shards)
    assert padding == -x.shape[0] % world


@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 3))
def test_contiguous_and_zigzag_round_trip_along_the_sequence_axis(cp: int, chunk: int, batch: int) -> None:
    x_BS = torch.arange(batch * 2 * cp * chunk).reshape(batch, 2 * cp * chunk)
    zig = [zigzag_shard(x_BS, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(zigzag_unshard(zig, dim=1), x_BS)
    flat = [contiguous_shard(x_BS, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(contiguous_unshard(flat, dim=1), x_BS)


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r() -> None:
    x = np.arange(8)
    assert zigzag_shard(x, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_shard(x, 2, 1).tolist() == [2, 3, 4, 5]


@given(raggeds(), st.integers(1, 3))
def test_packed_zigzag_round_trips_and_splits_each_sequence(ragged: Ragged, cp: int) -> None:
    packed = pack(ragged, multiple=2 * cp)
    shards = [packed_zigzag_shard(packed, cp, r) for r in range(cp)]
    assert sum(s.shape[0] for s in shards) == packed.num_rows
    restored = packed_zigzag_unshard(shards, packed.cu_seqlens_padded)
    assert unpack(dataclasses.replace(packed, values=restored)) == ragged
    # per sequence, rank r's rows are exactly the padded-batch zigzag of that sequence
    for b in range(ragged.num_sequences):
        begin, end = int(packed.cu_seqlens_padded[b]), int(packed.cu_seqlens_padded[b + 1])
        sequence = torch.as_tensor(packed.values)[begin:end]
        chunk = (end - begin) // (2 * cp)
        for r in range(cp):
            mine = torch.as_tensor(shards[r])
            offset = int(packed.cu_seqlens_padded[b]) // cp
            assert torch.equal(mine[offset : offset + 2 * chunk], zigzag_shard(sequence, cp, r))


@given(st.integers(1, 4), st.integers(1, 6))
def test_router_order_is_sequence_first_and_invertible(batch: int, seq: int) -> None:
    x_BS = torch.arange(batch * seq).reshape(batch, seq, 1, 1)
    router_N = to_router_order(x_BS)
    assert router_N[:batch, 0, 0].tolist() == x_BS[:, 0, 0, 0].tolist()  # position 0 of every row first
    assert torch.equal(from_router_order(router_N, batch), x_BS)
    assert torch.equal(from_sequence_first(to_sequence_first(x_BS)), x_BS)


def test_sequence_parallel_scatter_splits_the_sequence_first_axis() -> None:
    x_SB = np.arange(12).reshape(6, 2)
    assert sequence_parallel_scatter(x_SB, 3, 1).tolist() == [[4, 5], [6, 7]]


def test_splits_that_do_not_divide_raise_with_the_fix() -> None:
    with pytest.raises(
        DivisibilityError, match=r"length 7 along dim 0 does not divide by 2 x cp = 4; pad to a multiple of 4"
    ):
        zigzag_shard(np.arange(7), 2, 0)
    with pytest.raises(DivisibilityError, match=r"does not divide by 3; pad the sequence to a multiple of 3"):
        sequence_parallel_scatter(np.arange(8), 3, 0)
    packed = pack(Ragged.from_lengths(np.zeros((6, 1, 1)), [4, 2]), multiple=2)
    with pytest.raises(
        DivisibilityError, match=r"packed sequence 1 has 2 rows, not a multiple of 2 x cp = 4; pack with multiple=4"
    ):
        packed_zigzag_shard(packed, 2, 0)


def test_bad_ranks_and_mismatched_shards_raise() -> None:
    with pytest.raises(ConfigError, match=r"ulysses_shard: rank 2 is not in 0..1"):
        ulysses_shard(np.arange(4), 2, 2)
    with pytest.raises(BatchShapeError, match="shards differ in length"):
        contiguous_unshard([np.arange(2), np.arange(3)])
    with pytest.raises(BatchShapeError, match="length 9 exceeds the 8 rows"):
        ulysses_unshard([np.arange(4), np.arange(4)], 9)
