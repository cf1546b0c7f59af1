"""The canonical dense form of DSA indexer choices, and the checks that keep it honest.

Per sequence, `positions_TLI[t, l]` lists the key positions query token `start + t` attends in DSA
layer `layers[l]`: absolute positions within the sequence, sorted ascending, distinct, never after
the query (a query at position p sees keys 0..p), then padded with -1. A row holds exactly
min(I, p + 1) positions - the indexer always fills its budget when it can - or is entirely -1,
meaning "unknown" (replay computes that row live). Anything else (a future key, a repeat, an
unsorted row, -1 in the middle, a partial row) is an `IndexerRouteError` naming token and layer.
The checks work on bounded chunks of rows, so the working set stays a few MiB whatever T is.
Legend: T = query tokens (rows), L = DSA layers, I = index_topk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.errors import IndexerRouteError, location
from routereplay.indexer.limits import MAX_POSITION

CHUNK_ENTRIES = 1 << 21  # entries checked per step: bounds the working set of the vector checks


def row_need(start: int, num_tokens: int, index_topk: int) -> np.ndarray:
    """min(I, p + 1) for the query positions p = start .. start + T - 1: positions a known row holds."""
    return np.minimum(index_topk, start + 1 + np.arange(num_tokens, dtype=np.int64))


def check_dense(
    positions_TLI: Any, layers: Sequence[int], index_topk: int, start: int, what: str = "indexer choices"
) -> np.ndarray:
    """`positions_TLI` checked against the canonical form and returned as a C-contiguous int32 array."""
    array = _int_array(positions_TLI, what)
    num_layers = len(layers)
    if array.ndim != 3 or array.shape[1:] != (num_layers, index_topk):
        raise IndexerRouteError(
            f"{what}: shape {array.shape} is not (tokens, {num_layers} layers, index_topk {index_topk}); pass "
            "positions_TLI with one column block per DSA layer in `layers` and index_topk slots per row"
        )
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < -1 or high > MAX_POSITION:
            bad = low if low < -1 else high
            t, l, _ = (int(x) for x in np.argwhere(array == bad)[0])
            raise IndexerRouteError(
                f"{what}: {location(row=t, layer=layers[l], start=start)} holds position {bad}; positions are "
                f"in [0, 2^31) and -1 marks padding"
            )
    out = np.ascontiguousarray(array, dtype=np.int32)
    rows = max(1, CHUNK_ENTRIES // max(1, num_layers * index_topk))
    for begin in range(0, out.shape[0], rows):
        _check_rows(out[begin : begin + rows], begin, layers, index_topk, start, what)
    return out


def canonicalise(raw_TLI: Any, start: int, what: str) -> np.ndarray:
    """An engine's raw (T, L, I) choices in canonical form: positions after the query and -1 padding
    dropped, each row sorted ascending and padded with -1 at its end. Nothing else is forgiven:
    repeats, partial rows and values below -1 are left for `check_dense` (or refused here)."""
    array = _int_array(raw_TLI, what)
    if array.ndim != 3:
        raise IndexerRouteError(
            f"{what}: {array.ndim}-D array {array.shape[:6]}; expected (tokens, layers, index_topk)"
        )
    out = np.empty(array.shape, np.int32)
    num_tokens, num_layers, index_topk = array.shape
    rows = max(1, CHUNK_ENTRIES // max(1, num_layers * index_topk))
    for begin in range(0, num_tokens, rows):
        chunk = array[begin : begin + rows].astype(np.int64)
        if chunk.size and int(chunk.min()) < -1:
            t, l, _ = (int(x) for x in np.argwhere(chunk < -1)[0])
            raise IndexerRouteError(
                f"{what}: {location(row=begin + t, start=start)}, layer column {l} holds {int(chunk[t, l].min())}; "
                "positions are >= 0 and -1 marks padding"
            )
        query = start + begin + np.arange(chunk.shape[0], dtype=np.int64)
        drop = (chunk < 0) | (chunk > query[:, None, None])
        chunk[drop] = np.iinfo(np.int64).max
        chunk.sort(axis=-1)
        chunk[chunk == np.iinfo(np.int64).max] = -1
        out[begin : begin + rows] = chunk
    return out


def _int_array(value: Any, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise IndexerRouteError(f"{what}: expected a numpy integer array, got {type(value).__name__}")
    if value.dtype.kind not in "iu" or value.dtype.itemsize > 8:
        raise IndexerRouteError(f"{what}: dtype {value.dtype}; indexer positions are integers (int32 canonical)")
    return value


def _check_rows(chunk: np.ndarray, begin: int, layers: Sequence[int], index_topk: int, start: int, what: str) -> None:
    """Every canonical-form rule on rows begin .. begin + len(chunk) - 1, first failure raised."""
    valid = chunk >= 0
    count = valid.sum(axis=-1)
    query = start + begin + np.arange(chunk.shape[0], dtype=np.int64)

    def fail(mask: Any, problem: str, fix: str) -> None:
        if mask.any():
            t, l = (int(x) for x in np.argwhere(mask)[0][:2])
            raise IndexerRouteError(
                f"{what}: {location(row=begin + t, layer=layers[l], start=start)} {problem}: "
                f"{_brief(chunk[t, l])}; {fix}"
            )

    fail(
        (valid != (np.arange(index_topk) < count[..., None])).any(axis=-1),
        "has -1 before a position",
        "-1 is only trailing padding (or the whole row, for unknown)",
    )
    fail(
        (chunk > query[:, None, None]).any(axis=-1),
        "attends a key after the query position",
        "a query at position p sees keys 0..p only; drop later positions (or check `start`)",
    )
    step = chunk[..., 1:].astype(np.int64) - chunk[..., :-1]
    both = valid[..., 1:]
    fail(((step == 0) & both).any(axis=-1), "names a key position twice", "each key appears once per row")
    fail(((step < 0) & both).any(axis=-1), "is not sorted ascending", "sort each row's valid positions")
    need = np.minimum(index_topk, query + 1)
    fail(
        (count != 0) & (count != need[:, None]),
        "is a partial row (the indexer fills min(index_topk, position + 1) slots)",
        "pass the whole row, or all -1 to mark it unknown",
    )


def _brief(row: np.ndarray) -> str:
    values = row.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ... {len(values)} slots]"


__all__ = ["CHUNK_ENTRIES", "canonicalise", "check_dense", "row_need"]
