"""`CodecLimits`: tiny blobs that declare huge traces are refused before allocating (issue 11 items 5,
6, 7), decoding peaks at the output plus a fixed working set, and codec arguments of the wrong type
are `ConfigError`s (item 13). Memory is measured with tracemalloc; nothing here measures time."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard

from routereplay import RouteTrace
from routereplay.bitpack import pack_bits, unpack_bits
from routereplay.codec.blob import bits_per_row, decode, encode, entropy_bits_per_row, header_info
from routereplay.codec.limits import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_EXPANSION,
    DEFAULT_MAX_SET_TABLE,
    WORKING_BYTES_PER_ENTRY,
    CodecLimits,
)
from routereplay.errors import CodecError, CodecFormatError, CodecLimitError, ConfigError
from tests.codec.blobs import FLAG_MISSING_ROWS, FLAG_ZSTD, ORDERED, SET, forge, traced_peak
from tests.wire.payloads import distinct_routes

MiB = 1 << 20


def payload_of(blob: bytes) -> bytes:
    info = header_info(blob)
    return blob[len(blob) - 4 - info.stored_payload_bytes : len(blob) - 4]


# --- item 5: zero-bit layouts --------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "K", "E"), [(ORDERED, 1, 1), (SET, 8, 8)], ids=["ordered-E1", "set-K=E"])
def test_zero_bit_layouts_cannot_declare_unbounded_rows(mode: int, K: int, E: int) -> None:
    """Resource exhaustion (issue 11 item 5): a layout of 0 payload bits per row (ordered with E = 1,
    set with K = E) let an 88-byte blob decode into any number of rows (1e8 rows: 954 MiB). The
    declared ids are now bounded by `max_expansion` x the blob's size and by `max_entries`, both
    checked before anything is allocated."""
    rows = 1 << 21  # 4 MiB of int16 ids from ~90 bytes: the old decoder allocated ~10x that
    blob = forge(T=rows, L=1, K=K, E=E, mode=mode)
    assert len(blob) < 100
    error, peak = traced_peak(lambda: decode(blob))
    assert isinstance(error, CodecLimitError), error
    assert "max_expansion" in str(error) and f"{rows} x 1 x {K}" in str(error)
    assert peak < MiB
    huge = forge(T=1 << 32, L=1, K=K, E=E, mode=mode)  # T = 2**32: 8 GiB of ids at least
    with pytest.raises(CodecLimitError, match=r"above CodecLimits\.max_entries=268435456"):
        decode(huge)
    with pytest.raises(CodecLimitError, match="max_entries"):
        decode(huge, limits=CodecLimits(max_expansion=1 << 40))
    # a trusted zero-bit blob decodes when the caller raises the limit, into exactly those rows
    small = forge(T=4096, L=1, K=K, E=E, mode=mode)
    trace = decode(small, limits=CodecLimits(max_expansion=1 << 20))
    assert trace.experts.shape == (4096, 1, K) and (trace.experts == np.arange(K)).all()


def test_zero_bit_traces_that_encode_makes_still_round_trip() -> None:
    """Resource exhaustion (issue 11 item 5): the new bound must not refuse what `encode` writes for a
    real, small zero-bit trace (the default expansion limit sits far above it)."""
    full = RouteTrace(np.tile(np.arange(4), (600, 2, 1)), 4)  # K == E
    assert header_info(encode(full)).raw_payload_bytes == 0
    assert decode(encode(full)) == full


# --- item 6: set-mode table -----------------------------------------------------------------------


def test_set_mode_table_is_bounded_before_it_is_built() -> None:
    """Resource exhaustion (issue 11 item 6): set mode with E = K = 2000 in an 88-byte blob took 11-21 s
    of CPU building a 4e6-entry table of Python ints. The table is bounded by `max_set_table` (checked
    from the header alone), built in uint64 when ranks fit, and skipped when K = E."""
    blob = forge(T=3, L=1, K=2000, E=2000, mode=SET)
    assert len(blob) == 88
    error, peak = traced_peak(lambda: decode(blob))
    assert isinstance(error, CodecLimitError) and "max_set_table" in str(error), error
    assert peak < MiB
    with pytest.raises(CodecLimitError, match=r"CodecLimits\.max_set_table=1048576"):
        header_info(blob)
    # raised limit: C(2000, 2000) = 1, so no table at all - three rows of every expert
    raised = CodecLimits(max_set_table=1 << 23)
    trace, peak = traced_peak(lambda: decode(blob, limits=raised))
    assert isinstance(trace, RouteTrace) and (trace.experts == np.arange(2000)).all()
    assert peak < MiB
    # E = 2000, K = 1999: 11 bits a row and a real table: bounded by the documented figure
    one_row = forge(T=1, L=1, K=1999, E=2000, mode=SET, payload=pack_bits(np.array([1234], np.uint64), 11))
    trace, peak = traced_peak(lambda: decode(one_row, limits=raised))
    assert isinstance(trace, RouteTrace), trace
    missing = set(range(2000)) - set(trace.experts.ravel().tolist())
    assert missing == {1999 - 1234}  # rank = sum_i C(c_i, i + 1) = number of ids above the missing one
    assert peak <= raised.memory_bound(len(one_row))


def test_set_mode_tables_of_real_models_fit_the_default() -> None:
    """Resource exhaustion (issue 11 item 6): the table bound leaves every real model's set mode alone
    (E = 512, K = 10 needs exact Python-int ranks; E = 1024, K = 32 ranks of 4 words)."""
    rng = np.random.default_rng(3)
    for E, K in [(128, 8), (256, 8), (384, 8), (512, 10), (1024, 32)]:
        trace = RouteTrace(distinct_routes(rng, 5, 2, K, E), E)
        assert decode(encode(trace)) == trace.sorted_rows()
    with pytest.raises(ConfigError, match="use mode='ordered'"):
        encode(RouteTrace(distinct_routes(rng, 2, 1, 8, 70000), 70000))


# --- item 7: zstd and intermediates ---------------------------------------------------------------


def test_zstd_frame_is_proven_before_its_buffer_is_allocated() -> None:
    """Resource exhaustion (issue 11 item 7): a zstd frame claiming 2.56 GiB got its buffer allocated
    before the refusal (MemoryError under a memory cap). Now the claim is checked against the limits
    first, and a frame that passes them is inflated in 1 MiB pieces into nothing until it has proven
    its size; a lying frame never gets its claimed buffer."""
    rows = 1 << 27  # all -1: the raw payload is the 16 MiB bitmap, all zero bits
    frame = zstandard.ZstdCompressor().compress(bytes(rows // 8))
    junk = bytes(range(256)) * 4  # after the frame: one more "frame" that is not one
    flags = FLAG_ZSTD | FLAG_MISSING_ROWS
    blob = forge(T=rows, L=1, K=1, E=2, flags=flags, payload=frame + junk, raw_bytes=rows // 8)
    assert (rows // 8) <= len(frame + junk) * 32768  # within zstd's own ratio: only the limits stop it
    error, peak = traced_peak(lambda: decode(blob))
    assert isinstance(error, CodecLimitError) and "max_expansion" in str(error), error
    assert peak < 2 * MiB  # the old decoder allocated the 16 MiB claim, then refused
    trusting = CodecLimits(max_expansion=1 << 30)
    error, peak = traced_peak(lambda: decode(blob, limits=trusting))
    assert isinstance(error, CodecFormatError) and "zstd payload at byte offset" in str(error), error
    assert peak < 3 * MiB
    short = forge(T=rows, L=1, K=1, E=2, flags=flags, payload=frame[: len(frame) // 2] + junk, raw_bytes=rows // 8)
    error, peak = traced_peak(lambda: decode(short, limits=trusting))
    assert isinstance(error, CodecFormatError), error
    assert peak < 3 * MiB


def test_compressed_unrouted_trace_is_a_bomb_within_old_limits() -> None:
    """Resource exhaustion (issue 11 item 7): a genuine blob - a zstd trace of only -1 rows - of a few
    hundred bytes expanded to 16 MiB here (1.4 KB to 625 MiB in the report). `max_expansion` refuses
    it before allocating, with a message naming the limit and the fix; raised, it decodes exactly."""
    T, L, K = 1 << 16, 16, 8
    trace = RouteTrace(np.full((T, L, K), -1, np.int16), 128)
    blob = encode(trace, compress=True)
    assert len(blob) < 2048
    error, peak = traced_peak(lambda: decode(blob))
    assert isinstance(error, CodecLimitError), error
    assert "re-encode it without compress=True" in str(error) and "max_expansion=4096" in str(error)
    assert peak < MiB
    assert decode(encode(trace)) == trace  # uncompressed, the same trace is within the default: 128x
    output = trace.experts.nbytes
    back, peak = traced_peak(lambda: decode(blob, limits=CodecLimits(max_expansion=1 << 20)))
    assert back == trace
    assert peak <= output + T * L // 8 + WORKING_BYTES_PER_ENTRY * CodecLimits().chunk_entries


@pytest.mark.parametrize(("mode", "K", "compress"), [("set", 1, False), ("ordered", 1, True), ("set", 8, False)])
def test_peak_memory_is_the_output_plus_a_fixed_working_set(mode: str, K: int, compress: bool) -> None:
    """Resource exhaustion (issue 11 item 7): intermediates were 4-5x the output (uint64 copies of every
    id, a full-size bitmap and gather). Rows are now decoded `chunk_entries` ids at a time into the
    output array: peak <= output + zstd payload + WORKING_BYTES_PER_ENTRY * chunk_entries + table."""
    rng = np.random.default_rng(0)
    T, E = (1 << 21) // K, 64
    routes = distinct_routes(rng, T, 1, K, E) if K > 1 else rng.integers(0, E, (T, 1, 1))
    routes[rng.random((T, 1)) < 0.3] = -1
    trace = RouteTrace(routes, E)
    blob = encode(trace, mode=mode, compress=compress)
    limits = CodecLimits(chunk_entries=1 << 12)
    back, peak = traced_peak(lambda: decode(blob, limits=limits))
    assert back == (trace if mode == "ordered" else trace.sorted_rows())
    raw = header_info(blob).raw_payload_bytes if compress else 0
    table = 200 * (K + 1) * E  # the set-mode table and its searches: < 200 bytes an entry here
    bound = trace.experts.nbytes + raw + WORKING_BYTES_PER_ENTRY * limits.chunk_entries + table + 64 * 1024
    assert peak <= bound, f"peak {peak} > bound {bound} (output {trace.experts.nbytes})"


def test_default_limits_admit_real_traces() -> None:
    """Resource exhaustion (issue 11 item 7): the limits are real but sensible - a 128k-token x 96-layer x
    top-8 trace of 128 experts, routed or with a -1 prefix, passes every default bound."""
    limits = CodecLimits()
    assert (limits.max_entries, limits.max_expansion, limits.max_set_table) == (
        DEFAULT_MAX_ENTRIES,
        DEFAULT_MAX_EXPANSION,
        DEFAULT_MAX_SET_TABLE,
    )
    T, L, K, E = 131072, 96, 8, 128
    blob_bytes = math.ceil(T * L * bits_per_row(E, K) / 8) + 600
    limits.check_shape(T, L, K, 2, blob_bytes)  # raises if refused
    unrouted_prefix = math.ceil(T * L / 8) + math.ceil(T // 2 * L * bits_per_row(E, K) / 8)
    limits.check_shape(T, L, K, 2, unrouted_prefix)
    limits.check_set_table(E, K, 1, "test")
    with pytest.raises(CodecLimitError, match="max_entries"):
        limits.check_shape(4 * T, L, K, 2, 4 * blob_bytes)


# --- item 13: arguments of the wrong type ------------------------------------------------------------


def _blob() -> bytes:
    return encode(RouteTrace(np.array([[[1, 3]], [[0, 2]]]), 4))


WRONG_ARGUMENTS: dict[str, Callable[[], Any]] = {
    "limits=5": lambda: decode(_blob(), limits=5),  # type: ignore[arg-type]
    "max_entries=None field": lambda: CodecLimits(max_entries=None),  # type: ignore[arg-type]
    "max_entries='1'": lambda: decode(_blob(), max_entries="1"),  # type: ignore[arg-type]
    "max_expansion=0": lambda: CodecLimits(max_expansion=0),
    "max_set_table=1.5": lambda: CodecLimits(max_set_table=1.5),  # type: ignore[arg-type]
    "chunk_entries=True": lambda: CodecLimits(chunk_entries=True),
    "chunk_entries=7": lambda: CodecLimits(chunk_entries=7),
    "blob=None": lambda: decode(None),  # type: ignore[arg-type]
    "header_info(limits=[])": lambda: header_info(_blob(), limits=[]),  # type: ignore[arg-type]
    "encode(None)": lambda: encode(None),  # type: ignore[arg-type]
    "mode=None": lambda: encode(RouteTrace(np.zeros((1, 1, 1), np.int16), 2), mode=None),  # type: ignore[arg-type]
    "mode=[]": lambda: encode(RouteTrace(np.zeros((1, 1, 1), np.int16), 2), mode=[]),  # type: ignore[arg-type]
    "compress=None": lambda: encode(RouteTrace(np.zeros((1, 1, 1), np.int16), 2), compress=None),  # type: ignore[arg-type]
    "level=True": lambda: encode(RouteTrace(np.zeros((1, 1, 1), np.int16), 2), compress=True, level=True),
    "bits_per_row(None, 8)": lambda: bits_per_row(None, 8),  # type: ignore[arg-type]
    "bits_per_row(8, '2')": lambda: bits_per_row(8, "2"),  # type: ignore[arg-type]
    "entropy_bits_per_row(128, None)": lambda: entropy_bits_per_row(128, None),  # type: ignore[arg-type]
    "pack_bits(bits=None)": lambda: pack_bits(np.zeros(3, np.uint64), None),  # type: ignore[arg-type]
    "unpack_bits(count=None)": lambda: unpack_bits(b"\x00", None, 3),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", sorted(WRONG_ARGUMENTS))
def test_codec_arguments_of_the_wrong_type_are_config_errors(case: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): `None` or a wrong type for a codec
    argument raised TypeError from deep inside; it is a ConfigError naming the argument."""
    with pytest.raises(ConfigError):
        WRONG_ARGUMENTS[case]()


