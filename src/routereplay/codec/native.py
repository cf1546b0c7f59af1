"""The set codec's C kernel (`set_kernel.c`, built at install when a C compiler is there), and when it applies.

Two loops of the set codec run there on blocks of rows, with the same arithmetic and the same tables
as the numpy paths, which stay the reference and the fallback:

- `pack_set_rows`: validation fused with encoding. Each row is range-checked, sorted by the merge
  network of `ranker.py`, checked for repeats and -1 mixing, ranked against `binomial_table` and
  bit-packed, so each id is read once. A bad row stops it; the caller then runs the full validation
  catalogue, which names the fault.
- `unrank_set_rows`: reads ranks from a payload, checks each below C(E, K) and unranks it with the
  `SubsetUnranker`'s own `FloatColumn` tables (one per column from K - 1 down to 1), writing -1 for
  rows the bitmap marks unrouted.

The kernel encodes set mode with E <= 32767, 2 <= K <= 64 and 1 <= b <= 64 bits a rank, and decodes
it with K <= 64 and C(E, K) <= 2**53 where every column fits a `FloatColumn` (int16 or int32 rows;
E = 128 and 256 with top-8 do). Anything else, or an install without the kernel, runs the numpy
path. `KERNEL_STATUS` says which, for `routereplay env`.

Alignment: the kernel reads and writes typed memory (int16 ... int64 rows, uint64 / float64 tables), so
every buffer it gets sits at a multiple of its item size (the kernel refuses any other). Inputs here are
copied to aligned memory when they are not (`np.require(..., ("C", "A"))`: a trace on a numpy view at an odd
byte offset); an output must already be aligned (`can_unrank_into`), and `RankBundle.decode(out=)`
refuses a misaligned one by name.
Legend: R = rows, K = top-k, E = experts, J = K + 1 table rows, P = comparators of the network.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from routereplay.codec.column_search import FLOAT_EXACT, FloatColumn
from routereplay.codec.ranker import MAX_NETWORK_K, merge_network
from routereplay.codec.subsets import SEARCH_BUDGET_BYTES, SubsetUnranker

KERNEL_MODULE = "routereplay.codec._set_kernel"


def _load() -> tuple[ModuleType | None, str]:
    # import_module, not `from routereplay.codec import _set_kernel`: this runs while routereplay.codec is still
    # initialising, and the `from` form reports a missing extension as a "partially initialized module" (circular
    # import) error instead of the missing module it is
    try:
        kernel = importlib.import_module(KERNEL_MODULE)
    except ModuleNotFoundError as error:
        if error.name != KERNEL_MODULE:
            raise
        return None, "not built (no C compiler at install time); the numpy set codec is used"
    except ImportError as error:  # built, but does not load (e.g. built against another Python)
        return None, f"not loadable ({error}); the numpy set codec is used (reinstall with a C compiler to rebuild it)"
    return kernel, "built (C kernel for set-mode encode/decode)"


KERNEL, KERNEL_STATUS = _load()
MAX_KERNEL_EXPERTS = (1 << 15) - 1  # the kernel sorts ids as int16
DECODE_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))


@dataclass(frozen=True, slots=True)
class PackedRows:
    """What `pack_set_rows` made: the raw payload (bitmap, when some row is unrouted, then the ranks),
    or `bad_row` >= 0, the first row that failed validation (the payload is then empty)."""

    payload: memoryview
    has_missing: bool
    bad_row: int


def can_pack(num_experts: int, top_k: int, bits: int) -> bool:
    """Whether `pack_set_rows` handles this geometry (else: `RouteTrace.validate` and the numpy encoder).

    1 <= bits <= 64 means 2 <= C(E, K) <= 2**64, so the binomial table is uint64 and exact."""
    return KERNEL is not None and 2 <= top_k <= MAX_NETWORK_K and num_experts <= MAX_KERNEL_EXPERTS and 1 <= bits <= 64


def pack_set_rows(experts_RK: np.ndarray, num_experts: int, table_JE: np.ndarray, bits: int) -> PackedRows:
    """Validate, rank and pack the (R, K) rows in one pass (needs `can_pack`).

    The payload buffer is allocated once at its largest size (every row routed) and returned as a
    view of the bytes actually written.
    """
    assert KERNEL is not None
    rows, top_k = experts_RK.shape
    network_P2 = np.asarray(merge_network(top_k), np.int32).reshape(-1, 2)
    bitmap_bytes = -(-rows // 8)
    buffer_B = np.zeros(bitmap_bytes + -(-rows * bits // 8), np.uint8)
    routed, bad_row = KERNEL.rank_pack(
        np.require(experts_RK, requirements=("C", "A")),  # a misaligned view (odd byte offset) is copied
        num_experts,
        np.require(table_JE, requirements=("C", "A")),
        network_P2,
        bits,
        buffer_B[:bitmap_bytes],
        buffer_B[bitmap_bytes:],
    )
    view = buffer_B.data
    if bad_row >= 0:
        return PackedRows(view[:0], False, int(bad_row))
    stream_bytes = -(-routed * bits // 8)
    if routed == rows:
        return PackedRows(view[bitmap_bytes : bitmap_bytes + stream_bytes], False, -1)
    return PackedRows(view[: bitmap_bytes + stream_bytes], True, -1)


@dataclass(frozen=True, slots=True)
class UnrankPlan:
    """The kernel's arguments taken from one `SubsetUnranker`: its float columns, K - 1 down to 1."""

    count: int
    columns: list[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]]


