"""Searches over one column of the binomial table, the steps `SubsetUnranker` is made of.

Unranking column i (k = i + 1) asks, for every remainder q, for the largest id c with
C(c, k) <= q: a search in the sorted column C(i, k) = 0 < C(i + 1, k) < ... Three searches exist,
the fastest one that fits its memory budget is used:

- `FloatColumn`: q + 1 as float64 (exact below 2**53) falls in a bucket named by its top bits
  (exponent and m mantissa bits, m chosen so no two column entries share a bucket); a table over the
  buckets gives the candidate id, and one compare with the bucket's single entry settles it. Each
  query costs three table reads and five vector passes, whatever E is.
- `BucketSearch`: the same idea on uint64 (any q below 2**64), up to `MAX_BUCKET_WIDTH` entries a
  bucket, else a binary search.
- `LowIdTable`: for the lowest j columns at once, the remainder is the rank of a j-subset below
  C(E - K + j, j): when that is small, one read of a precomputed table gives all j ids.

Legend: N = queries, M = entries searched, B = buckets, E = experts, R = low-table rows,
W = the 4 int16 ids of one low-table word.
"""

from __future__ import annotations

import math

import numpy as np

U64_MAX = (1 << 64) - 1
FLOAT_EXACT = 1 << 53  # float64 holds every integer up to here exactly
MAX_BUCKET_WIDTH = 16  # more table entries than this in one float bucket: binary search instead
LOW_TABLE_WORD_IDS = 4  # ids of one low-table row, int16 each, packed in one uint64 word


class BucketSearch:
    """`np.searchsorted(sorted_M, q, side='right')` for uint64, ~4x faster and exact.

    Buckets by the top bits of float64(x + 1) (monotone in x): entries in a lower bucket are
    <= the query, in a higher one >; the few sharing the query's bucket are compared directly.
    Where more than `MAX_BUCKET_WIDTH` entries share a bucket, or the bucket index would take more
    than `budget_bytes`, a binary search is used instead: a query never costs more than
    O(MAX_BUCKET_WIDTH + log M), and `nbytes` (the index's size) never exceeds the budget.
    """

    __slots__ = ("base", "below_B", "mantissa", "nbytes", "padded_M", "sorted_M", "top", "width")

    def __init__(self, sorted_M: np.ndarray, budget_bytes: int) -> None:
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


