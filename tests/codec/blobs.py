"""Codec blobs forged field by field, with a valid CRC (for the codec's limit and fuzz tests).

A forged blob passes the checksum, so everything after it - lengths, shape, limits, payload - must
be refused on its own merits. `forge` writes the version 1 layout of `routereplay.codec`.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from typing import Any

FIXED = struct.Struct("<4sBBBBQIHIQ")  # magic, version, mode, flags, reserved, T, L, K, E, start
SEGMENT = struct.Struct("<QQqH")  # begin, end, policy_version, source-name length
LENGTHS = struct.Struct("<QQ")  # raw, stored payload length
SET, ORDERED = 0, 1
FLAG_ZSTD, FLAG_MISSING_ROWS = 1, 2


def reseal(body: bytes) -> bytes:
    """Append a correct CRC32: a forged blob that passes the checksum and must still be parsed safely."""
    return body + struct.pack("<I", zlib.crc32(body))


def forge(
    *,
    T: int,
    L: int,
    K: int,
    E: int,
    mode: int = SET,
    flags: int = 0,
    payload: bytes = b"",
    raw_bytes: int | None = None,
    layers: Sequence[int] | None = None,
    segments: Sequence[tuple[int, int]] | None = None,
    start: int = 0,
) -> bytes:
    """A CRC-valid blob with these header fields; one segment covering the rows unless told."""
    layer_bytes = struct.pack(f"<{L}I", *(range(L) if layers is None else layers))
    if segments is None:
        segments = [(start, start + T)] if T else []
    segment_bytes = struct.pack("<I", len(segments)) + b"".join(
        SEGMENT.pack(begin, end, -1, 0) for begin, end in segments
    )
    lengths = LENGTHS.pack(len(payload) if raw_bytes is None else raw_bytes, len(payload))
    head = FIXED.pack(b"RRTC", 1, mode, flags, 0, T, L, K, E, start)
    return reseal(head + layer_bytes + segment_bytes + lengths + payload)


def traced_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """(result or the exception raised, peak bytes traced by tracemalloc while `call` ran)."""
    tracemalloc.start()
    try:
        try:
            result: Any = call()
        except Exception as error:  # the caller asserts on the type
            result = error
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