def may_unrank(count: int, top_k: int) -> bool:
    """Whether the kernel can decode ranks of C(E, K) = `count` (its float columns need ranks below
    2**53). Where it can, an unranker needs no low-id table (`SubsetUnranker(rows=0)`)."""
    return KERNEL is not None and 2 <= count <= FLOAT_EXACT and top_k <= MAX_NETWORK_K


def unrank_plan(unranker: SubsetUnranker | None, count: int) -> UnrankPlan | None:
    """The plan for `unranker` when the kernel can walk it (every column a `FloatColumn`), else None;
    decided once per unranker (kept on it, `False` when the kernel cannot walk it).

    The kernel walks every column down to 1 with float columns and never reads the unranker's low-id
    table: a table of megabytes read at random is slower there than two more float columns of a few
    KB (measured 62 M against 72 M rows/s for top-8 of 128; the numpy path keeps the table)."""
    if unranker is None or not may_unrank(count, unranker.top_k) or unranker.table_JE.dtype != np.uint64:
        return None
    if unranker.kernel_plan is None:
        unranker.kernel_plan = _plan_of(unranker, count) or False
    return unranker.kernel_plan or None


def _plan_of(unranker: SubsetUnranker, count: int) -> UnrankPlan | None:
    searches: list[FloatColumn] = []
    for i in range(unranker.top_k - 1, 0, -1):
        search = unranker.searches.get(i) or unranker.column_search(i, count, SEARCH_BUDGET_BYTES)
        if not isinstance(search, FloatColumn):
            return None
        searches.append(search)
    return UnrankPlan(count, [_padded_column(search) for search in searches])


def _padded_column(search: FloatColumn) -> tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]:
    """A column's tables padded to powers of two (the kernel masks its indexes into them, so even a
    wrong index stays inside): buckets past the end never match (+inf), ids past the last subtract 0."""
    buckets, ids = len(search.candidate_B), len(search.values_E)
    candidate_B = np.full(1 << (buckets - 1).bit_length(), len(search.values_E) - 1, np.int64)
    candidate_B[:buckets] = search.candidate_B
    threshold_B = np.full(len(candidate_B), np.inf)
    threshold_B[:buckets] = search.threshold_B
    values_E = np.zeros(1 << (ids - 1).bit_length(), np.float64)
    values_E[:ids] = search.values_E
    return search.column, search.shift, search.base, candidate_B, threshold_B, values_E


def unrank_set_rows(
    plan: UnrankPlan,
    payload: Any,
    out_RK: np.ndarray,
    bits: int,
    *,
    stream_offset: int,
    first: int = 0,
    bitmap_bytes: int = 0,
) -> int:
    """Decode into `out_RK` (C-contiguous, aligned int16/int32: `can_unrank_into`): -1 rows where the
    payload's bitmap (its first `bitmap_bytes`, 0 = none) has 0, else routed rows `first`, `first` + 1, ...
    of the stream.

    Returns -1, or the routed row (from `first`) whose rank is >= C(E, K), or -2 when the stream ends
    first. Callers check lengths and padding bits before (`PayloadDecoder._check_streams`).
    """
    assert KERNEL is not None
    rows, top_k = out_RK.shape
    return int(
        KERNEL.unrank(
            payload,
            bitmap_bytes,
            stream_offset,
            first,
            rows,
            top_k,
            bits,
            plan.count,
            plan.columns,
            out_RK,
            out_RK.dtype.itemsize,
        )
    )


def can_unrank_into(out_RK: np.ndarray) -> bool:
    """Whether `out_RK` is an output the kernel writes (C-contiguous, aligned, native int16 or int32, 2-d)."""
    return out_RK.ndim == 2 and out_RK.dtype in DECODE_DTYPES and out_RK.flags.c_contiguous and out_RK.flags.aligned


__all__ = [
    "KERNEL_STATUS",
    "MAX_KERNEL_EXPERTS",
    "PackedRows",
    "UnrankPlan",
    "can_pack",
    "can_unrank_into",
    "may_unrank",
    "pack_set_rows",
    "unrank_plan",
    "unrank_set_rows",
]