class FloatColumn:
    """Column i of the unranking in float64: r = remainder + 1 gives c_i in one bucket read and one compare.

    Valid for remainders below `bound` <= 2**53 (so r and every entry are exact floats). Bucket of r:
    its float64 bits >> (52 - m), with the fewest mantissa bits m that give every column entry
    C(c, k) + 1 (c = i .. the last entry below `bound`) a bucket of its own. For each bucket from that of
    r = 1 to that of r = bound, `candidate_B` is i - 1 + the number of entries in lower buckets (all
    <= the remainder) and `threshold_B` the one entry + 1 inside the bucket (+inf when none): then
    c_i = candidate + (threshold <= r), exactly, and `values_E` gives C(c_i, k) to subtract.
    """

    __slots__ = ("base", "candidate_B", "column", "nbytes", "shift", "threshold_B", "values_E")

    def __init__(self, column: int, column_E: np.ndarray, bound: int, budget_bytes: int) -> None:
        """`column_E` = C(c, column + 1) for c < E (uint64); remainders are below `bound`; `nbytes` <= budget.

        Raises ValueError when no bucket index fits the budget (callers fall back to `BucketSearch`).
        """
        assert 1 <= bound <= FLOAT_EXACT and column_E.dtype == np.uint64
        top_id = column + int(np.count_nonzero(column_E[column:] < np.uint64(bound))) - 1
        entries_M = column_E[column : top_id + 1].astype(np.float64) + 1.0  # exact: < 2**53 + 1
        for mantissa in range(1, 53):
            shift = 52 - mantissa
            base = 1023 << mantissa  # the bucket of r = 1.0, the least r
            size = (int(np.array(float(bound)).view(np.int64)) >> shift) - base + 1
            nbytes = 17 * size + 8 * (top_id + 1)  # candidates, thresholds, a bool a bucket while built
            if nbytes > budget_bytes:
                raise ValueError(f"column {column}: no width-1 bucket index within {budget_bytes} bytes")
            bucket_M = (entries_M.view(np.int64) >> shift) - base
            if len(bucket_M) < 2 or bool((bucket_M[1:] > bucket_M[:-1]).all()):
                break
        inside_B = np.zeros(size, bool)  # built in place: the peak is `nbytes`
        inside_B[bucket_M] = True
        self.candidate_B = np.cumsum(inside_B, dtype=np.intp)
        self.candidate_B -= inside_B  # entries in lower buckets
        self.candidate_B += column - 1
        self.threshold_B = np.full(size, np.inf)
        self.threshold_B[bucket_M] = entries_M
        self.column, self.shift, self.base, self.nbytes = column, shift, base, nbytes
        self.values_E = column_E[: top_id + 1].astype(np.float64)

    def step(self, r_N: np.ndarray, ids_N: np.ndarray, work: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """c_i of each r into `ids_N` (intp), then r -= C(c_i, k); `work` = (intp, float64, bool) buffers."""
        bucket_N, value_N, above_N = work
        np.right_shift(r_N.view(np.int64), self.shift, out=bucket_N)
        np.subtract(bucket_N, self.base, out=bucket_N)
        self.candidate_B.take(bucket_N, out=ids_N, mode="clip")  # in range already: "clip" is the fast loop
        self.threshold_B.take(bucket_N, out=value_N, mode="clip")
        np.less_equal(value_N, r_N, out=above_N)
        np.add(ids_N, above_N, out=ids_N)
        self.values_E.take(ids_N, out=value_N, mode="clip")
        np.subtract(r_N, value_N, out=r_N)


class LowIdTable:
    """The ids c_0 < ... < c_{j-1} of every j-subset rank below C(E - K + j, j), one uint64 word a row.

    Unranking the lowest j columns of a K-subset of E (remainder < C(c_j, j) <= C(E - K + j, j)) is then
    one read: `words_R[remainder]` holds c_0 .. c_{j-1} as int16 (j <= 4; unused lanes 0). Built level
    by level: the rows of rank C(c, j) .. C(c + 1, j) - 1 are the (j - 1)-subsets of ids below c, then c.
    Building peaks at this level's rows plus the previous level's (at most 2x `nbytes`).
    """

    __slots__ = ("depth", "nbytes", "words_R")

    def __init__(self, num_experts: int, top_k: int, depth: int) -> None:
        assert 2 <= depth <= min(top_k, LOW_TABLE_WORD_IDS) and num_experts - top_k + depth <= np.iinfo(np.int16).max
        spare = num_experts - top_k  # c_{j-1} <= E - K + j - 1
        level_RW = np.zeros((spare + 1, LOW_TABLE_WORD_IDS), np.int16)
        level_RW[:, 0] = np.arange(spare + 1)
        for size in range(2, depth + 1):
            previous_RW = level_RW
            level_RW = np.zeros((math.comb(spare + size, size), LOW_TABLE_WORD_IDS), np.int16)
            for c in range(size - 1, spare + size):
                first, stop = math.comb(c, size), math.comb(c + 1, size)
                level_RW[first:stop] = previous_RW[: stop - first]  # whole rows: lanes >= size - 1 are 0
                level_RW[first:stop, size - 1] = c
        self.depth, self.nbytes = depth, level_RW.nbytes
        self.words_R = level_RW.view(np.uint64).ravel()

    @staticmethod
    def rows(num_experts: int, top_k: int, depth: int) -> int:
        """Rows of the table of the lowest `depth` ids of K-subsets of E (8 bytes each)."""
        return math.comb(num_experts - top_k + depth, depth)

    def ids_into(self, remainder_N: np.ndarray, out_NK: np.ndarray, words_N: np.ndarray) -> None:
        """Ids c_0 .. c_{j-1} of each remainder (intp) into `out_NK[:, :j]`; `words_N` is a uint64 buffer."""
        self.words_R.take(remainder_N, out=words_N, mode="clip")
        ids_NW = words_N.view(np.int16).reshape(-1, LOW_TABLE_WORD_IDS)
        for j in range(self.depth):  # one column at a time: numpy copies an (N, j) block row by row
            out_NK[:, j] = ids_NW[:, j]


__all__ = [
    "FLOAT_EXACT",
    "LOW_TABLE_WORD_IDS",
    "MAX_BUCKET_WIDTH",
    "U64_MAX",
    "BucketSearch",
    "FloatColumn",
    "LowIdTable",
]
