"""EncodedRoutes' arguments: a bad chunk size or row number is a named error, never uninitialised or made-up rows.

Defects guarded against: `rows(..., chunk_rows=-1)` returned `np.empty` memory as expert ids (the
chunk loop ran zero times), `chunk_rows=0` / None raised a bare ValueError / TypeError, and
`routed_before` answered rows outside the trace (151 routed rows before row 151 of 150, -8 before
row -8) or raised OverflowError.
"""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.codec.encoded import EncodedRoutes
from routereplay.errors import ConfigError, RowCountError
from routereplay.testing.synthetic import random_trace


def _encoded(unrouted: float) -> EncodedRoutes:
    trace = random_trace(np.random.default_rng(0), num_tokens=50, num_layers=3, top_k=2, num_experts=8, start=4,
                         unrouted_fraction=unrouted)  # fmt: skip
    return EncodedRoutes.encode(trace)


@pytest.mark.parametrize("bad", [-1, 0, None, 2.5, True, "8"])
def test_rows_refuses_a_chunk_size_that_is_not_a_positive_int(bad: object) -> None:
    encoded = _encoded(0.2)
    with pytest.raises(ConfigError, match=rf"chunk_rows={bad!r} must be a positive int"):
        encoded.rows(4, 54, chunk_rows=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [1, 7, np.int64(64), 1 << 15])
def test_every_positive_chunk_size_gives_the_same_rows(chunk: int) -> None:
    encoded = _encoded(0.2)
    assert np.array_equal(encoded.rows(5, 54, chunk_rows=chunk), encoded.trace().experts[1:])


@pytest.mark.parametrize("unrouted", [0.0, 0.3])
def test_routed_before_counts_only_rows_of_the_trace(unrouted: float) -> None:
    """Inside [0, T * L] it counts routed rows; outside it is a RowCountError naming the range (with no
    -1 rows it used to echo any row back, past the end or negative)."""
    encoded = _encoded(unrouted)
    routed_R = (encoded.trace().experts.reshape(150, 2) != -1).all(axis=1)
    for row in (0, 1, 77, 149, 150):
        assert encoded.routed_before(row) == int(routed_R[:row].sum())
    for bad in (151, -8, -1, 2**63, -(2**70)):
        with pytest.raises(RowCountError, match=r"flat rows of these routes are 0\.\.150 \(50 tokens x 3 layers"):
            encoded.routed_before(bad)
    for bad_type in (1.0, None, True):
        with pytest.raises(ConfigError, match="needs a flat \\(token, layer\\) row as an int"):
            encoded.routed_before(bad_type)  # type: ignore[arg-type]


def test_rows_refuses_bool_positions() -> None:
    with pytest.raises(ConfigError, match="token positions must be ints"):
        _encoded(0.0).rows(True, 5)  # type: ignore[arg-type]
