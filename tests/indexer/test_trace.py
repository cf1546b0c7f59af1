"""`IndexerTrace`: exact round trips of the canonical form, compactness, slicing, and the canonical-form checks."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.bench.indexer import synthetic_choices
from routereplay.errors import ConfigError, IndexerRouteError, TraceShapeError
from routereplay.indexer import IndexerTrace
from routereplay.indexer.blocks import BlockMode
from tests.indexer.choices import random_choices


@pytest.mark.parametrize(
    ("tokens", "layers", "topk", "start", "unknown", "block_rows"),
    [(200, 3, 16, 0, 0.0, 128), (150, 2, 8, 5, 0.2, 7), (40, 1, 64, 0, 0.1, 3), (90, 4, 4, 1000, 0.5, 16)],
)
def test_dense_round_trip(tokens: int, layers: int, topk: int, start: int, unknown: float, block_rows: int) -> None:
    """to_dense(from_dense(x)) must be x exactly: short prefixes, unknown rows, start > 0, any block size."""
    dense = random_choices(tokens, layers, topk, start=start, unknown=unknown, seed=tokens)
    trace = IndexerTrace.from_dense(dense, list(range(10, 10 + layers)), topk, start, block_rows=block_rows)
    back = trace.to_dense()
    assert back.dtype == np.int32 and np.array_equal(back, dense)
    assert trace.num_tokens == tokens and trace.start == start and trace.layers == tuple(range(10, 10 + layers))
    assert np.array_equal(trace.unknown_rows(), dense[:, :, 0] < 0)
    again = IndexerTrace.decode(trace.encode())
    assert again == trace and np.array_equal(again.to_dense(), dense)


def _last_keys(num_tokens: int, index_topk: int) -> np.ndarray:
    """Every query picks its I most recent keys: gaps of 0 bits."""
    dense = random_choices(num_tokens, 1, index_topk)
    for t in range(index_topk, num_tokens):
        dense[t, 0] = np.arange(t - index_topk + 1, t + 1)
    return dense


@pytest.mark.parametrize(
    ("dense", "topk", "mode"),
    [
        (_last_keys(200, 8), 8, BlockMode.GAPS),
        (random_choices(300, 1, 8, seed=1), 8, BlockMode.RICE),
        (random_choices(60, 1, 40, seed=5), 40, BlockMode.BITMAP),  # 40 of 41..60 visible keys
    ],
)
def test_every_block_form_round_trips(dense: np.ndarray, topk: int, mode: BlockMode) -> None:
    """Gap, Rice and bitmap blocks must each be chosen where smallest and decode to their rows."""
    trace = IndexerTrace.from_dense(dense, [0], topk, block_rows=16)
    assert mode in set(trace._modes.tolist())
    assert np.array_equal(IndexerTrace.decode(trace.encode()).to_dense(), dense)


def test_short_prefix_rows_cost_nothing() -> None:
    """Rows whose query sees <= I keys pick them all: they must cost no payload (only the header)."""
    topk = 64
    dense = random_choices(topk, 4, topk)  # every row sees <= 64 keys
    trace = IndexerTrace.from_dense(dense, range(4), topk)
    assert len(trace._payload) == 0 and trace._modes.size == 0
    assert len(trace.encode()) < 64 and np.array_equal(trace.to_dense(), dense)


def test_compact_beats_dense_by_4x_on_recent_choices() -> None:
    """The compact form must be far below T * L * I * 4 on realistic choices (the issue's reason for it)."""
    dense = synthetic_choices(1024, 2, 128, recent=True)
    trace = IndexerTrace.from_dense(dense, range(2), 128)
    assert trace.dense_nbytes == dense.nbytes
    assert len(trace.encode()) < dense.nbytes / 4 and trace.nbytes < dense.nbytes / 4


def test_slice_matches_dense_rows() -> None:
    """slice(b, e) must hold rows b..e-1 with start moved by b (block edges, implicit rows and unknowns crossed)."""
    dense = random_choices(120, 2, 16, start=3, unknown=0.2, seed=9)
    trace = IndexerTrace.from_dense(dense, [4, 8], 16, 3, block_rows=10)
    for begin, end in [(0, 120), (5, 17), (13, 14), (40, 120), (60, 60)]:
        part = trace.slice(begin, end)
        assert part.start == 3 + begin and part.num_tokens == end - begin
        assert np.array_equal(part.to_dense(), dense[begin:end])
    with pytest.raises(ConfigError, match="slice"):
        trace.slice(10, 121)


def test_equality_compares_contents() -> None:
    """== must tell traces apart by content, start and layers, and match equal ones however they were built."""
    dense = random_choices(100, 2, 8, seed=2)
    a = IndexerTrace.from_dense(dense, [0, 1], 8)
    assert a == IndexerTrace.from_dense(dense, [0, 1], 8, block_rows=9)  # other blocks, same contents
    changed = dense.copy()
    changed[50, 1, :] = -1
    assert a != IndexerTrace.from_dense(changed, [0, 1], 8)
    assert a != IndexerTrace.from_dense(dense, [0, 2], 8)
    late = random_choices(30, 2, 8, start=10, seed=3)  # every row full: valid at start 10 and 11
    assert IndexerTrace.from_dense(late, [0, 1], 8, start=10) != IndexerTrace.from_dense(late, [0, 1], 8, start=11)


def _base() -> np.ndarray:
    return random_choices(20, 2, 4, seed=4)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.__setitem__((10, 1, 3), 11), "after the query"),
        (lambda d: d.__setitem__((10, 0, slice(None)), [1, 1, 2, 3]), "twice"),
        (lambda d: d.__setitem__((10, 0, slice(None)), [3, 1, 2, 4]), "not sorted"),
        (lambda d: d.__setitem__((10, 0, slice(None)), [1, -1, 2, 4]), "-1 before"),
        (lambda d: d.__setitem__((10, 0, slice(None)), [1, 2, 4, -1]), "partial row"),
        (lambda d: d.__setitem__((1, 0, slice(None)), [0, -1, -1, -1]), "partial row"),
        (lambda d: d.__setitem__((3, 1, 0), -2), "position -2"),
    ],
)
def test_non_canonical_rows_are_refused(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    """Future keys, repeats, unsorted rows, -1 mid-row and partial rows must raise IndexerRouteError naming the row."""
    dense = _base()
    edit(dense)
    with pytest.raises(IndexerRouteError, match=match):
        IndexerTrace.from_dense(dense, [5, 6], 4)


def test_bad_arguments_are_refused() -> None:
    """Wrong shape, float dtype, repeated layers and bad index_topk must fail with named errors, not deep in numpy."""
    dense = _base()
    with pytest.raises(TraceShapeError, match="shape"):
        IndexerTrace.from_dense(dense, [5], 4)
    with pytest.raises(IndexerRouteError, match="dtype"):
        IndexerTrace.from_dense(dense.astype(np.float32), [5, 6], 4)
    with pytest.raises(ConfigError, match="twice"):
        IndexerTrace.from_dense(dense, [5, 5], 4)
    with pytest.raises(ConfigError, match="index_topk"):
        IndexerTrace.from_dense(dense, [5, 6], 0)
    with pytest.raises(IndexerRouteError, match="after the query"):
        IndexerTrace.from_dense(random_choices(20, 2, 4, start=3), [5, 6], 4, start=0)
