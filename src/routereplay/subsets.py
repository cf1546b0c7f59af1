"""The combinatorial number system: K-subsets of E experts <-> integer ranks in [0, C(E, K)).

A sorted row c_0 < ... < c_{K-1} has rank sum_i C(c_i, i + 1). Ranking is K table lookups per
row; unranking walks ids from the largest down, finding for each the largest c with
C(c, i + 1) <= remainder. Both are vectorised over rows. Ranks below 2**64 are uint64; wider ones
(C(E, K) >= 2**64, e.g. E=512, K=10) use exact Python ints in object arrays (slower, still exact).

Cost: the table is (K + 1) x E entries built in K vector passes (uint64 with saturation, no Python
ints unless C(E, K) >= 2**64); `SubsetUnranker` prepares one search per column once, then each
batch of N ranks costs K - 1 vector passes of O(N) (at most `MAX_BUCKET_WIDTH` compares per query,
else a binary search), so decoding in fixed-size batches keeps the work linear in the ids decoded.
Memory: the table (8 bytes an entry; about 40 + 4 * ceil(bits / 64) bytes for a Python int) plus the
column searches' bucket indexes, at most `SEARCH_BUDGET_BYTES` together.
Legend: N = rows, K = top-k, E = experts, J = K + 1 table rows, M = entries searched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

U64_MAX = (1 << 64) - 1
MAX_BUCKET_WIDTH = 16  # more table entries than this in one float bucket: binary search instead
SEARCH_BUDGET_BYTES = 8 << 20  # bucket indexes of all columns together; beyond it, binary search


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


class _BucketSearch:
    """`np.searchsorted(sorted_M, q, side='right')` for uint64, ~4x faster and exact.

    Buckets by the top bits of float64(x + 1) (monotone in x): entries in a lower bucket are
    <= the query, in a higher one >; the few sharing the query's bucket are compared directly.
    Where more than `MAX_BUCKET_WIDTH` entries share a bucket, or the bucket index would take more
    than `budget_bytes`, a binary search is used instead: a query never costs more than
    O(MAX_BUCKET_WIDTH + log M), and `nbytes` (the index's size) never exceeds the budget.
    """

    __slots__ = ("base", "below_B", "mantissa", "nbytes", "padded_M", "sorted_M", "top", "width")

    def __init__(self, sorted_M: np.ndarray, budget_bytes: int = SEARCH_BUDGET_BYTES) -> None:
        self.sorted_M = sorted_M
        self.mantissa = min(12, max(4, len(sorted_M).bit_length()))
        self.width, self.nbytes = 0, 0
        if len(sorted_M) == 0:
            return
        self.width = -1  # binary search, unless the bucket index is small and sharp enough
        self.base = int(self._bucket(sorted_M[:1])[0])
        self.top = int(self._bucket(sorted_M[-1:])[0]) + 1
        nbytes = 8 * (self.top - self.base + 1 + 2 * len(sorted_M) + MAX_BUCKET_WIDTH)
        if nbytes > budget_bytes:
            return
        bucket_M = self._bucket(sorted_M)
        width = int(np.unique(bucket_M, return_counts=True)[1].max())
        if width > MAX_BUCKET_WIDTH:
            return
        self.width, self.nbytes = width, nbytes
        self.below_B = np.searchsorted(bucket_M, np.arange(self.base, self.top + 1), side="left")
        self.padded_M = np.concatenate([sorted_M, np.full(width, U64_MAX, np.uint64)])

    def _bucket(self, x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float64) + 1.0).view(np.int64) >> (52 - self.mantissa)

    def count_at_most(self, queries_N: np.ndarray) -> np.ndarray:
        if self.width == 0:
            return np.zeros(len(queries_N), np.int64)
        if self.width < 0:
            return np.searchsorted(self.sorted_M, queries_N, side="right").astype(np.int64)
        start_N = self.below_B[np.clip(self._bucket(queries_N), self.base, self.top) - self.base]
        counts_N = start_N.copy()
        for offset in range(self.width):
            counts_N += self.padded_M[start_N + offset] <= queries_N
        return counts_N


def count_at_most(sorted_M: np.ndarray, queries_N: np.ndarray) -> np.ndarray:
    """np.searchsorted(sorted_M, queries_N, side='right') for uint64 (see `_BucketSearch`)."""
    return _BucketSearch(sorted_M).count_at_most(queries_N)


class SubsetUnranker:
    """Unranks batches of ranks of K-subsets of E, with the table and per-column searches built once."""

    __slots__ = ("searches", "table_JE", "top_k")

    def __init__(self, table_JE: np.ndarray, count: int) -> None:
        """`table_JE` from `binomial_table(E, K, count)`, `count` = C(E, K)."""
        self.table_JE, self.top_k = table_JE, table_JE.shape[0] - 1
        self.searches: dict[int, _BucketSearch] = {}
        budget = SEARCH_BUDGET_BYTES
        if table_JE.dtype != object:
            for i in range(self.top_k - 1, 0, -1):
                # ids below i have C(c, i + 1) = 0 and clamped entries exceed every rank: skip both
                column_E = table_JE[i + 1]
                search = _BucketSearch(column_E[i : int(np.count_nonzero(column_E < count))], budget)
                self.searches[i] = search
                budget -= search.nbytes

    def unrank(self, ranks_N: np.ndarray, out_NK: np.ndarray) -> None:
        """Write rows c_0 < ... < c_{K-1} with sum_i C(c_i, i + 1) = rank into `out_NK`."""
        remainder_N = ranks_N.copy()
        for i in range(self.top_k - 1, 0, -1):
            column_E = self.table_JE[i + 1]
            if column_E.dtype == object:  # C(E, K) >= 2**64: exact Python ints
                c_N = np.searchsorted(column_E, remainder_N, side="right") - 1
            else:
                c_N = self.searches[i].count_at_most(remainder_N) + (i - 1)
            out_NK[:, i] = c_N
            remainder_N -= column_E[c_N]
        out_NK[:, 0] = remainder_N  # C(c, 1) = c


def unrank_subsets(ranks_N: np.ndarray, table_JE: np.ndarray, count: int, dtype: Any) -> np.ndarray:
    """Rows c_0 < ... < c_{K-1} with sum_i C(c_i, i + 1) = rank, as a new (N, K) array of `dtype`."""
    experts_NK = np.empty((len(ranks_N), table_JE.shape[0] - 1), dtype)
    SubsetUnranker(table_JE, count).unrank(ranks_N, experts_NK)
    return experts_NK


__all__ = [
    "MAX_BUCKET_WIDTH",
    "U64_MAX",
    "SubsetUnranker",
    "binomial_table",
    "count_at_most",
    "rank_subsets",
    "unrank_subsets",
]
