"""Layouts under replay: routes moved padded -> ragged -> packed (in a shuffled trainer order) and
replayed on the packed row reproduce the padded run's routes exactly and its logits to fp32
rounding; a wrong packing order is caught by the same comparison."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay.layout import Side, attention_mask_of, pack, unpack, unpad
from routereplay.layout.ragged import positions
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, N) additive mask for one packed row: causal inside each sequence, -inf across."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    segment_N = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (segment_N[:, None] == segment_N[None, :]) & torch.tril(
        torch.ones(len(segment_N), len(segment_N), dtype=torch.bool)
    )
    mask = torch.zeros(1, 1, len(segment_N), len(segment_N))
    mask[0, 0][~allowed] = float("-inf")
    return mask


@pytest.fixture(scope="module")
def model_and_replayer():
    from routereplay.runtime import attach

    model = tiny_qwen3()
    return model, attach(model)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    side=st.sampled_from(list(Side)),
    seed=st.integers(0, 10_000),
    shuffle=st.randoms(use_true_random=False),
)
def test_packed_replay_equals_padded_replay(model_and_replayer, lengths, side, seed, shuffle) -> None:
    model, replayer = model_and_replayer
    batch, seq = len(lengths), max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, 128, (batch, seq), generator=generator)
    mask_BS = attention_mask_of(lengths, seq, side)
    forced_BSLK = random_routes(batch, seq, 3, 2, 8, seed=seed)
    forced_BSLK[~mask_BS] = -1
    with replayer.replay(forced_BSLK, attention_mask=None) as padded_run:
        logits_padded = model(input_ids=ids_BS, attention_mask=mask_BS.long()).logits

    order = list(range(batch))
    shuffle.shuffle(order)
    routes = pack(unpad(forced_BSLK, attention_mask=mask_BS), order=order)
    ids = pack(unpad(ids_BS, attention_mask=mask_BS), order=order)
    position_ids = positions(routes.cu_seqlens_padded)
    replayer.stats.reset()
    with replayer.replay(routes.values[None]) as packed_run:
        logits_packed = model(
            input_ids=ids.values[None],
            position_ids=position_ids[None],
            attention_mask=block_causal_mask(routes.cu_seqlens_padded),
        ).logits

    assert packed_run.stats.fallback_rows == 0  # packing dropped every padding row
    assert packed_run.stats.replayed_rows == sum(lengths) * 3
    recorded = dataclasses.replace(routes, values=packed_run.routes[0])
    assert unpack(recorded) == unpad(padded_run.routes, attention_mask=mask_BS)
    expected = pack(unpad(logits_padded, attention_mask=mask_BS), order=order).values
    assert torch.allclose(logits_packed[0], expected, atol=1e-5, rtol=0)
    if order != sorted(order):  # negative control: routes packed in batch order would not match these tokens
        wrong = pack(unpad(forced_BSLK, attention_mask=mask_BS))
        assert not torch.equal(wrong.values, routes.values)
