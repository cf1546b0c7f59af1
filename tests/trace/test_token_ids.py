"""`RouteTrace.token_ids`: the tokens a trace routes, kept through slice / merge / select / equality
(issue 11 item 21: a trace knows its tokens so replay can refuse a shifted batch)."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay import RouteTrace
from routereplay.errors import ConfigError, TokenMismatchError


def _trace(start: int, rows: int, token_ids: list[int] | None, seed: int = 0) -> RouteTrace:
    generator = np.random.default_rng(seed)
    experts = np.stack([generator.permutation(8)[:2] for _ in range(rows * 2)]).reshape(rows, 2, 2)
    return RouteTrace(experts, 8, start=start, token_ids=token_ids)


def test_token_ids_follow_rows_through_transforms() -> None:
    """Silent misroute (issue 11 item 21): every copy of a trace keeps the tokens its rows route."""
    trace = _trace(2, 5, [11, 12, 13, 14, 15])
    assert trace.token_ids is not None and trace.token_ids.dtype == np.int64
    assert trace.slice(3, 6).token_ids.tolist() == [12, 13, 14]
    assert trace.select_layers([1]).token_ids.tolist() == [11, 12, 13, 14, 15]
    assert trace.sorted_rows().token_ids.tolist() == [11, 12, 13, 14, 15]
    assert trace.with_provenance("hf", 3).token_ids.tolist() == [11, 12, 13, 14, 15]
    assert _trace(0, 3, None).token_ids is None
    cut = _trace(0, 3, None).with_token_ids([7, 8, 9, 10])  # prompt + response: the last id has no row
    assert cut.token_ids.tolist() == [7, 8, 9]
    assert "token ids" in repr(trace)


def test_equality_compares_token_ids() -> None:
    """Silent misroute (issue 11 item 21): the same routes of other tokens are another trace."""
    a = _trace(0, 3, [1, 2, 3])
    assert a == _trace(0, 3, [1, 2, 3])
    assert a != _trace(0, 3, [1, 2, 4])
    assert a != _trace(0, 3, None)
    assert _trace(0, 3, None) == _trace(0, 3, None)


def test_merge_takes_ids_with_rows_and_refuses_other_tokens() -> None:
    """Silent misroute (issue 11 item 21): merging routes of two different token sequences is refused."""
    first = _trace(0, 3, [1, 2, 3], seed=1)
    later = _trace(5, 2, [6, 7], seed=2)
    merged = first.merge(later)
    assert merged.token_ids.tolist() == [1, 2, 3, -1, -1, 6, 7]  # -1: a position neither trace covers
    assert first.merge(_trace(2, 2, None, seed=3)).token_ids.tolist() == [1, 2, 3, -1]
    assert _trace(0, 2, None).merge(_trace(2, 2, None)).token_ids is None
    overlapping = _trace(1, 3, [2, 3, 4], seed=4)
    assert first.merge(overlapping).token_ids.tolist() == [1, 2, 3, 4]
    with pytest.raises(TokenMismatchError, match=r"token 1 is id 2 in one trace and 9 in the other"):
        first.merge(_trace(1, 2, [9, 3], seed=5))


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [
        ([1, 2], "has 2 ids but the trace has 3 rows"),
        ([1.0, 2.0, 3.0], "1-D integer sequence"),
        ([[1, 2, 3]], "1-D integer sequence"),
        ([1, -2, 3], r"token_ids span \[-2, 3\]"),
    ],
)
def test_bad_token_ids_are_refused(token_ids: object, match: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 21): malformed ids are a named ConfigError."""
    with pytest.raises(ConfigError, match=match):
        _trace(0, 3, token_ids)  # type: ignore[arg-type]
