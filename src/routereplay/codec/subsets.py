"""The combinatorial number system: K-subsets of E experts <-> integer ranks in [0, C(E, K)).

A sorted row c_0 < ... < c_{K-1} has rank sum_i C(c_i, i + 1). Ranking is K table lookups per
row; unranking walks ids from the largest down, finding for each the largest c with
C(c, i + 1) <= remainder (the searches of `routereplay.codec.column_search`). Both are vectorised over
rows. Ranks below 2**64 are uint64; wider ones (C(E, K) >= 2**64, e.g. E=512, K=10) use exact
Python ints in object arrays (slower, still exact).

Cost: the table is (K + 1) x E entries built in K vector passes (uint64 with saturation, no Python
ints unless C(E, K) >= 2**64); `SubsetUnranker` prepares one search per column once, then each
batch of N ranks costs about 8 vector passes of O(N) a column (a `FloatColumn`: three table reads,
no compare loop), fewer for the lowest columns when a `LowIdTable` reads them at once, so decoding
in fixed-size batches keeps the work linear in the ids decoded.
Memory: the table (8 bytes an entry; about 40 + 4 * ceil(bits / 64) bytes for a Python int), the
column searches (at most `SEARCH_BUDGET_BYTES` together), the low-id table (at most
`LOW_TABLE_BUDGET_BYTES`, under twice that while it is built) and, per `unrank` call, seven work
arrays of N (under 60 bytes a rank).
Output: int16 rows of K % 4 == 0 ids (little-endian, 8-byte aligned rows) get ids 0 .. 3 as one
uint64 word (the low-id table's word, with id 3 OR-ed in when the table holds three), not four
strided int16 column writes; `rank_subsets` is the plain reference of `ranker.SubsetRanker`.
Legend: N = rows, K = top-k, E = experts, J = K + 1 table rows, W = uint64 words of 4 int16 ids.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from routereplay.codec.column_search import (
    FLOAT_EXACT,
    LOW_TABLE_WORD_IDS,
    MAX_BUCKET_WIDTH,
    U64_MAX,
    BucketSearch,
    FloatColumn,
    LowIdTable,
)

SEARCH_BUDGET_BYTES = 8 << 20  # column search indexes together; beyond it, slower searches
LOW_TABLE_BUDGET_BYTES = 4 << 20  # the low-id table (8 bytes a row): E = 128, K = 8 reads 3 ids at once
LOW_TABLE_MIN_DEPTH = 3  # a table of 2 ids is no faster than the one column search it replaces
LOW_TABLE_MIN_USES = 2  # build it only for >= 2 ranks per table row: it costs ~6 ns a row, saves ~3 a rank


def binomial_table(num_experts: int, top_k: int, count: int) -> np.ndarray:
    """(K + 1, E) table[j, c] = min(C(c, j), count): uint64 when count < 2**64, else Python ints."""
    if count > U64_MAX:
        rows = [np.ones(num_experts, dtype=object)]
        for _ in range(top_k):
            row = np.zeros(num_experts, dtype=object)
            row[1:] = np.cumsum(rows[-1][:-1])  # C(c, j) = sum_{m < c} C(m, j - 1)
            rows.append(np.minimum(row, count))  # clamped entries are never a term of a valid rank
        return np.stack(rows)
    table_JE = np.zeros((top_k + 1, num_experts), np.uint64)
    table_JE[0] = 1
    bound = np.uint64(count)
    for j in range(1, top_k + 1):
        sums = np.cumsum(table_JE[j - 1, :-1], dtype=np.uint64)  # wraps silently past 2**64 - 1
        # every term is < 2**64, so the first wrap shows as a decrease; the exact sums from there on
        # are >= 2**64 > count, and so are all sums above count: both clamp to count
        wrapped = np.flatnonzero(sums[1:] < sums[:-1])
        if wrapped.size:
            sums[int(wrapped[0]) + 1 :] = bound
        np.minimum(sums, bound, out=sums)
        table_JE[j, 1:] = sums
    return table_JE


def rank_subsets(experts_NK: np.ndarray, table_JE: np.ndarray) -> np.ndarray:
    """Rank of each row's id set (the order inside a row does not matter)."""
    sorted_NK = np.sort(experts_NK, axis=1)
    ranks_N = np.zeros(len(sorted_NK), table_JE.dtype)
    for i in range(sorted_NK.shape[1]):
        ranks_N += table_JE[i + 1][sorted_NK[:, i]]
    return ranks_N


