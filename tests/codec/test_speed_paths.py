"""The set codec's rollout-speed paths equal their references, bit for bit.

`SubsetRanker` (sorting network + pair tables, chunked), `pack_lanes_into` (strided uint64 ORs) and the
word write of `SubsetUnranker.unrank` (ids 0 .. 3 of a row as one uint64) each replace a plain path;
a wrong comparator, pair index, lane offset or chunk seam gives wrong bytes silently, never an error.
So each is compared with a reference sharing none of its code (Python ints, `math.comb`, bit-by-bit
streams) on random rows and on the edges: E = 1, 2, 1024, K = 1, K = E - 1, K beyond the network,
pair tables on and off, chunk seams, streams that end mid-group.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from routereplay.bitpack import MAX_VIEW_BITS, MIN_LANE_PACK_BITS, pack_bits, pack_lanes_into
from routereplay.codec import blob as codec
from routereplay.codec import rows
from routereplay.codec.limits import DEFAULT_LIMITS
from routereplay.codec.ranker import MAX_NETWORK_K, SubsetRanker, merge_network
from routereplay.codec.rows import encode_rows, payload_streams
from routereplay.codec.subsets import SubsetUnranker, binomial_table, rank_subsets
from routereplay.enums import CodecMode
from routereplay.trace.route_trace import RouteTrace


def reference_rank(row: list[int]) -> int:
    return sum(math.comb(c, i + 1) for i, c in enumerate(sorted(row)))


def reference_stream(values: list[int], bits: int) -> bytes:
    stream = sum(v << (i * bits) for i, v in enumerate(values))
    return stream.to_bytes(-(-len(values) * bits // 8), "little")


def random_rows(rng: np.random.Generator, n: int, num_experts: int, top_k: int) -> np.ndarray:
    dtype = np.int16 if num_experts <= 32767 else np.int32
    return np.argsort(rng.random((n, num_experts)), axis=1)[:, :top_k].astype(dtype)


@pytest.mark.parametrize("size", range(1, 13))
def test_merge_network_sorts_every_zero_one_input(size: int) -> None:
    """0-1 principle: a comparator network sorts everything iff it sorts every 0/1 input. A dropped or
    misordered comparator (the power-of-two restriction) leaves some 0/1 vector unsorted."""
    network = merge_network(size)
    assert all(a < b < size for a, b in network)
    for bits in itertools.product((0, 1), repeat=size):
        items = list(bits)
        for a, b in network:
            if items[a] > items[b]:
                items[a], items[b] = items[b], items[a]
        assert items == sorted(bits), (size, bits)


def test_merge_network_sorts_random_rows_up_to_the_largest_k() -> None:
    rng = np.random.default_rng(0)
    for size in (13, 17, 31, 32, 33, MAX_NETWORK_K):
        items_N = rng.integers(0, 5, (200, size))
        for a, b in merge_network(size):
            low = np.minimum(items_N[:, a], items_N[:, b])
            items_N[:, b] = np.maximum(items_N[:, a], items_N[:, b])
            items_N[:, a] = low
        assert (np.diff(items_N, axis=1) >= 0).all(), size
    assert len(merge_network(8)) == 19  # the optimal count for 8: the network the codec uses at top-8


SHAPES = [(1, 1), (2, 1), (2, 2), (3, 2), (5, 4), (16, 15), (64, 63), (40, 17), (128, 8), (128, 127), (256, 8)]
SHAPES += [(300, 3), (1024, 1), (1024, 3), (1024, 1023), (70000, 2)]


@pytest.mark.parametrize(("num_experts", "top_k"), SHAPES)
def test_ranker_equals_python_int_reference(num_experts: int, top_k: int) -> None:
    """Random rows in any order, plus the rows of the lowest and highest ranks, against `math.comb` sums;
    covers pair tables on (E <= 256) and off (E = 1024), K = E - 1, and K beyond the network (np.sort)."""
    count = math.comb(num_experts, top_k)
    table_JE = binomial_table(num_experts, top_k, count)
    ranker = SubsetRanker(table_JE)
    rng = np.random.default_rng(num_experts * 1000 + top_k)
    experts_NK = random_rows(rng, 300, num_experts, top_k)
    edges = [list(range(top_k)), list(range(num_experts - top_k, num_experts))[::-1]]
    experts_NK = np.concatenate([experts_NK, np.array(edges, experts_NK.dtype)])
    got = ranker.rank(experts_NK)
    assert [int(r) for r in got] == [reference_rank(row) for row in experts_NK.tolist()]
    assert got.tolist() == rank_subsets(experts_NK, table_JE).tolist()
    assert int(got[-2]) == 0 and int(got[-1]) == count - 1
    assert ranker.fast == (top_k <= MAX_NETWORK_K)


def test_ranker_chunk_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 24 rows (a multiple of 8): every seam, and a last chunk that ends mid-group."""
    monkeypatch.setattr("routereplay.codec.ranker.RANK_CHUNK_ROWS", 24)
    table_JE = binomial_table(128, 8, math.comb(128, 8))
    experts_NK = random_rows(np.random.default_rng(1), 24 * 5 + 5, 128, 8)
    assert SubsetRanker(table_JE).rank(experts_NK).tolist() == rank_subsets(experts_NK, table_JE).tolist()


