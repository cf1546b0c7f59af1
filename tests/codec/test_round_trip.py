"""The compact codec: round trips (set / ordered, zstd on / off), sizes, bit packing, every named
error, and fuzzing (only `RouteReplayError` may escape `decode`, whatever the bytes)."""

from __future__ import annotations

import itertools
import math
import struct
import sys
import tracemalloc
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, Segment, Source
from routereplay.bitpack import pack_bits, unpack_bits
from routereplay.codec.blob import bits_per_row, decode, encode, entropy_bits_per_row, header_info
from routereplay.codec.header import MAGIC, MIN_BLOB_BYTES
from routereplay.codec.subsets import count_at_most
from routereplay.enums import CodecMode
from routereplay.errors import (
    ChecksumError,
    CodecFormatError,
    CodecLimitError,
    CodecVersionError,
    ConfigError,
    DuplicateExpertError,
    RouteReplayError,
)
from tests.wire.payloads import distinct_routes

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OFFSET_T, OFFSET_LAYERS = 8, 34  # byte offsets of fixed header fields (see the codec docstring)


def reseal(body: bytes) -> bytes:
    """Append a correct CRC32: a forged blob that passes the checksum and must still be parsed safely."""
    return body + struct.pack("<I", zlib.crc32(body))


def patch(blob: bytes, offset: int, new: bytes) -> bytes:
    body = bytearray(blob[:-4])
    body[offset : offset + len(new)] = new
    return reseal(bytes(body))


def payload_offset(blob: bytes) -> int:
    return len(blob) - 4 - header_info(blob).stored_payload_bytes


def make_trace(rng: np.random.Generator, T: int, L: int, K: int, E: int, missing: float = 0.0, **kw: Any) -> RouteTrace:
    routes = distinct_routes(rng, T, L, K, E)
    routes[rng.random((T, L)) < missing] = -1
    return RouteTrace(routes, E, **kw)


@st.composite
def traces(draw: st.DrawFn) -> RouteTrace:
    E = draw(st.integers(1, 600))
    K = draw(st.integers(1, min(E, 12)))
    L = draw(st.integers(1, 6))
    T = draw(st.integers(0, 31 if E == 1 else 40))  # E = 1 with >= 32 rows is an all-zero layer: invalid
    start = draw(st.integers(0, 2**40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    routes = distinct_routes(rng, T, L, K, E)
    routes[rng.random((T, L)) < draw(st.sampled_from([0.0, 0.2, 0.7, 1.0]))] = -1
    layers = draw(st.lists(st.integers(0, 2**32 - 1), min_size=L, max_size=L, unique=True))
    cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=3))) if T > 1 else []
    bounds = [start, *(start + c for c in cuts), start + T] if T else []
    sources = st.sampled_from(list(Source)) | st.text(max_size=10)
    versions = st.none() | st.integers(0, 2**63 - 1)
    segments = tuple(Segment(b, e, draw(sources), draw(versions)) for b, e in itertools.pairwise(bounds))
    return RouteTrace(routes, E, layers, start, segments)


# --- round trips ------------------------------------------------------------------------------


@FAST
@given(trace=traces(), compress=st.booleans())
def test_round_trip(trace: RouteTrace, compress: bool) -> None:
    blob = encode(trace, compress=compress)
    back = decode(blob)
    assert back == trace.sorted_rows() and back.equal_sets(trace)
    assert back.experts.dtype == trace.experts.dtype
    assert encode(back, compress=compress) == blob, "set-mode encoding must be canonical"
    ordered = encode(trace, mode="ordered", compress=compress)
    assert decode(ordered) == trace, "ordered mode must keep the id order inside each row exactly"
    info = header_info(blob)
    assert (info.num_tokens, info.num_layers, info.top_k, info.num_experts) == (
        trace.num_tokens,
        trace.num_layers,
        trace.top_k,
        trace.num_experts,
    )
    assert (info.start, info.layers, info.segments, info.compressed) == (
        trace.start,
        trace.layers,
        trace.segments,
        compress,
    )
    assert info.has_missing_rows == bool((trace.experts[..., 0] < 0).any())
    assert (info.total_bytes, info.mode) == (len(blob), CodecMode.SET)


