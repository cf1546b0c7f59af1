"""The codec's fast paths equal plain references: the strided-lane `unpack_bits`, and `SubsetUnranker`'s
float64 column searches, uint64 fallbacks and low-id table. Each fast path reads precomputed offsets or
tables, and an off-by-one in one of them misdecodes silently (a wrong id, never an error), so every
path is compared with a reference that shares none of its code, at the edges where the offsets change."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routereplay.bitpack import pack_bits, unpack_bits
from routereplay.codec.column_search import BucketSearch, FloatColumn, LowIdTable
from routereplay.codec.subsets import SEARCH_BUDGET_BYTES, SubsetUnranker, binomial_table, rank_subsets
from routereplay.errors import CodecFormatError

U64_LIMIT = 1 << 64


def reference_unpack(buf: bytes, count: int, bits: int, first: int) -> list[int]:
    """Value i is bits [i * bits, (i + 1) * bits) of the buffer read as one little-endian integer."""
    stream = int.from_bytes(buf, "little")
    return [(stream >> ((first + i) * bits)) & ((1 << bits) - 1) for i in range(count)]


def reference_unrank(rank: int, columns: list[list[int]]) -> list[int]:
    """The greedy walk with Python ints: for i = K - 1 down, the largest c with C(c, i + 1) <= rank
    (`columns[i][c]` = C(c, i + 1))."""
    row = []
    for i in range(len(columns) - 1, -1, -1):
        c = bisect.bisect_right(columns[i], rank) - 1
        row.append(c)
        rank -= columns[i][c]
    assert rank == 0
    return row[::-1]


@given(count=st.integers(0, 90), first=st.integers(0, 70), tail=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
def test_unpack_equals_bit_by_bit_reference(count: int, first: int, tail: int, seed: int) -> None:
    """Silent misdecode: lane j of every 8-value group is read as one unaligned uint64 at byte j * b // 8
    shifted by j * b % 8 (b <= 57), from a zero-padded copy. A wrong lane offset or shift for one width,
    or trailing bytes leaking into the last value, would return wrong values, not an error: every
    width 1..64, any start `first` (mid-group), with junk after the stream, must give the values a
    bit-by-bit read gives, and a stream one byte short must be refused."""
    rng = np.random.default_rng(seed)
    for bits in range(1, 65):
        values = rng.integers(0, (1 << bits) - 1, first + count, dtype=np.uint64, endpoint=True)
        packed = pack_bits(values, bits)
        junk = bytes(rng.integers(0, 256, tail, dtype=np.uint8))
        expected = reference_unpack(packed, count, bits, first)
        for buf in (packed + junk, memoryview(packed + junk)[: len(packed)], np.frombuffer(packed, np.uint8)):
            got = unpack_bits(buf, count, bits, first)
            assert got.dtype == np.uint64 and got.tolist() == expected, (bits, count, first)
        if count:  # the last value's last byte cut off
            with pytest.raises(CodecFormatError, match=f"need {len(packed)}"):
                unpack_bits(packed[:-1], count, bits, first)


def _edge_ranks(num_experts: int, top_k: int, count: int, rng: np.random.Generator) -> list[int]:
    """0, C(E, K) - 1, C(c, K) and its neighbours (where the top column's id changes; every c when E <= 64),
    the same under each lower column's first boundaries, and random ranks."""
    ids = range(top_k - 1, num_experts)
    if len(ids) > 64:
        ids = sorted({top_k - 1, top_k, num_experts - 1, *rng.choice(ids, 40).tolist()})
    ranks = {0, count - 1}
    for c in ids:
        for low in (0, math.comb(top_k - 1, top_k - 1), math.comb(top_k, top_k - 1) if top_k > 1 else 0):
            for delta in (-1, 0, 1):
                ranks.add(math.comb(c, top_k) + low + delta)
    ranks.update(int(r) for r in rng.integers(0, count - 1, 40, dtype=np.uint64, endpoint=True))
    return sorted(r for r in ranks if 0 <= r < count)


@given(
    num_experts=st.integers(1, 600),
    top_k=st.integers(1, 12),
    rows=st.sampled_from([0, 10**9]),
    budget=st.sampled_from([0, 3000, SEARCH_BUDGET_BYTES]),
    seed=st.integers(0, 2**32 - 1),
)
def test_unranker_fast_paths_equal_the_reference(
    num_experts: int, top_k: int, rows: int, budget: int, seed: int
) -> None:
    """Silent misdecode: each column's float64 bucket index (candidate id + one threshold a bucket),
    the uint64 fallback it hands over to when over its budget (and back), and the low-id table (one
    row per remainder, ids packed in int16 lanes) all answer from precomputed tables; an entry off by
    one gives a wrong expert id, never an error. Any E, K (K = 1, K = E, C(E, K) across 2**53 and up
    to 2**64), with and without the low-id table, with no, a tiny and the default search budget, and
    ranks on every top-column boundary, must unrank to the rows of a Python-int greedy walk."""
    top_k = min(top_k, num_experts)
    while math.comb(num_experts, top_k) >= U64_LIMIT:  # Python-int ranks keep their own exact path
        top_k -= 1
    count = math.comb(num_experts, top_k)
    table_JE = binomial_table(num_experts, top_k, count)
    unranker = SubsetUnranker(table_JE, count, rows=rows, search_budget_bytes=budget)
    ranks = _edge_ranks(num_experts, top_k, count, np.random.default_rng(seed))
    columns = [[math.comb(c, i + 1) for c in range(num_experts)] for i in range(top_k)]
    expected = np.array([reference_unrank(r, columns) for r in ranks])
    ranks_N = np.array(ranks, np.uint64)
    for dtype in (np.int16, np.int32, np.int64):
        out_NK = np.full((len(ranks), top_k), -5, dtype)
        unranker.unrank(ranks_N, out_NK)
        assert np.array_equal(out_NK, expected), (num_experts, top_k, dtype)
    assert np.array_equal(rank_subsets(expected, table_JE), ranks_N)


def test_real_layouts_take_the_fast_paths() -> None:
    """Slow decode (a 2x regression, no wrong output): E = 128, K = 8 decoded in bulk must use a float64
    search for every searched column and a 3-id low table, within the documented budgets; a small
    decode must not build the table, and one with a budget too small for any index still unranks."""
    E, K = 128, 8
    count = math.comb(E, K)
    table_JE = binomial_table(E, K, count)
    bulk = SubsetUnranker(table_JE, count, rows=1 << 20)
    assert bulk.low_table is not None and bulk.low_table.depth == 3
    assert sorted(bulk.searches) == [3, 4, 5, 6, 7]
    assert all(isinstance(search, FloatColumn) for search in bulk.searches.values())
    assert bulk.nbytes <= SEARCH_BUDGET_BYTES + bulk.low_table.nbytes
    assert bulk.low_table.nbytes == 8 * LowIdTable.rows(E, K, 3)
    small = SubsetUnranker(table_JE, count, rows=1000)
    assert small.low_table is None and len(small.searches) == K - 1
    starved = SubsetUnranker(table_JE, count, search_budget_bytes=0)
    assert all(isinstance(search, BucketSearch) and search.width < 0 for search in starved.searches.values())
    ranks_N = np.array([0, 1, count // 3, count - 1], np.uint64)
    rows_fast, rows_starved = np.empty((4, K), np.int16), np.empty((4, K), np.int16)
    bulk.unrank(ranks_N, rows_fast)
    starved.unrank(ranks_N, rows_starved)
    assert np.array_equal(rows_fast, rows_starved)
    assert rows_fast[-1].tolist() == list(range(E - K, E)) and rows_fast[0].tolist() == list(range(K))