@pytest.mark.parametrize("bits", range(1, 65))
def test_pack_equals_bit_by_bit_stream(bits: int) -> None:
    """`pack_bits` on every width (merged runs below 8 bits, lanes for 8..57, bytes above), and
    `pack_lanes_into` in pieces of 16 values at their byte offsets, against a stream built as one
    Python int; values at 2**bits - 1 fill every bit, and wider inputs are masked to `bits`."""
    rng = np.random.default_rng(bits)
    for count in (1, 7, 8, 9, 16, 56, 57, 58, 61, 130):
        values = rng.integers(0, (1 << bits) - 1, count, dtype=np.uint64, endpoint=True)
        values[: count // 3] = (1 << bits) - 1
        expected = reference_stream([int(v) for v in values], bits)
        assert pack_bits(values, bits) == expected, (bits, count)
        if bits < 64:  # junk above bit `bits - 1` must be masked off
            junk = rng.integers(1, 1 << 63, count, dtype=np.uint64) << np.uint64(bits)
            assert pack_bits(values | junk, bits) == expected, (bits, count)
        if not MIN_LANE_PACK_BITS <= bits <= MAX_VIEW_BITS:
            continue
        out_B = np.zeros(-(-count // 8) * bits + 8, np.uint8)
        for v0 in range(0, count, 16):
            pack_lanes_into(values[v0 : v0 + 16], bits, out_B, v0 * bits // 8)
        assert out_B[: len(expected)].tobytes() == expected and not out_B[len(expected) :].any()


@pytest.mark.parametrize(("num_experts", "top_k"), [(128, 8), (2, 1), (64, 63), (1024, 3), (256, 8), (30, 9)])
def test_encode_rows_equals_reference_stream(monkeypatch: pytest.MonkeyPatch, num_experts: int, top_k: int) -> None:
    """The chunked rank-and-pack of `encode_rows` against ranks packed bit by bit, across chunk seams."""
    monkeypatch.setattr(rows, "RANK_CHUNK_ROWS", 16)
    streams = payload_streams(num_experts, top_k, CodecMode.SET, DEFAULT_LIMITS, "test")
    experts_NK = random_rows(np.random.default_rng(top_k), 16 * 3 + 3, num_experts, top_k)
    ranks = [reference_rank(row) for row in experts_NK.tolist()]
    assert encode_rows(experts_NK, num_experts, top_k, CodecMode.SET, streams) == reference_stream(ranks, streams[0][1])


@pytest.mark.parametrize(
    ("num_experts", "top_k", "depth"),
    [(128, 8, 3), (140, 12, 3), (96, 16, 3), (64, 12, 4), (40, 16, 4), (160, 8, 0), (60, 6, 4)],
)
def test_unrank_word_write_equals_column_writes(num_experts: int, top_k: int, depth: int) -> None:
    """The word path (ids 0 .. 3 as one uint64: the low-table word, | id 3 << 48 when it holds 3 ids)
    against the column-by-column path (a non-contiguous output) and the ranks: same rows, every row
    sorted, ranks round-trip. Depth 0: no low table (E = 160, K = 8 is over its budget); K = 6: K % 4."""
    count = math.comb(num_experts, top_k)
    table_JE = binomial_table(num_experts, top_k, count)
    rng = np.random.default_rng(top_k)
    ranks_N = rng.integers(0, count, 4000, dtype=np.uint64)
    ranks_N[:2] = [0, count - 1]
    unranker = SubsetUnranker(table_JE, count, rows=10**7)
    assert (unranker.low_table.depth if unranker.low_table else 0) == depth
    words_NK = np.empty((len(ranks_N), top_k), np.int16)
    unranker.unrank(ranks_N, words_NK)
    wide_NK = np.full((len(ranks_N), top_k + 4), 7, np.int16)  # rows 8-byte aligned, not contiguous
    unranker.unrank(ranks_N, wide_NK[:, 2 : 2 + top_k])
    assert (unranker._word_view(words_NK) is not None) == (depth > 0 and top_k % 4 == 0)
    assert unranker._word_view(wide_NK[:, 2 : 2 + top_k]) is None
    assert (words_NK == wide_NK[:, 2 : 2 + top_k]).all()
    assert (np.diff(words_NK, axis=1) > 0).all()
    assert rank_subsets(words_NK, table_JE).tolist() == ranks_N.tolist()


@pytest.mark.parametrize(
    ("num_experts", "top_k", "missing"),
    [
        (128, 8, 0.0),
        (128, 8, 0.3),
        (128, 8, 1.0),
        (1, 1, 0.0),
        (2, 1, 0.2),
        (1024, 3, 0.1),
        (100, 99, 0.0),
        (64, 63, 0.5),
        (1024, 1, 0.0),
    ],
)
def test_codec_round_trip_on_adversarial_traces(num_experts: int, top_k: int, missing: float) -> None:
    """Whole blobs: all -1, a single expert, E = 2, K = E - 1, E = 1024; decode gives the sorted rows
    (5 tokens: a single-expert layer of fewer than 32 rows is not refused as a capture failure)."""
    rng = np.random.default_rng(num_experts + top_k)
    T, L = 5, 3
    experts_RK = random_rows(rng, T * L, num_experts, top_k)
    experts_RK[rng.random(T * L) < missing] = -1
    if missing == 1.0:
        experts_RK[:] = -1
    trace = RouteTrace(experts_RK.reshape(T, L, top_k), num_experts)
    back = codec.decode(codec.encode(trace))
    expected = np.sort(experts_RK, axis=1)
    assert (back.experts.reshape(T * L, top_k) == expected).all()