def test_limit_errors_are_codec_errors() -> None:
    """Misleading message (issue 11 item 7): a limit refusal is a CodecError (callers that catch codec
    failures keep working) and names the limit to raise."""
    assert issubclass(CodecLimitError, CodecError) and issubclass(CodecLimitError, ValueError)
    with pytest.raises(CodecLimitError, match=r"decode\(blob, limits=CodecLimits\(max_entries=\.\.\.\)\)"):
        decode(_blob(), max_entries=3)


@pytest.mark.parametrize(("mode", "K", "E"), [("set", 3, 40), ("ordered", 7, 300), ("set", 10, 512), ("set", 900, 900)])
def test_chunked_decode_is_exact_across_step_boundaries(mode: str, K: int, E: int) -> None:
    """Silent misroute (issue 11 item 7): decoding in steps of `chunk_entries` ids - steps that start
    mid-byte in the bitmap and mid-group in the bit streams - must give the very rows of one pass."""
    rng = np.random.default_rng(K)
    T = 3000 if K < 100 else 40
    routes = distinct_routes(rng, T, 2, K, E)
    routes[rng.random((T, 2)) < 0.45] = -1
    trace = RouteTrace(routes, E)
    expected = trace if mode == "ordered" else trace.sorted_rows()
    for compress in (False, True):
        blob = encode(trace, mode=mode, compress=compress)
        for chunk in (1024, 1031, 1 << 18):
            back = decode(blob, limits=CodecLimits(chunk_entries=chunk))
            assert back == expected, (compress, chunk)
