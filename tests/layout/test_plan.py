"""Plans: the layout chain run on token numbers then one gather equals the chain run on the routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout import Side, attention_mask_of, pack, to_router_order, ulysses_shard, unpad
from routereplay.layout.plan import gather, token_index


@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=5),
    st.sampled_from(list(Side)),
    st.integers(1, 4),
    st.integers(1, 3),
    st.data(),
)
def test_planned_gather_equals_transforming_the_routes(lengths, side, sp, multiple, data) -> None:
    batch, seq = len(lengths), max(lengths) + 2
    routes_BSLK = torch.randint(0, 50, (batch, seq, 2, 3), generator=torch.Generator().manual_seed(len(lengths)))
    mask_BS = attention_mask_of(lengths, seq, side)
    rank = data.draw(st.integers(0, sp - 1))
    order = data.draw(st.permutations(range(batch)))
    direct = ulysses_shard(
        pack(unpad(routes_BSLK, attention_mask=mask_BS), order=order, multiple=multiple).values, sp, rank
    )
    index_P = ulysses_shard(
        pack(unpad(token_index(batch, seq), attention_mask=mask_BS), order=order, multiple=multiple).values, sp, rank
    )
    assert torch.equal(gather(routes_BSLK, index_P, source_dims=2), direct)
    as_numpy = gather(routes_BSLK.numpy(), index_P.numpy(), source_dims=2)
    assert isinstance(as_numpy, np.ndarray) and np.array_equal(as_numpy, direct.numpy())


def test_a_plan_keeps_any_index_shape() -> None:
    routes_BSLK = torch.arange(2 * 3 * 1 * 1).reshape(2, 3, 1, 1)
    assert torch.equal(
        gather(routes_BSLK, to_router_order(token_index(2, 3)), source_dims=2), to_router_order(routes_BSLK)
    )


def test_a_plan_for_another_batch_shape_is_refused() -> None:
    with pytest.raises(BatchShapeError, match="the plan refers to token 11 but the routes hold 6 tokens"):
        gather(torch.zeros(2, 3, 1, 1), token_index(3, 4), source_dims=2)
    with pytest.raises(ConfigError, match="source_dims must be in 1..4"):
        gather(torch.zeros(2, 3, 1, 1), token_index(3), source_dims=5)