def test_ordered_keeps_order_set_sorts(rng: np.random.Generator) -> None:
    trace = make_trace(rng, 20, 3, 4, 16)
    assert not np.array_equal(trace.experts, trace.sorted_rows().experts)  # the test needs unsorted rows
    assert np.array_equal(decode(encode(trace, mode=CodecMode.ORDERED)).experts, trace.experts)
    assert np.array_equal(decode(encode(trace)).experts, np.sort(trace.experts, axis=2))


def test_buffer_types_and_empty_trace(rng: np.random.Generator) -> None:
    blob = encode(make_trace(rng, 5, 2, 2, 8))
    assert decode(bytearray(blob)) == decode(memoryview(blob)) == decode(blob)
    empty = RouteTrace(np.zeros((0, 3, 2), np.int16), 8, start=7)
    assert decode(encode(empty, compress=True)) == empty


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_wide_ranks_fallback_and_int32_ids(rng: np.random.Generator, mode: str) -> None:
    count = math.comb(512, 10)
    bits = bits_per_row(512, 10)
    assert bits > 64 and 2 ** (bits - 1) < count <= 2**bits  # bits = ceil(log2 C(512, 10)), exactly
    for E, K in [(512, 10), (40000, 3), (70000, 1)]:  # C(512, 10) >= 2**64; E > 32767: int32 ids
        trace = make_trace(rng, 30, 3, K, E, missing=0.2)
        back = decode(encode(trace, mode=mode, compress=True))
        assert back.experts.dtype == (np.int32 if E > 32767 else np.int16)
        assert back == (trace if mode == "ordered" else trace.sorted_rows())


def test_zero_bit_rows() -> None:
    full = RouteTrace(np.tile(np.arange(4), (6, 2, 1)), 4)  # K == E: one possible set, 0 bits per row
    blob = encode(full)
    assert header_info(blob).raw_payload_bytes == 0 and decode(blob) == full
    one = RouteTrace(np.zeros((20, 2, 1), np.int16), 1)  # E == 1: 0 bits per id
    assert decode(encode(one, mode="ordered")) == one == decode(encode(one))


# --- sizes ------------------------------------------------------------------------------------


def test_bits_per_row_and_entropy() -> None:
    assert bits_per_row(128, 8) == 41 and bits_per_row(128, 8, "ordered") == 56
    assert bits_per_row(256, 8) == 49 and bits_per_row(8, 8) == 0 and bits_per_row(1, 1, "ordered") == 0
    assert entropy_bits_per_row(128, 8) == pytest.approx(math.log2(math.comb(128, 8)), rel=1e-12)
    assert entropy_bits_per_row(100_000, 6000) == pytest.approx(math.log2(math.comb(100_000, 6000)), rel=1e-9)
    with pytest.raises(ConfigError, match="top_k <= num_experts"):
        bits_per_row(4, 5)


def test_payload_sizes_are_exact(rng: np.random.Generator) -> None:
    trace = make_trace(rng, 64, 3, 8, 128, missing=0.25)
    rows = 64 * 3
    routed = int((trace.experts[..., 0] >= 0).sum())
    assert 0 < routed < rows
    assert header_info(encode(trace)).raw_payload_bytes == math.ceil(rows / 8) + math.ceil(41 * routed / 8)
    assert header_info(encode(trace, mode="ordered")).raw_payload_bytes == math.ceil(rows / 8) + 7 * routed
    full = make_trace(rng, 64, 3, 8, 128)
    assert header_info(encode(full)).raw_payload_bytes == math.ceil(41 * rows / 8)