def count_at_most(sorted_M: np.ndarray, queries_N: np.ndarray) -> np.ndarray:
    """np.searchsorted(sorted_M, queries_N, side='right') for uint64 (see `BucketSearch`)."""
    return BucketSearch(sorted_M, SEARCH_BUDGET_BYTES).count_at_most(queries_N)


class SubsetUnranker:
    """Unranks batches of ranks of K-subsets of E, with the table and per-column searches built once.

    Column i (k = i + 1, from K - 1 down) gets a `FloatColumn` when every remainder it can see is
    below 2**53 and its index fits what is left of `search_budget_bytes`, else a `BucketSearch` on
    uint64. Given `rows` (how many ranks this object will unrank in all), the lowest j (3 or 4) columns
    become one `LowIdTable` read when that table fits `LOW_TABLE_BUDGET_BYTES` and `rows` pays for
    building it (rows >= `LOW_TABLE_MIN_USES` x its rows); with the default rows=0 it is never built.
    `unrank` allocates its work arrays per call, so one object may serve several threads. Ranks
    must be below C(E, K): callers check (an out-of-range rank gives a wrong row, not an error).
    """

    __slots__ = ("in_uint64", "kernel_plan", "low_table", "nbytes", "needs_work", "searches", "table_JE", "top_k")

    def __init__(
        self, table_JE: np.ndarray, count: int, *, rows: int = 0, search_budget_bytes: int = SEARCH_BUDGET_BYTES
    ) -> None:
        """`table_JE` from `binomial_table(E, K, count)`, `count` = C(E, K); `rows`: see the class docstring.

        `nbytes` is what the searches and the low-id table hold (the table itself not included).
        """
        self.table_JE, self.top_k = table_JE, table_JE.shape[0] - 1
        K, E = self.top_k, table_JE.shape[1]
        self.searches: dict[int, FloatColumn | BucketSearch] = {}  # column -> search, K - 1 first
        self.low_table: LowIdTable | None = None
        self.in_uint64, self.needs_work, self.nbytes = False, False, 0
        self.kernel_plan: Any = None  # `codec.native.unrank_plan`'s verdict: None until asked, then a plan or False
        if table_JE.dtype == object:
            return
        for depth in range(min(K, LOW_TABLE_WORD_IDS), LOW_TABLE_MIN_DEPTH - 1, -1):
            table_rows = LowIdTable.rows(E, K, depth)
            if 8 * table_rows <= LOW_TABLE_BUDGET_BYTES and rows >= LOW_TABLE_MIN_USES * table_rows:
                self.low_table = LowIdTable(E, K, depth)
                break
        budget = search_budget_bytes
        for i in range(K - 1, self.low_table.depth - 1 if self.low_table else 0, -1):
            self.searches[i] = self.column_search(i, count, budget)
            budget -= self.searches[i].nbytes
        self.in_uint64 = any(isinstance(search, BucketSearch) for search in self.searches.values())
        self.needs_work = self.low_table is not None or not all(
            isinstance(search, BucketSearch) for search in self.searches.values()
        )
        self.nbytes = search_budget_bytes - budget + (self.low_table.nbytes if self.low_table else 0)

    def column_search(self, i: int, count: int, budget: int) -> FloatColumn | BucketSearch:
        """The search of column i: a `FloatColumn` where its remainders fit float64 and its index fits
        `budget` bytes, else a `BucketSearch`."""
        K, E = self.top_k, self.table_JE.shape[1]
        column_E = self.table_JE[i + 1]
        bound = math.comb(E - K + i + 1, i + 1)  # remainder < C(c_{i+1}, i + 1), c_{i+1} <= E - K + i + 1
        if bound <= FLOAT_EXACT:
            try:
                return FloatColumn(i, column_E, bound, budget)
            except ValueError:  # its index is over the budget left
                pass
        # ids below i have C(c, i + 1) = 0 and clamped entries exceed every rank: skip both
        return BucketSearch(column_E[i : int(np.count_nonzero(column_E < count))], budget)

    def unrank(self, ranks_N: np.ndarray, out_NK: np.ndarray) -> None:
        """Write rows c_0 < ... < c_{K-1} with sum_i C(c_i, i + 1) = rank into `out_NK`."""
        if self.table_JE.dtype == object:  # C(E, K) >= 2**64: exact Python ints
            self._unrank_wide(ranks_N, out_NK)
            return
        n = len(ranks_N) if self.needs_work else 0  # no work arrays when all is uint64 (K = 1)
        words_NW = self._word_view(out_NK)
        low_lane_N: np.ndarray | None = None  # id 3 shifted into lane 3 of the low table's word
        ids_N = np.empty(n, np.intp)
        work = (np.empty(n, np.intp), np.empty(n, np.float64), np.empty(n, bool))
        r_N = np.empty(n, np.float64)  # remainder + 1, while the walk is in float64
        remainder_N = ranks_N.astype(np.uint64) if self.in_uint64 else ranks_N  # copied when it changes
        in_float = False
        for i, search in self.searches.items():
            if isinstance(search, FloatColumn):
                if not in_float:
                    np.add(remainder_N, 1.0, out=r_N)  # exact: every remainder here is below 2**53
                    in_float = True
                search.step(r_N, ids_N, work)
                if words_NW is not None and i == LOW_TABLE_WORD_IDS - 1:  # the low table holds ids 0 .. 2
                    low_lane_N = np.left_shift(ids_N.view(np.uint64), 16 * i)  # written with the low word
                else:
                    out_NK[:, i] = ids_N
                continue
            if in_float:
                np.subtract(r_N, 1.0, out=remainder_N, casting="unsafe")
                in_float = False
            c_N = search.count_at_most(remainder_N) + (i - 1)
            out_NK[:, i] = c_N
            remainder_N -= self.table_JE[i + 1][c_N]
        if self.low_table is None:  # C(c, 1) = c
            if in_float:
                np.subtract(r_N, 1.0, out=out_NK[:, 0], casting="unsafe")
            else:
                out_NK[:, 0] = remainder_N
            return
        if in_float:
            np.subtract(r_N, 1.0, out=ids_N, casting="unsafe")
        else:
            np.copyto(ids_N, remainder_N, casting="unsafe")
        if words_NW is not None and self.low_table.depth == LOW_TABLE_WORD_IDS:  # the word is ids 0 .. 3
            self.low_table.words_R.take(ids_N, out=words_NW[:, 0], mode="clip")
            return
        if words_NW is not None and low_lane_N is not None:  # one 8-byte write of ids 0 .. 3 a row
            self.low_table.words_R.take(ids_N, out=work[1].view(np.uint64), mode="clip")
            np.bitwise_or(work[1].view(np.uint64), low_lane_N, out=words_NW[:, 0])
            return
        self.low_table.ids_into(ids_N, out_NK, work[1].view(np.uint64))

    def _word_view(self, out_NK: np.ndarray) -> np.ndarray | None:
        """`out_NK` as (N, K / 4) little-endian uint64 words of 4 int16 ids, when the low table's
        word can be written whole (ids 0 .. 3 from it, or ids 0 .. 2 and id 3 OR-ed in); else None."""
        low = self.low_table
        if low is None or low.depth < LOW_TABLE_WORD_IDS - 1 or self.top_k % LOW_TABLE_WORD_IDS:
            return None
        if out_NK.dtype != np.dtype("<i2") or out_NK.strides[1] != 2 or out_NK.strides[0] % 8 or len(out_NK) == 0:
            return None
        if out_NK.ctypes.data % 8:
            return None
        return out_NK.view("<u8")

    def _unrank_wide(self, ranks_N: np.ndarray, out_NK: np.ndarray) -> None:
        remainder_N = ranks_N.copy()
        for i in range(self.top_k - 1, 0, -1):
            column_E = self.table_JE[i + 1]
            c_N = np.searchsorted(column_E, remainder_N, side="right") - 1
            out_NK[:, i] = c_N
            remainder_N -= column_E[c_N]
        out_NK[:, 0] = remainder_N


def unrank_subsets(ranks_N: np.ndarray, table_JE: np.ndarray, count: int, dtype: Any) -> np.ndarray:
    """Rows c_0 < ... < c_{K-1} with sum_i C(c_i, i + 1) = rank, as a new (N, K) array of `dtype`."""
    experts_NK = np.empty((len(ranks_N), table_JE.shape[0] - 1), dtype)
    SubsetUnranker(table_JE, count, rows=len(ranks_N)).unrank(ranks_N, experts_NK)
    return experts_NK


__all__ = [
    "LOW_TABLE_BUDGET_BYTES",
    "LOW_TABLE_MIN_DEPTH",
    "LOW_TABLE_MIN_USES",
    "MAX_BUCKET_WIDTH",
    "SEARCH_BUDGET_BYTES",
    "U64_MAX",
    "SubsetUnranker",
    "binomial_table",
    "count_at_most",
    "rank_subsets",
    "unrank_subsets",
]
