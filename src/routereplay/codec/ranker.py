"""Fast set-mode ranking: rows of K distinct ids -> their combinatorial-number-system ranks, in chunks.

`rank_subsets` (the reference) sorts every row with `np.sort(axis=1)` (a per-row call, slow for small
K) and adds K gathered table entries. `SubsetRanker` does the same arithmetic on a chunk of C rows
laid out as K contiguous columns:

- sorting: a Batcher odd-even merge network of comparators (19 for K = 8), each an elementwise
  `np.minimum` / `np.maximum` of two columns; after it, column i holds every row's c_i;
- ranking: rank = sum_i C(c_i, i + 1). Columns are taken in pairs (i, i + 1) with one gather from a
  pair table P[c_i * E + c_{i+1}] = C(c_i, i + 1) + C(c_{i+1}, i + 2) when those tables fit
  `PAIR_TABLE_BUDGET_BYTES` (E = 128: 4 tables of 128 KiB), else one gather per column.

The ranks are the reference's exactly (same integers; the sum of a valid row's terms is its rank,
below C(E, K) < 2**64, so nothing saturates). Rows must be valid (ids in [0, E), distinct within a
row: what `RouteTrace.validate` guarantees before `encode`); invalid rows get some rank, no error.
Memory: the pair tables (at most `PAIR_TABLE_BUDGET_BYTES`) and per chunk K + 1 columns of C ids
plus two arrays of C words: a fixed working set, whatever N.
Legend: N = rows, C = rows of one chunk, K = top-k, E = experts, J = K + 1 table rows.
"""

from __future__ import annotations

import numpy as np

from routereplay.codec.subsets import rank_subsets

RANK_CHUNK_ROWS = 1 << 15  # rows ranked per step: K int16 columns + two word arrays stay in L2
MAX_NETWORK_K = 64  # above this many ids a row, np.sort is as fast as a network of comparators
PAIR_TABLE_BUDGET_BYTES = 4 << 20  # pair tables together (E = 256, K = 8: 2 MiB)


def merge_network(size: int) -> list[tuple[int, int]]:
    """Comparators (a, b), a < b, of Batcher's odd-even merge sort for `size` items, in order.

    Built for the next power of two and restricted to a, b < size: the missing items act as +inf
    at the top, which a comparator never moves down, so the restriction still sorts.
    """
    comparators: list[tuple[int, int]] = []
    width = 1
    while width < size:
        width *= 2
    p = 1
    while p < width:
        k = p
        while k >= 1:
            for j in range(k % p, width - k, 2 * k):
                for i in range(min(k, width - j - k)):
                    a, b = i + j, i + j + k
                    if (a // (2 * p)) == (b // (2 * p)) and b < size:
                        comparators.append((a, b))
            k //= 2
        p *= 2
    return comparators


class SubsetRanker:
    """Ranks rows of K distinct ids of E (any order inside a row) against `table_JE`, chunk by chunk.

    `table_JE` is `binomial_table(E, K, count)` with count = C(E, K) < 2**64 (uint64); wider tables,
    and K > `MAX_NETWORK_K`, use `rank_subsets` (`fast` is False then).
    """

    __slots__ = ("fast", "network", "num_experts", "pair_tables", "table_JE", "top_k")

    def __init__(self, table_JE: np.ndarray) -> None:
        self.table_JE = table_JE
        self.top_k, self.num_experts = table_JE.shape[0] - 1, table_JE.shape[1]
        K, E = self.top_k, self.num_experts
        self.fast = table_JE.dtype == np.uint64 and K <= MAX_NETWORK_K
        self.network = merge_network(K) if self.fast else []
        self.pair_tables: list[np.ndarray] = []  # pair m: columns 2m, 2m + 1, flattened (E * E,)
        if self.fast and K >= 2 and 8 * E * E * (K // 2) <= PAIR_TABLE_BUDGET_BYTES:
            for i in range(0, K - 1, 2):
                pair_EE = table_JE[i + 1][:, None] + table_JE[i + 2][None, :]  # valid pairs never wrap
                self.pair_tables.append(pair_EE.ravel())

    def rank(self, experts_NK: np.ndarray) -> np.ndarray:
        """(N,) ranks of the rows (uint64 when `fast`, else as `rank_subsets` gives them)."""
        if not self.fast:
            return rank_subsets(experts_NK, self.table_JE)
        ranks_N = np.empty(len(experts_NK), np.uint64)
        for r0 in range(0, len(experts_NK), RANK_CHUNK_ROWS):
            self.rank_into(experts_NK[r0 : r0 + RANK_CHUNK_ROWS], ranks_N[r0 : r0 + RANK_CHUNK_ROWS])
        return ranks_N

    def rank_into(self, experts_CK: np.ndarray, out_C: np.ndarray) -> None:
        """Ranks of one chunk of rows into `out_C` (uint64, C); needs `fast`."""
        K, E, n = self.top_k, self.num_experts, len(experts_CK)
        ids_dtype = np.uint8 if E <= 256 else np.int16 if E <= np.iinfo(np.int16).max else np.int32
        columns_KC = np.empty((K, n), ids_dtype)
        np.copyto(columns_KC.T, experts_CK, casting="unsafe")  # one transposing copy: contiguous columns
        columns = list(columns_KC)
        spare_C = np.empty(n, ids_dtype)
        for a, b in self.network:  # column a takes the min, b the max; the min lands in the spare
            np.minimum(columns[a], columns[b], out=spare_C)
            np.maximum(columns[a], columns[b], out=columns[b])
            columns[a], spare_C = spare_C, columns[a]
        index_C = np.empty(n, np.intp)
        pair_dtype = np.uint16 if E * E <= 1 << 16 else np.intp  # narrow lanes: about twice as fast
        pair_C = np.empty(n, pair_dtype)
        term_C = np.empty(n, np.uint64)
        first = True
        for i, table_E, step in self._terms():
            if step == 2:  # index c_i * E + c_{i+1} into the pair table
                np.multiply(columns[i], E, out=pair_C, dtype=pair_dtype)  # c * E overflows the id dtype
                np.add(pair_C, columns[i + 1], out=pair_C, dtype=pair_dtype)
                np.copyto(index_C, pair_C)
            else:
                np.copyto(index_C, columns[i], casting="unsafe")
            table_E.take(index_C, out=out_C if first else term_C, mode="clip")  # in range: "clip" is the fast loop
            if not first:
                np.add(out_C, term_C, out=out_C)
            first = False

    def _terms(self) -> list[tuple[int, np.ndarray, int]]:
        """(first column, table, columns read) of each gather, covering columns 0 .. K - 1 once."""
        terms = [(2 * m, table, 2) for m, table in enumerate(self.pair_tables)]
        for i in range(2 * len(self.pair_tables), self.top_k):
            terms.append((i, self.table_JE[i + 1], 1))
        return terms


__all__ = ["MAX_NETWORK_K", "PAIR_TABLE_BUDGET_BYTES", "RANK_CHUNK_ROWS", "SubsetRanker", "merge_network"]