def test_set_mode_is_within_two_percent_of_entropy(rng: np.random.Generator) -> None:
    trace = make_trace(rng, 4096, 4, 8, 128)
    blob = encode(trace)
    overhead = len(blob) - header_info(blob).raw_payload_bytes
    assert overhead < 128
    assert len(blob) <= 1.02 * entropy_bits_per_row(128, 8) / 8 * 4096 * 4 + overhead


# --- bit packing ------------------------------------------------------------------------------


@FAST
@given(bits=st.integers(0, 64), count=st.integers(0, 70), seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_matches_reference(bits: int, count: int, seed: int) -> None:
    values = np.random.default_rng(seed).integers(0, 2**bits, count, dtype=np.uint64, endpoint=False)
    packed = pack_bits(values, bits)
    reference = sum(int(v) << (i * bits) for i, v in enumerate(values))  # value i at bit i * bits, LSB first
    assert packed == reference.to_bytes(math.ceil(count * bits / 8), "little")
    assert np.array_equal(unpack_bits(packed, count, bits), values)


def test_pack_masks_and_unpack_refuses_short_buffer() -> None:
    assert pack_bits(np.array([0xFF, 0x01], np.uint64), 3) == bytes([0b001111])
    with pytest.raises(CodecFormatError, match="need 4"):
        unpack_bits(b"\x00\x00\x00", 4, 7)


@FAST
@given(
    table=st.lists(st.integers(0, 2**64 - 2), min_size=1, max_size=300),
    queries=st.lists(st.integers(0, 2**64 - 2), max_size=50),
)
def test_bucketed_search_equals_searchsorted(table: list[int], queries: list[int]) -> None:
    sorted_M = np.sort(np.array(table, np.uint64))
    queries_N = np.array(queries, np.uint64)
    assert np.array_equal(count_at_most(sorted_M, queries_N), np.searchsorted(sorted_M, queries_N, side="right"))


# --- named errors -----------------------------------------------------------------------------


@pytest.fixture
def blob(rng: np.random.Generator) -> bytes:
    return encode(make_trace(rng, 12, 2, 2, 8, missing=0.3, segments=(Segment(0, 5), Segment(5, 12, "vllm", 3))))


def test_bad_magic_and_type(blob: bytes) -> None:
    with pytest.raises(CodecFormatError, match=r"bad magic b'XRTC'.*not a routereplay codec blob"):
        decode(b"X" + blob[1:])
    with pytest.raises(ConfigError, match="base64"):
        decode("UlJUQw==")  # type: ignore[arg-type]


def test_unknown_version(blob: bytes) -> None:
    with pytest.raises(CodecVersionError, match=r"version 2 .*reads version.* 1: upgrade routereplay"):
        decode(patch(blob, 4, b"\x02"))


def test_checksum_mismatch(blob: bytes) -> None:
    tampered = bytearray(blob)
    tampered[payload_offset(blob)] ^= 0x10
    with pytest.raises(ChecksumError, match="corrupted or tampered"):
        decode(bytes(tampered))
    with pytest.raises(ChecksumError, match="CRC32 mismatch"):
        header_info(blob[:-1] + bytes([blob[-1] ^ 1]))


@pytest.mark.parametrize("cut", [1, 7, 30])
def test_truncated(blob: bytes, cut: int) -> None:
    with pytest.raises(CodecFormatError, match="truncated"):
        decode(blob[:-cut])
    with pytest.raises(CodecFormatError, match="truncated"):
        decode(blob[: MIN_BLOB_BYTES - 1])
    with pytest.raises(CodecFormatError, match="truncated"):
        decode(MAGIC[:2])


def test_trailing_bytes(blob: bytes) -> None:
    with pytest.raises(CodecFormatError, match="trailing bytes"):
        decode(blob + b"\x00\x01\x02")


@pytest.mark.parametrize("rank", [6, 7])
def test_rank_out_of_range_and_id_out_of_range(rank: int) -> None:
    trace = RouteTrace(np.array([[[1, 3]]]), 4)  # C(4, 2) = 6 sets: ranks 0..5 in 3 bits
    blob = encode(trace)
    with pytest.raises(CodecFormatError, match=rf"rank {rank} >= C\(4, 2\)"):
        decode(patch(blob, payload_offset(blob), bytes([rank])))
    ordered = encode(RouteTrace(np.array([[[4]]]), 5), mode="ordered")  # ids in 3 bits: 5..7 impossible
    with pytest.raises(CodecFormatError, match="expert id 7 >= E=5"):
        decode(patch(ordered, payload_offset(ordered), b"\x07"))


def test_padding_bits_must_be_zero() -> None:
    trace = RouteTrace(np.array([[[2]], [[-1]], [[3]]]), 4)  # 3 rows: bitmap 0b101, 2 ranks of 2 bits
    blob = encode(trace)
    at = payload_offset(blob)
    assert blob[at : at + 2] == bytes([0b101, 0b1110])
    with pytest.raises(CodecFormatError, match="bitmap has padding bits"):
        decode(patch(blob, at, bytes([0b10000101])))
    with pytest.raises(CodecFormatError, match="padding bits set after bit 4"):
        decode(patch(blob, at + 1, bytes([0b11110])))


def test_missing_rows_flag_needs_a_missing_row() -> None:
    blob = encode(RouteTrace(np.array([[[0, 1]], [[-1, -1]], [[1, 0]]]), 2))  # K == E: rows cost 0 bits
    assert header_info(blob).raw_payload_bytes == 1  # just the bitmap 0b101
    with pytest.raises(CodecFormatError, match="marks none"):
        decode(patch(blob, payload_offset(blob), bytes([0b111])))


def test_reserved_mode_and_segment_fields(blob: bytes) -> None:
    with pytest.raises(CodecFormatError, match="reserved byte 1"):
        decode(patch(blob, 7, b"\x01"))
    with pytest.raises(CodecFormatError, match="mode byte"):
        decode(patch(blob, 5, b"\x07"))
    first_segment = OFFSET_LAYERS + 2 * 4 + 4
    with pytest.raises(CodecFormatError, match="segment 0 at byte offset 46"):
        decode(patch(blob, first_segment + 16, struct.pack("<q", -5)))  # policy_version -5
    second_segment = first_segment + 26 + len("unknown")
    with pytest.raises(CodecFormatError, match=r"segment 1 .*malformed"):
        decode(patch(blob, second_segment, struct.pack("<Q", 4)))  # begins at 4, not 5
    with pytest.raises(CodecFormatError, match=r"layer numbers .* repeat"):
        decode(patch(blob, OFFSET_LAYERS, struct.pack("<II", 3, 3)))


def test_bomb_headers_fail_before_allocating() -> None:
    tracemalloc.start()
    try:
        # K == E: 0 payload bits per row, so only max_entries stands between 2**40 rows and the allocator
        blob = encode(RouteTrace(np.tile(np.arange(8), (1, 1, 1)), 8))
        segment_end = OFFSET_LAYERS + 4 + 4 + 8
        huge = patch(patch(blob, OFFSET_T, struct.pack("<Q", 2**40)), segment_end, struct.pack("<Q", 2**40))
        assert header_info(huge).num_tokens == 2**40  # the header itself is consistent
        with pytest.raises(CodecLimitError, match="above CodecLimits.max_entries"):
            decode(huge)
        # a tiny zstd payload claiming a bitmap of 2**27 bytes: more than any zstd frame can inflate to
        missing = encode(RouteTrace(np.array([[[1]], [[-1]]]), 2), compress=True)
        lengths = payload_offset(missing) - 16
        bomb = patch(patch(missing, OFFSET_T, struct.pack("<Q", 2**30)), segment_end, struct.pack("<Q", 2**30))
        with pytest.raises(CodecFormatError, match="zip bomb"):
            decode(patch(bomb, lengths, struct.pack("<Q", 2**27)))
        with pytest.raises(CodecFormatError, match="does not fit"):
            decode(patch(missing, lengths, struct.pack("<Q", 2**40)))
        assert tracemalloc.get_traced_memory()[1] < 8 * 2**20
    finally:
        tracemalloc.stop()


def test_corrupt_zstd_payload_with_valid_crc(rng: np.random.Generator) -> None:
    packed = encode(make_trace(rng, 40, 2, 2, 8), compress=True)
    with pytest.raises(CodecFormatError, match=r"zstd payload at byte offset .* not one valid zstd frame"):
        decode(patch(packed, payload_offset(packed), b"\x00"))  # breaks the zstd magic number


def test_encode_refuses_invalid_traces_and_arguments(rng: np.random.Generator) -> None:
    with pytest.raises(DuplicateExpertError):
        encode(RouteTrace(np.array([[[1, 1]]]), 4))
    trace = make_trace(rng, 2, 1, 2, 8)
    with pytest.raises(ConfigError, match="'sorted' is not a codec mode"):
        encode(trace, mode="sorted")
    with pytest.raises(ConfigError, match="zstd level"):
        encode(trace, compress=True, level=99)
    with pytest.raises(ConfigError, match="layer number = 4294967296"):
        encode(RouteTrace(trace.experts, 8, layers=(2**32,)))
    with pytest.raises(ConfigError, match="use mode='ordered'"):
        encode(make_trace(rng, 2, 1, 8, 500_000))  # the set-mode binomial table would be too large
    assert decode(encode(make_trace(rng, 2, 1, 8, 500_000), mode="ordered")).num_experts == 500_000


def test_missing_zstandard_names_the_extra(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    packed = encode(make_trace(rng, 4, 1, 2, 8), compress=True)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"routereplay\[zstd\]"):
        encode(make_trace(rng, 4, 1, 2, 8), compress=True)
    with pytest.raises(ImportError, match=r"routereplay\[zstd\]"):
        decode(packed)


# --- fuzzing: nothing but RouteReplayError may escape --------------------------------------------


def _decode_or_codec_error(data: bytes) -> None:
    try:
        decode(data)
    except RouteReplayError:
        pass  # any other exception type fails the test


@FAST
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_codec_error(data)
    _decode_or_codec_error(MAGIC + b"\x01" + data)


@FAST
@given(
    fields=st.tuples(*(st.integers(0, n) for n in (2, 3, 1, 5, 3, 3, 9, 3))),
    tail=st.binary(max_size=120),
)
def test_fuzz_forged_headers_with_valid_crc(fields: tuple[int, ...], tail: bytes) -> None:
    mode, flags, reserved, T, L, K, E, start = fields
    header = struct.pack("<4sBBBBQIHIQ", MAGIC, 1, mode, flags, reserved, T, L, K, E, start)
    _decode_or_codec_error(reseal(header + tail))


_SAMPLE = make_trace(np.random.default_rng(7), 9, 3, 3, 10, 0.3, segments=(Segment(0, 4), Segment(4, 9, "hf", 1)))
SAMPLES = {
    (mode, zstd): encode(_SAMPLE, mode=mode, compress=bool(zstd)) for mode in ("set", "ordered") for zstd in (0, 1)
}


@FAST
@given(key=st.sampled_from(sorted(SAMPLES)), data=st.data())
def test_fuzz_mutated_blobs(key: tuple[str, int], data: st.DataObject) -> None:
    blob = SAMPLES[key]
    at = data.draw(st.integers(0, len(blob) - 1))
    flipped = bytearray(blob)
    flipped[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(RouteReplayError):
        decode(bytes(flipped))
    with pytest.raises(RouteReplayError):
        decode(blob[: data.draw(st.integers(0, len(blob) - 1))])
    _decode_or_codec_error(reseal(bytes(flipped[:-4])))  # forged CRC: parsed to the end, still safe
