"""Plans for `bundles_for` / `RouteSource.cut`: integer indices of real tokens, or a named error.

Defects guarded against: a float plan [0.5, 1.7, 2.2] was truncated to tokens 0, 1, 2 and delivered
silently (another token's routes replayed), NaN and inf became padding, a complex plan lost its
imaginary part, `plan=None` / "abc" raised torch's own errors, and `positions=2**63` overflowed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.transport.bundle import RankBundle
from routereplay.transport.spans import bundles_for, spans_of

L, K, E, S = 2, 2, 8, 6


def _store() -> RouteStore:
    rng = np.random.default_rng(0)
    store = RouteStore(num_experts=E, layers=list(range(L)), top_k=K)
    for i in range(2):
        trace = random_trace(rng, num_tokens=S - 1, num_layers=L, top_k=K, num_experts=E)
        store.add_turn(i, rng.integers(0, 1000, S), trace)
    return store


@pytest.mark.parametrize(
    "plan",
    [
        torch.tensor([0.5, 1.7, 2.2]),
        np.array([0.5, 1.7, 2.2]),
        torch.tensor([0.0, float("nan"), 2.0]),
        np.array([0.0, np.inf]),
        torch.tensor([1 + 2j, 3 + 0j]),
        np.array([1 + 2j]),
        torch.tensor([True, False]),
        None,
        "abc",
        b"\x00\x01",
        [0.5, 1.0],
        object(),
    ],
    ids=lambda p: type(p).__name__ + (f"-{p.dtype}" if hasattr(p, "dtype") else ""),
)
def test_a_plan_that_is_not_integer_indices_is_refused_before_any_cut(plan: object) -> None:
    """Through bundles_for (what RouteSource.cut calls) and spans_of: a ConfigError naming the rank and the
    dtype, before any bundle is cut (rank 0's good plan is not delivered either)."""
    store = _store()
    with pytest.raises(ConfigError, match="rank 1's plan is .*a plan .*integer"):
        bundles_for(store, [0, 1], [torch.arange(4), plan], S)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="the plan is .*integer"):
        spans_of(plan, S)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-2, -(2**40), 2**62, 2**63 - 1])
def test_an_index_outside_the_plan_range_is_a_batch_shape_error(bad: int) -> None:
    """-1 is the one padding marker; other negatives and indices no batch could hold are refused."""
    with pytest.raises(BatchShapeError, match=rf"rank 0's plan names token {bad}: a plan holds flat indices"):
        bundles_for(_store(), [0, 1], [torch.tensor([0, bad, -1])], S)
    big = np.array([0, 2**64 - 1], np.uint64)
    with pytest.raises(BatchShapeError, match=f"names token {2**64 - 1}"):
        spans_of(big, S)


@pytest.mark.parametrize("positions", [2**63, 2**62 + 1, 0, -3, True, 6.0, None])
def test_positions_must_be_a_row_length(positions: object) -> None:
    with pytest.raises(ConfigError, match="must be the padded batch's positions per row"):
        bundles_for(_store(), [0, 1], [torch.arange(4)], positions)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be the padded batch's positions per row"):
        spans_of(torch.arange(4), positions)  # type: ignore[arg-type]


def test_plans_must_be_a_list_of_plans() -> None:
    with pytest.raises(ConfigError, match="plans must be a list with one plan per rank, got NoneType"):
        bundles_for(_store(), [0, 1], None, S)  # type: ignore[arg-type]


@pytest.mark.parametrize("sample_ids", [None, "01", b"\x00", 7, {0, 1}, np.zeros((1, 2), np.int64)])
def test_sample_ids_must_list_the_batch_samples(sample_ids: object) -> None:
    """`bundles_for(store, None, ...)` raised TypeError ('NoneType' object is not iterable)."""
    with pytest.raises(ConfigError, match="sample_ids must list the batch's samples in row order"):
        bundles_for(_store(), sample_ids, [torch.arange(4)], S)  # type: ignore[arg-type]


def test_sample_ids_may_be_a_tuple_or_an_array_and_the_store_must_be_a_store() -> None:
    store = _store()
    expected = bundles_for(store, [0, 1], [torch.arange(8)], S)
    assert bundles_for(store, (0, 1), [torch.arange(8)], S) == expected
    assert bundles_for(store, np.array([0, 1]), [torch.arange(8)], S) == expected
    with pytest.raises(ConfigError, match="store must be the RouteStore that holds the batch's routes, got NoneType"):
        bundles_for(None, [0, 1], [torch.arange(4)], S)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_every_integer_dtype_and_shape_is_a_plan(dtype: torch.dtype) -> None:
    """Integer plans of any width, flat or (2, 3), numpy or torch or a list, give the same bundle."""
    store = _store()
    flat = [0, 1, 2, 7, 8, 9]
    expected = bundles_for(store, [0, 1], [torch.tensor(flat)], S)[0]
    for plan in (torch.tensor(flat, dtype=dtype), torch.tensor(flat, dtype=dtype).reshape(2, 3),
                 np.array(flat, np.int32), flat, np.array(flat, np.uint64)):  # fmt: skip
        assert bundles_for(store, [0, 1], [plan], np.int64(S))[0] == expected
    assert RankBundle(expected, expected_rows=6).decode().shape == (6, L, K)
