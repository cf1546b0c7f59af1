"""The set codec's C kernel (`codec/set_kernel.c`) equals the numpy path and the plain references.

The kernel fuses validation with ranking and packing (encode) and reads, checks and unranks a payload
(decode). A wrong comparator, table index, bit offset or bitmap walk gives wrong bytes silently, so
every case is compared three ways: kernel blob == numpy blob (`native=False`), the ranks in it == a
Python-int reference, and decode (kernel) == decode (numpy) == the sorted input. Hostile inputs must
raise the same named errors as the numpy path: invalid rows are named by `validate()`, corrupt ranks by
`CodecFormatError`, and the kernel's own argument checks by ValueError before any row is touched.
"""

from __future__ import annotations

import math
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.codec import blob as codec
from routereplay.codec import native
from routereplay.codec.encoded import EncodedRoutes
from routereplay.codec.rows import rank_bits
from routereplay.codec.subsets import SubsetUnranker, binomial_table
from routereplay.errors import (
    CodecFormatError,
    DuplicateExpertError,
    ExpertIdRangeError,
    PartialRowError,
    ZeroLayerError,
)
from routereplay.trace.route_trace import RouteTrace

pytestmark = pytest.mark.native
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"  # blobs written by the pre-kernel code


def distinct_rows(rng: np.random.Generator, n: int, num_experts: int, top_k: int) -> np.ndarray:
    """n rows of K distinct ids of E, in random order inside each row."""
    dtype = np.int16 if num_experts <= 32767 else np.int32
    if num_experts <= 4096:
        return np.argsort(rng.random((n, num_experts)), axis=1)[:, :top_k].astype(dtype)
    rows = np.empty((n, top_k), dtype)
    for i in range(n):
        rows[i] = rng.choice(num_experts, top_k, replace=False)
    return rows


def trace_of(rows_RK: np.ndarray, num_experts: int, layers: int = 1) -> RouteTrace:
    top_k = rows_RK.shape[1]
    return RouteTrace(rows_RK.reshape(-1, layers, top_k), num_experts)


def reference_ranks(rows_RK: np.ndarray) -> list[int]:
    return [sum(math.comb(c, i + 1) for i, c in enumerate(sorted(row))) for row in rows_RK.tolist() if row[0] >= 0]


def ranks_in(blob: bytes, trace: RouteTrace) -> list[int]:
    """The ranks a blob stores, read bit by bit from its payload (no codec code)."""
    E, K = trace.num_experts, trace.top_k
    bits = rank_bits(math.comb(E, K))
    rows_RK = trace.experts.reshape(-1, K)
    routed = int((rows_RK[:, 0] >= 0).sum())
    stream_bytes = -(-routed * bits // 8)
    stream = int.from_bytes(blob[len(blob) - 4 - stream_bytes : len(blob) - 4], "little")
    return [(stream >> (i * bits)) & ((1 << bits) - 1) for i in range(routed)]


def assert_three_ways(trace: RouteTrace) -> None:
    blob = codec.encode(trace)
    assert blob == codec.encode(trace, native=False)
    assert ranks_in(blob, trace) == reference_ranks(trace.experts.reshape(-1, trace.top_k))
    got, want = codec.decode(blob), codec.decode(blob, native=False)
    assert np.array_equal(got.experts, want.experts)
    assert np.array_equal(got.experts, np.sort(trace.experts, axis=2))


GEOMETRIES = [(3, 2), (4, 3), (8, 7), (16, 2), (64, 63), (128, 8), (160, 6), (256, 8), (1024, 2), (1024, 4)]


@pytest.mark.parametrize(("num_experts", "top_k"), GEOMETRIES)
def test_random_rows_equal_the_numpy_path_and_the_reference(num_experts: int, top_k: int) -> None:
    rng = np.random.default_rng(num_experts * 100 + top_k)
    n = 1000 if num_experts * top_k < 20000 else 300  # several blocks of 256 rows, and a partial one
    assert native.can_pack(num_experts, top_k, rank_bits(math.comb(num_experts, top_k)))
    assert_three_ways(trace_of(distinct_rows(rng, n, num_experts, top_k), num_experts))


@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 3), (128, 8), (256, 8)])
@pytest.mark.parametrize("unrouted", [0.0, 0.01, 0.5, 0.99])
def test_unrouted_rows_give_the_same_bitmap_and_stream(num_experts: int, top_k: int, unrouted: float) -> None:
    rng = np.random.default_rng(7)
    rows_RK = distinct_rows(rng, 1543, num_experts, top_k)  # not a multiple of 8 or of the block
    rows_RK[rng.random(len(rows_RK)) < unrouted] = -1
    assert_three_ways(trace_of(rows_RK, num_experts))


