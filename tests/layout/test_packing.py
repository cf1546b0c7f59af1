"""Packing into THD rows in the trainer's order, per-sequence padding, and its inverse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from routereplay.errors import ConfigError
from routereplay.layout import Ragged, pack, unpack
from tests.layout.strategies import raggeds, same_type


@given(raggeds(), st.integers(1, 6), st.randoms(use_true_random=False))
def test_unpack_of_pack_is_identity_in_any_order(ragged: Ragged, multiple: int, random) -> None:
    order = list(range(ragged.num_sequences))
    random.shuffle(order)
    packed = pack(ragged, order=order, multiple=multiple)
    assert same_type(packed.values, ragged.values)
    assert bool((packed.cu_seqlens_padded % multiple == 0).all())
    assert unpack(packed) == ragged


@given(raggeds(), st.integers(1, 4))
def test_packed_rows_hold_each_sequence_at_its_padded_offset(ragged: Ragged, multiple: int) -> None:
    order = list(reversed(range(ragged.num_sequences)))
    packed = pack(ragged, order=order, multiple=multiple)
    values = torch.as_tensor(packed.values)
    for i, b in enumerate(order):
        begin = int(packed.cu_seqlens_padded[i])
        length = int(packed.lengths[i])
        assert torch.equal(values[begin : begin + length], torch.as_tensor(ragged.sequence(b)))
        assert bool((values[begin + length : int(packed.cu_seqlens_padded[i + 1])] == -1).all())


def test_a_subset_packs_a_micro_batch_and_unpacks_in_batch_order() -> None:
    ragged = Ragged.from_lengths(np.arange(6).reshape(6, 1, 1), [1, 2, 3])
    packed = pack(ragged, order=[2, 0])
    assert packed.values[:, 0, 0].tolist() == [3, 4, 5, 0]
    assert unpack(packed) == ragged.select([0, 2])


def test_pack_refuses_a_sequence_twice_or_out_of_range() -> None:
    ragged = Ragged.from_lengths(np.zeros((3, 1, 1)), [1, 2])
    with pytest.raises(ConfigError, match="names a sequence twice"):
        pack(ragged, order=[1, 1])
    with pytest.raises(ConfigError, match="order names sequence 2 but there are 2 sequences"):
        pack(ragged, order=[0, 2])
    with pytest.raises(ConfigError, match="multiple must be >= 1"):
        pack(ragged, multiple=0)
