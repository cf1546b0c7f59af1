"""The combinatorial number system: K-subsets of E experts <-> integer ranks in [0, C(E, K)).

A sorted row c_0 < ... < c_{K-1} has rank sum_i C(c_i, i + 1). Ranking is K table lookups per
row; unranking walks ids from the largest down, finding for each the largest c with
C(c, i + 1) <= remainder. Both are vectorised over rows. Ranks below 2**64 are uint64; wider ones
(C(E, K) >= 2**64, e.g. E=512, K=10) use exact Python ints in object arrays (slower, still exact).
Legend: N = rows, K = top-k, E = experts, J = K + 1 table rows, M = entries searched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

U64_MAX = (1 << 64) - 1


def binomial_table(num_experts: int, top_k: int, count: int) -> np.ndarray:
    """(K + 1, E) table[j, c] = min(C(c, j), count): uint64 when count < 2**64, else Python ints."""
    rows = [np.ones(num_experts, dtype=object)]
    for _ in range(top_k):
        row = np.zeros(num_experts, dtype=object)
        row[1:] = np.cumsum(rows[-1][:-1])  # C(c, j) = sum_{m < c} C(m, j - 1)
        rows.append(np.minimum(row, count))  # clamped entries are never a term of a valid rank
    table = np.stack(rows)
    return table.astype(np.uint64) if count <= U64_MAX else table


def rank_subsets(experts_NK: np.ndarray, table_JE: np.ndarray) -> np.ndarray:
    """Rank of each row's id set (the order inside a row does not matter)."""
    sorted_NK = np.sort(experts_NK, axis=1)
    ranks_N = np.zeros(len(sorted_NK), table_JE.dtype)
    for i in range(sorted_NK.shape[1]):
        ranks_N += table_JE[i + 1][sorted_NK[:, i]]
    return ranks_N


def unrank_subsets(ranks_N: np.ndarray, table_JE: np.ndarray, top_k: int, count: int, dtype: Any) -> np.ndarray:
    """Rows c_0 < ... < c_{K-1} with sum_i C(c_i, i + 1) = rank, greedily from the largest id."""
    experts_NK = np.empty((len(ranks_N), top_k), dtype)
    remainder_N = ranks_N.copy()
    for i in range(top_k - 1, 0, -1):
        column_E = table_JE[i + 1]
        if column_E.dtype == object:  # C(E, K) >= 2**64: exact Python ints
            c_N = np.searchsorted(column_E, remainder_N, side="right") - 1
        else:  # ids below i have C(c, i + 1) = 0 and clamped entries exceed every rank: skip both
            usable = column_E[i : int(np.count_nonzero(column_E < count))]
            c_N = i + count_at_most(usable, remainder_N) - 1
        experts_NK[:, i] = c_N
        remainder_N -= column_E[c_N]
    experts_NK[:, 0] = remainder_N  # C(c, 1) = c
    return experts_NK


def count_at_most(sorted_M: np.ndarray, queries_N: np.ndarray) -> np.ndarray:
    """np.searchsorted(sorted_M, queries_N, side='right') for uint64, ~4x faster and exact.

    Buckets by the top bits of float64(x + 1) (monotone in x): entries in a lower bucket are
    <= the query, in a higher one >; the few sharing the query's bucket are compared directly.
    """
    mantissa = min(12, max(4, len(sorted_M).bit_length()))

    def bucket(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float64) + 1.0).view(np.int64) >> (52 - mantissa)

    bucket_M = bucket(sorted_M)
    base, top = int(bucket_M[0]), int(bucket_M[-1]) + 1
    below_B = np.searchsorted(bucket_M, np.arange(base, top + 1), side="left")  # entries in lower buckets
    width = int(np.unique(bucket_M, return_counts=True)[1].max())
    padded_M = np.concatenate([sorted_M, np.full(width, U64_MAX, np.uint64)])
    start_N = below_B[np.clip(bucket(queries_N), base, top) - base]
    counts_N = start_N.copy()
    for offset in range(width):
        counts_N += padded_M[start_N + offset] <= queries_N
    return counts_N


__all__ = ["U64_MAX", "binomial_table", "count_at_most", "rank_subsets", "unrank_subsets"]
