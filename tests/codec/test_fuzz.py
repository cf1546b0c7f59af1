"""Fuzzing `decode` (issue 11, Must show): random, mutated and forged blobs - a valid CRC over forged
header fields (huge T, L, K, E; zero-bit layouts; forged zstd sizes) - may only raise a
`RouteReplayError`, and no input may allocate more than `CodecLimits.memory_bound(len(blob))`
(tracemalloc peak). CPU is bounded by construction, not timed: every input is refused or decoded
within the limits, so the work is linear in min(max_entries, max_expansion * len(blob)) plus a table
of at most `max_set_table` words (`routereplay.codec.limits`). Examples are bounded by
`max_examples`; the project profile has no deadline."""

from __future__ import annotations

import struct

import numpy as np
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, Segment
from routereplay.codec.blob import bits_per_row, decode, encode, header_info
from routereplay.codec.header import CodecHeader
from routereplay.codec.limits import CodecLimits
from routereplay.errors import RouteReplayError
from tests.codec.blobs import FLAG_MISSING_ROWS, FLAG_ZSTD, forge, reseal, traced_peak
from tests.wire.payloads import distinct_routes

DEFAULT = CodecLimits()
TIGHT = CodecLimits(max_entries=1 << 16, max_expansion=64, max_set_table=1 << 12, chunk_entries=1 << 10)
HUGE = [2**21, 2**27, 2**31, 2**32, 2**40, 2**63, 2**64 - 1]


def check(blob: bytes, limits: CodecLimits = DEFAULT) -> None:
    """Decode under tracemalloc: a RouteTrace or a RouteReplayError, within the documented memory."""
    head, _ = traced_peak(lambda: header_info(blob, limits=limits))
    assert isinstance(head, (CodecHeader, RouteReplayError)), f"{type(head).__name__}: {head}"
    result, peak = traced_peak(lambda: decode(blob, limits=limits))
    assert isinstance(result, (RouteTrace, RouteReplayError)), f"{type(result).__name__}: {result}"
    event(type(result).__name__ + ("" if isinstance(result, RouteTrace) else f": {str(result)[:28]}"))
    bound = limits.memory_bound(len(blob))
    assert peak <= bound, f"{len(blob)}-byte blob peaked at {peak} bytes, above the documented {bound}"


@st.composite
def zstd_payloads(draw: st.DrawFn) -> tuple[bytes, int]:
    """A real zstd frame (of zeros or of random bytes), maybe cut short, with a raw size maybe forged."""
    size = draw(st.sampled_from([0, 1, 100, 4096, 1 << 16, 1 << 20]))
    content = bytes(size) if draw(st.booleans()) else draw(st.binary(min_size=min(size, 64), max_size=64)) * 4
    frame = zstandard.ZstdCompressor().compress(content)
    cut = draw(st.integers(1, len(frame))) if draw(st.booleans()) else len(frame)
    tail = draw(st.sampled_from([b"", b"\x00" * 8, frame]))
    raw_bytes = draw(st.sampled_from([len(content), len(content) + 1, len(content) - 1, *HUGE]))
    return frame[:cut] + tail, max(raw_bytes, 0)


def _row_bits(E: int, K: int, mode: int) -> int | None:
    """Payload bits of one routed row, or None when the layout is refused anyway (huge tables)."""
    if mode == 1:
        return K * (E - 1).bit_length()
    if mode != 0 or K > E or (E + 1) * (K + 1) > 1 << 16:
        return None
    return bits_per_row(E, K)


