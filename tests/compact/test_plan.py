"""Per-rank plans: the spans a layout needs, and bundles equal to the single-process layout's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout import pack, packed_zigzag_shard, ulysses_shard, unpad
from routereplay.layout.plan import gather, token_index
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.transport.bundle import RankBundle
from routereplay.transport.spans import Span, bundles_for, spans_of

L, K, E = 3, 2, 8


def _store(lengths: list[int], seed: int = 0, *, gap: bool = False) -> RouteStore:
    """Samples of `lengths` tokens; with `gap`, sample 1's routes stop short and sample 2 arrives in two calls."""
    rng = np.random.default_rng(seed)
    store = RouteStore(num_experts=E, layers=list(range(L)), top_k=K)
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, 1000, n)
        rows = n - 1 - (3 if gap and i == 1 else 0)
        trace = random_trace(rng, num_tokens=rows, num_layers=L, top_k=K, num_experts=E, unrouted_fraction=0.1)
        if gap and i == 2:
            half = rows // 2
            store.add_turn(i, tokens[: half + 1], _cut(trace, 0, half))
            store.add_turn(i, tokens, _cut(trace, half + 2, rows))  # rows half..half+1: a tool call, unrouted
        else:
            store.add_turn(i, tokens, trace)
    return store


def _cut(trace: RouteTrace, begin: int, end: int) -> RouteTrace:
    return RouteTrace(trace.experts[begin:end].copy(), E, None, begin, (Segment(begin, end, "vllm"),))


def _padded(store: RouteStore, ids: list[int], positions: int) -> torch.Tensor:
    routes_BSLK = torch.full((len(ids), positions, L, K), -1, dtype=torch.int16)
    for b, sample_id in enumerate(ids):
        experts = store.trace(sample_id).experts
        routes_BSLK[b, : len(experts)] = torch.from_numpy(experts)
    return routes_BSLK


def _packed_plans(lengths: list[int], positions: int, sp: int) -> list[torch.Tensor]:
    index_BS = token_index(len(lengths), positions)
    packed = pack(unpad(index_BS, lengths), multiple=sp)
    return [ulysses_shard(packed.values, sp, rank) for rank in range(sp)]


def test_spans_of_finds_every_run_of_one_sample() -> None:
    """Runs split at a sample change, a position jump and padding; one missed split ships the wrong rows."""
    S = 10
    index = torch.tensor([3, 4, 5, -1, -1, 12, 13, 20, 22, 23, 9])
    assert spans_of(index, S) == [
        Span(0, 0, 3, 6), Span(5, 1, 2, 4), Span(7, 2, 0, 1), Span(8, 2, 2, 4), Span(10, 0, 9, 10),
    ]  # fmt: skip
    assert spans_of(torch.full((4,), -1), S) == []
    with pytest.raises(ConfigError, match="positions per row"):
        spans_of(index, 0)


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_packed_ulysses_bundles_equal_the_single_process_layout(sp: int) -> None:
    """Each rank's bundle must decode to exactly the rows the single-process layout gives that rank."""
    lengths = [17, 5, 30, 9]
    S = max(lengths)
    store = _store(lengths, gap=True)
    ids = list(range(len(lengths)))
    plans = _packed_plans(lengths, S, sp)
    bundles = bundles_for(store, ids, plans, S)
    reference = _padded(store, ids, S)
    for rank, (plan, data) in enumerate(zip(plans, bundles, strict=True)):
        got = RankBundle(data, expected_rows=len(plan)).decode()
        assert np.array_equal(got, gather(reference, plan, source_dims=2).numpy()), rank
    if sp > 1:
        total = sum(len(b) for b in bundles)
        assert max(len(b) for b in bundles) < 0.7 * total  # no rank carries the batch


def test_cp_zigzag_bundles_equal_the_single_process_layout() -> None:
    """Zigzag CP gives each rank two chunks per sequence: both must land at their rows."""
    lengths = [16, 8, 24]
    S, cp = 24, 2
    store = _store(lengths, seed=1)
    index_BS = token_index(len(lengths), S)
    packed = pack(unpad(index_BS, lengths), multiple=2 * cp)
    plans = [packed_zigzag_shard(packed, cp, rank) for rank in range(cp)]
    reference = _padded(store, [0, 1, 2], S)
    for plan, data in zip(plans, bundles_for(store, [0, 1, 2], plans, S), strict=True):
        assert np.array_equal(RankBundle(data).decode(), gather(reference, plan, source_dims=2).numpy())


def test_plans_that_name_missing_rows_or_samples_are_refused() -> None:
    """A plan built for a bigger batch must fail loudly, not ship an empty or foreign span."""
    store = _store([6, 6])
    with pytest.raises(BatchShapeError, match="names batch row 2, but the batch has 2 samples"):
        bundles_for(store, [0, 1], [torch.tensor([0, 1, 2 * 6 + 1])], 6)
    empty = RouteStore(num_experts=E, layers=list(range(L)), top_k=K)
    empty.add_turn("a", [1, 2, 3], None)
    with pytest.raises(ConfigError, match="no sample of this batch has routes yet"):
        bundles_for(empty, ["a"], [torch.tensor([0, 1])], 3)