def test_all_unrouted_and_single_rows() -> None:
    assert_three_ways(trace_of(np.full((777, 8), -1, np.int16), 128))
    assert_three_ways(trace_of(np.array([[5, 1]], np.int16), 6))
    assert_three_ways(trace_of(np.array([[-1, -1]], np.int16), 6))
    assert_three_ways(trace_of(np.zeros((0, 8), np.int16), 128))


def test_edge_ranks_zero_and_the_largest() -> None:
    """Rank 0 (ids 0 .. K-1) and C(E, K) - 1 (the top K ids) in every position of a block."""
    for num_experts, top_k in [(128, 8), (256, 8), (64, 63), (3, 2)]:
        low = np.arange(top_k, dtype=np.int16)
        high = np.arange(num_experts - top_k, num_experts, dtype=np.int16)[::-1].copy()
        rows_RK = np.stack([low, high] * 300)
        assert_three_ways(trace_of(rows_RK, num_experts))


def test_a_single_expert_over_many_rows() -> None:
    """Every row the same set: the sort and the table read see one value per column."""
    rows_RK = np.tile(np.array([7, 3, 100, 64, 0, 127, 12, 99], np.int16), (4096, 1))
    assert_three_ways(trace_of(rows_RK, 128, layers=4))


def test_large_expert_counts_decode_into_int32() -> None:
    """E > 32767 is beyond the kernel's int16 sort (numpy encodes) but its decode writes int32 rows."""
    rng = np.random.default_rng(3)
    rows_RK = distinct_rows(rng, 600, 40000, 2)
    trace = trace_of(rows_RK, 40000)
    assert not native.can_pack(40000, 2, rank_bits(math.comb(40000, 2)))
    blob = codec.encode(trace)
    got = codec.decode(blob)
    assert got.experts.dtype == np.int32
    assert np.array_equal(got.experts, codec.decode(blob, native=False).experts)
    assert np.array_equal(got.experts, np.sort(trace.experts, axis=2))


def test_golden_blobs_decode_the_same_with_and_without_the_kernel() -> None:
    for path in sorted(GOLDEN.glob("*.rrt")):
        data = path.read_bytes()
        got, want = codec.decode(data), codec.decode(data, native=False)
        assert np.array_equal(got.experts, want.experts), path.name
        assert codec.encode(got, mode="set") == codec.encode(got, mode="set", native=False), path.name


@settings(max_examples=60)
@given(
    num_experts=st.integers(2, 300),
    data=st.data(),
)
def test_hypothesis_random_geometries(num_experts: int, data: st.DataObject) -> None:
    top_k = data.draw(st.integers(2, min(num_experts - 1, 64))) if num_experts > 2 else 2
    if math.comb(num_experts, top_k) < 2:
        return
    n = data.draw(st.integers(0, 700))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows_RK = distinct_rows(rng, n, num_experts, top_k)
    rows_RK[rng.random(n) < data.draw(st.sampled_from([0.0, 0.1, 0.9]))] = -1
    trace = trace_of(rows_RK, num_experts)
    blob = codec.encode(trace)
    assert blob == codec.encode(trace, native=False)
    assert np.array_equal(codec.decode(blob).experts, codec.decode(blob, native=False).experts)


# --- hostile rows: the same named error as the numpy path ----------------------------------------


def bad_trace(rows_RK: np.ndarray) -> RouteTrace:
    return RouteTrace(rows_RK.reshape(-1, 2, rows_RK.shape[1]), 128)