@st.composite
def consistent_payloads(draw: st.DrawFn, T: int, L: int, K: int, E: int, mode: int, flags: int) -> bytes | None:
    """A raw payload whose length fits the header (bitmap + packed rows), zero or random bits."""
    bits = _row_bits(E, K, mode)
    rows = T * L
    if bits is None or rows > 1 << 16:
        zero_bit = bits == 0 and not flags & FLAG_MISSING_ROWS
        return b"" if zero_bit else None  # zero-bit layouts: any T, no payload at all
    zero = draw(st.booleans())
    bitmap = b""
    routed = rows
    if flags & FLAG_MISSING_ROWS:
        size = -(-rows // 8)
        bitmap = bytes(size) if zero else draw(st.binary(min_size=size, max_size=size))
        valid = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=rows, bitorder="little")
        routed = int(valid.sum())
        if rows % 8 and bitmap:
            bitmap = bitmap[:-1] + bytes([bitmap[-1] & ((1 << (rows % 8)) - 1)])
    size = -(-routed * bits // 8) if mode == 1 or bits <= 64 else routed * 8 * -(-bits // 64)
    if size > 1 << 14:
        return None
    body = bytes(size) if zero else draw(st.binary(min_size=size, max_size=size))
    return bitmap + body


@st.composite
def forged_blobs(draw: st.DrawFn) -> bytes:
    """Header fields drawn from real, edge and absurd values; zero-bit layouts (K = E) on purpose;
    payloads of the right length half the time, so that the checks after the lengths run too."""
    mode = draw(st.sampled_from([0, 1] * 9 + [2]))
    E = draw(st.sampled_from([1, 2, 8, 128, 512, 1000, 2000, 2**15, 2**31, 2**32 - 1]) | st.integers(1, 300))
    K = draw(st.sampled_from([1, 2, 8, 10, 999, 1000, 2000, 65535, min(E, 65535)]) | st.integers(1, 16))
    T = draw(st.sampled_from([0, 1, 3, 8, 1000, 4096, *HUGE]) | st.integers(0, 5000))
    L = draw(st.integers(0, 6))
    flags = draw(st.sampled_from([0, FLAG_ZSTD, FLAG_MISSING_ROWS, FLAG_ZSTD | FLAG_MISSING_ROWS] * 4 + [8]))
    raw = draw(consistent_payloads(T, L, K, E, mode, flags)) if draw(st.booleans()) else None
    if raw is not None:
        payload = raw
        if flags & FLAG_ZSTD:  # a real frame of the right size, maybe cut short or followed by junk
            frame = zstandard.ZstdCompressor().compress(raw)
            payload = draw(st.sampled_from([frame] * 3 + [frame[: len(frame) // 2], frame + b"\x00", frame + frame]))
        raw_bytes = draw(st.sampled_from([len(raw)] * 4 + [len(raw) + 1, *HUGE]))
    elif flags & FLAG_ZSTD and draw(st.booleans()):
        payload, raw_bytes = draw(zstd_payloads())
    else:
        payload = draw(st.binary(max_size=300))
        raw_bytes = draw(st.sampled_from([len(payload), *HUGE]) | st.integers(0, 1 << 20))
    layers = draw(
        st.lists(st.integers(0, 2**32 - 1), min_size=L, max_size=L, unique=draw(st.sampled_from([True] * 9 + [False])))
    )
    start = draw(st.sampled_from([0, 5, 2**63]))
    segments = None if draw(st.booleans()) or T == 0 else [(start, start + T // 2), (start + T // 2, start + T)]
    if segments is not None and (start + T >= 2**64 or T < 2):
        segments = None
    return forge(
        T=T, L=L, K=K, E=E, mode=mode, flags=flags, payload=payload, raw_bytes=raw_bytes,
        layers=layers, segments=segments, start=min(start, 2**64 - 1 - T),
    )  # fmt: skip


@settings(max_examples=300)
@given(blob=forged_blobs(), tight=st.booleans())
def test_fuzz_forged_headers_with_valid_crc(blob: bytes, tight: bool) -> None:
    """Resource exhaustion / error that is not a RouteReplayError (issue 11 items 5, 6, 7, Must show):
    forged headers under a valid CRC - huge T, L, K, E, zero-bit layouts, forged zstd sizes - raise a
    RouteReplayError or decode, within `CodecLimits.memory_bound`."""
    check(blob, TIGHT if tight else DEFAULT)


def _samples() -> dict[str, bytes]:
    rng = np.random.default_rng(11)
    routed = RouteTrace(distinct_routes(rng, 40, 3, 8, 128), 128, segments=(Segment(0, 9), Segment(9, 40, "vllm", 2)))
    holes = distinct_routes(rng, 64, 2, 10, 512)
    holes[rng.random((64, 2)) < 0.4] = -1
    wide = RouteTrace(holes, 512)  # C(512, 10) >= 2**64: Python-int ranks
    unrouted = RouteTrace(np.full((300, 4, 8), -1, np.int16), 64)
    return {
        f"{name}-{mode}-{'zstd' if compress else 'raw'}": encode(trace, mode=mode, compress=compress)
        for name, trace in (("routed", routed), ("wide", wide), ("unrouted", unrouted))
        for mode in ("set", "ordered")
        for compress in (False, True)
    }


SAMPLES = _samples()


@settings(max_examples=200)
@given(key=st.sampled_from(sorted(SAMPLES)), data=st.data())
def test_fuzz_mutated_blobs_resealed(key: str, data: st.DataObject) -> None:
    """Error that is not a RouteReplayError (issue 11 Must show): bytes of real blobs flipped, cut,
    repeated or overwritten with extreme integers, then given a valid CRC: still only named errors,
    within the documented memory."""
    body = bytearray(SAMPLES[key][:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        action = data.draw(st.sampled_from(["flip", "u64", "u32", "cut", "repeat"]))
        if action == "flip":
            body[at] ^= data.draw(st.integers(1, 255))
        elif action in ("u64", "u32"):
            fmt = "<Q" if action == "u64" else "<I"
            value = data.draw(
                st.sampled_from([0, 1, 2**31, 2**32 - 1, *(h for h in HUGE if h < 2 ** (8 * struct.calcsize(fmt)))])
            )
            body[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        elif action == "cut":
            del body[at : at + data.draw(st.integers(1, 16))]
        else:
            body[at:at] = body[at : at + data.draw(st.integers(1, 16))]
        if not body:
            body = bytearray(b"R")
    check(reseal(bytes(body)))


@settings(max_examples=200)
@given(data=st.binary(max_size=400), prefix=st.sampled_from([b"", b"RRTC", b"RRTC\x01", b"RRTC\x01\x00\x02\x00"]))
def test_fuzz_random_bytes(data: bytes, prefix: bytes) -> None:
    """Error that is not a RouteReplayError (issue 11 Must show): arbitrary bytes, with or without the
    magic and version, resealed or not."""
    check(prefix + data)
    check(reseal(prefix + data))
