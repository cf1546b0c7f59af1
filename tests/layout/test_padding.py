"""Ragged <-> padded batches: round trips for both sides and masks, and misuse errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout import Ragged, Side, attention_mask_of, pad, unpad
from routereplay.layout.ragged import from_traces, to_traces
from routereplay.trace.route_trace import RouteTrace
from tests.layout.strategies import raggeds, same_type


@given(raggeds(), st.sampled_from(list(Side)), st.integers(1, 4))
def test_pad_then_unpad_is_identity(ragged: Ragged, side: Side, multiple: int) -> None:
    padded = pad(ragged, side=side, multiple=multiple)
    assert same_type(padded, ragged.values)
    assert padded.shape[1] % multiple == 0
    assert unpad(padded, ragged.lengths, side=side) == ragged


@given(raggeds(), st.sampled_from(list(Side)))
def test_unpad_by_mask_equals_unpad_by_lengths(ragged: Ragged, side: Side) -> None:
    padded = pad(ragged, side=side, length=30)
    mask_BS = attention_mask_of(ragged.lengths, 30, side)
    assert unpad(padded, attention_mask=mask_BS) == unpad(padded, ragged.lengths, side=side)


@given(raggeds())
def test_padding_rows_are_minus_one_never_zero(ragged: Ragged) -> None:
    padded = torch.as_tensor(pad(ragged, side=Side.LEFT, length=25))
    mask_BS = attention_mask_of(ragged.lengths, 25, Side.LEFT)
    assert bool((padded[~mask_BS] == -1).all())
    assert int((padded[mask_BS] >= 0).sum()) == padded[mask_BS].numel()


def test_left_padding_puts_tokens_at_the_end() -> None:
    ragged = Ragged.from_lengths(np.array([[[5]], [[6]], [[7]]]), [1, 2])
    padded = pad(ragged, side="left")
    assert padded[:, :, 0, 0].tolist() == [[-1, 5], [6, 7]]


def test_traces_round_trip_keeps_missing_prefix_rows() -> None:
    experts = np.array([[[1, 2]], [[3, 4]]], dtype=np.int16)
    trace = RouteTrace(experts, 8, (3,), start=2)
    ragged = from_traces([trace])
    assert ragged.lengths.tolist() == [4]
    assert ragged.values[:2].tolist() == [[[-1, -1]], [[-1, -1]]]
    (back,) = to_traces(ragged, num_experts=8, layers=(3,))
    assert back.slice(2, 4).experts.tolist() == experts.tolist()


def test_unpad_rejects_a_length_longer_than_the_row() -> None:
    with pytest.raises(BatchShapeError, match="sequence 1 has 9 tokens but the padded rows hold 4"):
        unpad(np.zeros((2, 4, 1, 1)), [2, 9])


def test_unpad_rejects_a_mask_of_another_shape() -> None:
    with pytest.raises(BatchShapeError, match=r"attention_mask has shape \(2, 3\) but the batch is \(2, 4\)"):
        unpad(np.zeros((2, 4, 1, 1)), attention_mask=np.ones((2, 3), dtype=bool))


def test_unpad_needs_lengths_or_a_mask() -> None:
    with pytest.raises(ConfigError, match="needs the sequence lengths or an attention_mask"):
        unpad(np.zeros((2, 4, 1, 1)))


def test_pad_rejects_a_length_shorter_than_the_longest_sequence() -> None:
    ragged = Ragged.from_lengths(np.zeros((7, 1, 1)), [3, 4])
    with pytest.raises(BatchShapeError, match="length 3 is shorter than the longest sequence"):
        pad(ragged, length=3)


def test_ragged_rejects_offsets_that_do_not_match_the_rows() -> None:
    with pytest.raises(BatchShapeError, match="cu_seqlens ends at 5 but values have 4 rows"):
        Ragged.from_lengths(np.zeros((4, 1, 1)), [2, 3])
    with pytest.raises(ConfigError, match="sequence lengths must be >= 0"):
        Ragged.from_lengths(np.zeros((4, 1, 1)), [5, -1])