@pytest.mark.parametrize(
    ("row", "error", "match"),
    [
        ([3, 3, 5, 6], DuplicateExpertError, "names an expert twice"),
        ([3, -1, 5, 6], PartialRowError, "mixes -1 with expert ids"),
        ([-1, -1, -1, 4], PartialRowError, "mixes -1 with expert ids"),
        ([3, 4, 5, 128], ExpertIdRangeError, "outside \\[0, 128\\)"),
        ([3, 4, -2, 6], ExpertIdRangeError, "outside \\[0, 128\\)"),
        ([0, 0, 0, 0], DuplicateExpertError, "names an expert twice"),
    ],
)
@pytest.mark.parametrize("where", [0, 255, 256, 1001])
def test_an_invalid_row_anywhere_is_named_as_without_the_kernel(
    row: list[int], error: type[Exception], match: str, where: int
) -> None:
    rows_RK = distinct_rows(np.random.default_rng(where), 1002, 128, 4)
    rows_RK[where] = row
    trace = bad_trace(rows_RK)
    with pytest.raises(error, match=match) as fused:
        codec.encode(trace)
    with pytest.raises(error, match=match) as plain:
        codec.encode(trace, native=False)
    assert str(fused.value) == str(plain.value)


@pytest.mark.parametrize("validate", [True, False])
def test_an_invalid_turn_stores_nothing_whatever_validate_says(validate: bool) -> None:
    """`validate=False` (kept for compatibility) must not let a bad trace half into the store: the rows
    are checked while they are encoded, before the sample exists."""
    from routereplay.store.route_store import RouteStore

    rows_RK = np.tile(np.arange(8, dtype=np.int16), (30, 1))
    rows_RK[16, 1] = 0
    store = RouteStore()
    with pytest.raises(DuplicateExpertError, match="sequence 'x', token 5, layer 1: .*names an expert twice"):
        store.add_turn("x", list(range(11)), RouteTrace(rows_RK.reshape(10, 3, 8), 128), validate=validate)
    assert len(store) == 0 and "x" not in store and store.geometry is None


def test_native_must_be_a_bool() -> None:
    from routereplay.errors import ConfigError

    trace = trace_of(distinct_rows(np.random.default_rng(0), 10, 16, 3), 16)
    with pytest.raises(ConfigError, match="native must be True or False, got str 'no'"):
        codec.encode(trace, native="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="native must be True or False"):
        codec.decode(codec.encode(trace), native=None)  # type: ignore[arg-type]


def test_a_foreign_byte_order_takes_the_numpy_path() -> None:
    trace = trace_of(distinct_rows(np.random.default_rng(0), 300, 200, 4), 200)
    blob = codec.encode(trace)
    trace.experts = trace.experts.astype(">i2")  # not what RouteTrace makes, but never a raw TypeError
    assert codec.encode(trace) == blob


def test_an_all_zero_layer_is_named_a_capture_failure() -> None:
    rows_RK = distinct_rows(np.random.default_rng(1), 512, 128, 4).reshape(-1, 2, 4)
    rows_RK[:, 1] = 0
    with pytest.raises(ZeroLayerError, match="all zeros"):
        codec.encode(RouteTrace(rows_RK, 128))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_every_integer_dtype_is_checked_before_it_is_narrowed(dtype: type) -> None:
    """The kernel sorts ids as int16: 65536 + 3 must be refused, not wrapped to 3."""
    num_experts = 100 if np.iinfo(dtype).max < 128 else 128  # so that the dtype's largest value is out of range
    table_JE = binomial_table(num_experts, 4, math.comb(num_experts, 4))
    bits = rank_bits(math.comb(num_experts, 4))
    rows_RK = distinct_rows(np.random.default_rng(0), 300, num_experts, 4).astype(dtype)
    good = native.pack_set_rows(rows_RK, num_experts, table_JE, bits)
    assert good.bad_row == -1
    narrow = native.pack_set_rows(rows_RK.astype(np.int16), num_experts, table_JE, bits)
    assert bytes(good.payload) == bytes(narrow.payload)
    if np.iinfo(dtype).max > 70000:
        hostile = rows_RK.copy()
        hostile[7, 2] = 65536 + 3
        assert native.pack_set_rows(hostile, num_experts, table_JE, bits).bad_row == 7
    hostile = rows_RK.copy()
    hostile[9, 1] = np.iinfo(dtype).max
    assert native.pack_set_rows(hostile, num_experts, table_JE, bits).bad_row == 9


def test_the_kernel_refuses_malformed_arguments_before_any_row() -> None:
    assert native.KERNEL is not None
    table_JE = binomial_table(128, 4, math.comb(128, 4))
    rows_RK = np.zeros((16, 4), np.int16)
    network = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="wrong size"):
        native.KERNEL.rank_pack(rows_RK, 128, table_JE[:2], network, 25, np.zeros(2, np.uint8), np.zeros(50, np.uint8))
    with pytest.raises(ValueError, match="wrong size"):
        native.KERNEL.rank_pack(rows_RK, 128, table_JE, network, 25, np.zeros(2, np.uint8), np.zeros(49, np.uint8))
    with pytest.raises(ValueError, match="outside \\[0, K\\)"):
        native.KERNEL.rank_pack(rows_RK, 128, table_JE, network + 4, 25, np.zeros(2, np.uint8), np.zeros(50, np.uint8))
    with pytest.raises(TypeError, match="integers"):
        native.KERNEL.rank_pack(rows_RK.astype(np.float32), 128, table_JE, network, 25, np.zeros(2), np.zeros(50))
    with pytest.raises(ValueError, match="2-d"):
        native.KERNEL.rank_pack(rows_RK.ravel(), 128, table_JE, network, 25, np.zeros(2, np.uint8), np.zeros(50))


# --- hostile payloads ------------------------------------------------------------------------------


def test_a_rank_beyond_the_count_is_named_with_its_row() -> None:
    rows_RK = distinct_rows(np.random.default_rng(2), 600, 128, 8)
    trace = trace_of(rows_RK, 128)
    blob = bytearray(codec.encode(trace))
    bits, start = 41, len(blob) - 4 - -(-600 * 41 // 8)
    stream = int.from_bytes(blob[start:-4], "little")
    stream |= ((1 << 41) - 1) << (300 * 41)  # row 300: all ones, above C(128, 8)
    blob[start:-4] = stream.to_bytes(len(blob) - 4 - start, "little")
    blob[-4:] = zlib.crc32(bytes(blob[:-4])).to_bytes(4, "little")
    with pytest.raises(CodecFormatError, match="routed row 300 has set rank 2199023255551 >= C\\(128, 8\\)") as fused:
        codec.decode(bytes(blob))
    with pytest.raises(CodecFormatError) as plain:
        codec.decode(bytes(blob), native=False)
    assert str(fused.value) == str(plain.value)
    encoded = EncodedRoutes(codec.encode(trace))
    assert np.array_equal(encoded.rows(0, 600), np.sort(trace.experts, axis=2))
    del bits


def test_a_short_stream_is_refused_by_the_kernel_itself() -> None:
    count = math.comb(128, 8)
    plan = native.unrank_plan(SubsetUnranker(binomial_table(128, 8, count), count), count)
    assert plan is not None
    out = np.empty((100, 8), np.int16)
    assert native.unrank_set_rows(plan, np.zeros(41 * 50 // 8, np.uint8), out, 41, stream_offset=0) == -2


# --- threads ---------------------------------------------------------------------------------------


def test_two_threads_encode_and_decode_at_once() -> None:
    """The kernel releases the GIL and keeps no state between calls: two threads get their own bytes."""
    traces = [trace_of(distinct_rows(np.random.default_rng(s), 20000, 128, 8), 128, layers=8) for s in (1, 2)]
    blobs = [codec.encode(t, native=False) for t in traces]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                assert codec.encode(traces[i]) == blobs[i]
                assert np.array_equal(codec.decode(blobs[i]).experts, np.sort(traces[i].experts, axis=2))
        except BaseException as error:  # reported to the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_status_names_the_kernel() -> None:
    assert native.KERNEL_STATUS.startswith("built")


@pytest.mark.parametrize("mode", ["set", "ordered"])
@pytest.mark.parametrize(
    ("row", "error", "match"),
    [([3, 3, 5, 6], DuplicateExpertError, "names an expert twice"), ([3, 4, 5, 200], ExpertIdRangeError, "outside")],
)
def test_the_store_names_the_sample_of_an_invalid_row_and_keeps_nothing(
    mode: str, row: list[int], error: type[Exception], match: str
) -> None:
    """`add_turn` validates while it encodes (set mode: one pass in the kernel); the fault is named with
    the sample id, as when it validated first, and neither the sample nor the geometry is kept."""
    from routereplay.store.route_store import RouteStore

    rows_RK = distinct_rows(np.random.default_rng(4), 600, 128, 4)
    rows_RK[333] = row
    store = RouteStore(codec_mode=mode)
    with pytest.raises(error, match=f"sequence 'bad', token 166, layer 1: .*{match}"):
        store.add_turn("bad", np.arange(301), RouteTrace(rows_RK.reshape(300, 2, 4), 128))
    assert len(store) == 0 and store.geometry is None
    good = distinct_rows(np.random.default_rng(5), 600, 128, 4).reshape(300, 2, 4)
    store.add_turn("good", np.arange(301), RouteTrace(good, 128))
    assert np.array_equal(np.sort(store.trace("good").experts, axis=2), np.sort(good, axis=2))


def test_the_decode_kernel_refuses_malformed_plans() -> None:
    """Tables not padded to powers of two, columns out of order or missing: refused before any row."""
    assert native.KERNEL is not None
    count = math.comb(128, 8)
    plan = native.unrank_plan(SubsetUnranker(binomial_table(128, 8, count), count), count)
    assert plan is not None
    payload, out = np.zeros(41 * 16, np.uint8), np.empty((16, 8), np.int16)

    def call(columns: list) -> int:
        return native.KERNEL.unrank(payload, 0, 0, 0, 16, 8, 41, count, columns, out, 2)

    assert call(plan.columns) == -1
    column, shift, base, candidate, threshold, values = plan.columns[0]
    with pytest.raises(ValueError, match="column table is malformed"):
        call([(column, shift, base, candidate[:-1], threshold[:-1], values), *plan.columns[1:]])
    with pytest.raises(ValueError, match="column table is malformed"):
        call([(column, shift, base, candidate, threshold, values[:-1]), *plan.columns[1:]])
    with pytest.raises(ValueError, match="column table is malformed"):
        call([plan.columns[1], plan.columns[0], *plan.columns[2:]])
    with pytest.raises(ValueError, match="arguments out of range"):
        call(plan.columns[1:])
    with pytest.raises(ValueError, match="arguments out of range"):
        native.KERNEL.unrank(payload, 0, 0, 0, 16, 8, 41, count, plan.columns, out[:8], 2)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "kernel_encodes"),
    [
        (2, 1, False),
        (200, 199, False),
        (256, 10, True),  # C(256, 10) > 2**53: encoded natively, decoded by numpy (with its low-id table)
        (1024, 8, False),
        (40000, 3, False),
        (2, 2, False),
        (65, 64, True),
    ],
)
def test_geometries_beyond_the_kernel_fall_back_to_the_same_bytes(
    num_experts: int, top_k: int, kernel_encodes: bool
) -> None:
    """K = 1 (no network), C(E, K) = 1 (no bits), K beyond the network, C(E, K) >= 2**64 (Python-int
    ranks), E beyond int16: the kernel does not apply, or applies only to decode; either way the bytes
    and rows are the numpy path's and the reference's."""
    rng = np.random.default_rng(num_experts + top_k)
    bits = rank_bits(math.comb(num_experts, top_k))
    assert native.can_pack(num_experts, top_k, bits) is kernel_encodes
    rows_RK = distinct_rows(rng, 300, num_experts, top_k)
    rows_RK[::7] = -1
    trace = trace_of(rows_RK, num_experts)
    blob = codec.encode(trace)
    assert blob == codec.encode(trace, native=False)
    assert np.array_equal(codec.decode(blob).experts, np.sort(trace.experts, axis=2))
    assert np.array_equal(codec.decode(blob).experts, codec.decode(blob, native=False).experts)


def test_the_kernel_verdict_is_taken_once_per_unranker() -> None:
    """A geometry the kernel cannot decode keeps the numpy path's low-id table; one it can decode needs
    none; the verdict (a plan, or none) is kept on the unranker, not recomputed per call."""
    wide = math.comb(256, 10)
    assert not native.may_unrank(wide, 10) and native.may_unrank(math.comb(128, 8), 8)
    unranker = SubsetUnranker(binomial_table(128, 8, math.comb(128, 8)), math.comb(128, 8))
    plan = native.unrank_plan(unranker, math.comb(128, 8))
    assert plan is not None and native.unrank_plan(unranker, math.comb(128, 8)) is plan
    rows_RK = distinct_rows(np.random.default_rng(9), 5000, 256, 10)
    blob = codec.encode(trace_of(rows_RK, 256))
    from routereplay.codec.encoded import EncodedRoutes

    assert np.array_equal(EncodedRoutes(blob).rows(0, 5000).reshape(-1, 10), np.sort(rows_RK, axis=1))
