"""The codec blob's envelope and header: the version-1 layout, packed by `encode`, parsed checked.

Version 1 layout, all integers little-endian (offsets in bytes):

    0   4     magic b"RRTC"
    4   u8    version (1)
    5   u8    mode: 0 = set, 1 = ordered
    6   u8    flags: bit 0 = payload is zstd-compressed, bit 1 = some rows are all -1 (bitmap present),
              bit 2 = token ids present (a blob without it decodes with `token_ids` None),
              bit 3 = router slot names present (layers holding several routers, `RouteTrace.slots`),
              bit 4 = DSA indexer choices present (`RouteTrace.indexer`),
              bit 5 = combine weights present (`RouteTrace.weights`)
    7   u8    reserved, 0
    8   u64   T          16  u32 L          20  u16 K          22  u32 E          26  u64 start
    34  L x u32           global layer numbers
        L x (u8 n, n bytes UTF-8)  router slot name of each layer column, only when flag bit 3 is set
        u32               segment count S, then S x (u64 begin, u64 end, i64 policy_version
                          (-1 = None), u16 n, n bytes UTF-8 source name)
        u64 n, n bytes    the `IndexerTrace` blob (its own checksum), only when flag bit 4 is set
        T x L x K f16     combine weights, only when flag bit 5 is set: IEEE half precision, row-major,
                          weight k of row (t, l) belongs to the k-th id that row decodes to (set mode:
                          ids ascending), 0 on -1 rows; 2 * K bytes per (token, layer) row
        T x i32           token ids, only when flag bit 2 is set (`RouteTrace.token_ids`, -1 = unknown)
        u64, u64          raw (uncompressed) payload length, stored payload length
        stored payload
        u32               CRC32 (zlib) of every byte before it

Parsing trusts nothing: magic, version and the CRC are checked first (`_check_envelope`), then every
length against the shape (`parse_header`), before anything is allocated; work and memory are linear
in the blob's length. The payload after the header is `routereplay.codec.rows`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.codec.limits import CodecLimits
from routereplay.codec.rows import payload_bytes, payload_streams
from routereplay.enums import CodecMode
from routereplay.errors import ChecksumError, CodecFormatError, CodecVersionError, RouteReplayError
from routereplay.indexer.trace import IndexerTrace
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import check_slots

MAGIC = b"RRTC"
VERSION = 1
READABLE_VERSIONS = (1,)
FLAG_ZSTD, FLAG_MISSING_ROWS, FLAG_TOKEN_IDS, FLAG_SLOTS, FLAG_INDEXER, FLAG_WEIGHTS = 1, 2, 4, 8, 16, 32
KNOWN_FLAGS = FLAG_ZSTD | FLAG_MISSING_ROWS | FLAG_TOKEN_IDS | FLAG_SLOTS | FLAG_INDEXER | FLAG_WEIGHTS
WEIGHT_BYTES = 2  # float16 per weight: see docs/codec.md "Combine weights"
_U64 = struct.Struct("<Q")
MAX_EXPERTS = 1 << 31  # ids must fit the int32 canonical dtype
_ZSTD_MAX_RATIO = 1 << 15  # no zstd frame expands more (a 128 KiB block from a 4-byte RLE block)
_FIXED = struct.Struct("<4sBBBBQIHIQ")  # magic, version, mode, flags, reserved, T, L, K, E, start
_SEGMENT = struct.Struct("<QQqH")  # begin, end, policy_version, source-name length
_U32 = struct.Struct("<I")
_LENGTHS = struct.Struct("<QQ")  # raw, stored payload length
MIN_BLOB_BYTES = _FIXED.size + _U32.size + _LENGTHS.size + _U32.size
_MODE_CODES = {CodecMode.SET: 0, CodecMode.ORDERED: 1}


@dataclass(frozen=True, slots=True)
class CodecHeader:
    """What a blob's header says (checked, checksum included); `header_info` returns it."""

    version: int
    mode: CodecMode
    compressed: bool
    has_missing_rows: bool
    num_tokens: int
    num_layers: int
    top_k: int
    num_experts: int
    start: int
    layers: tuple[int, ...]
    segments: tuple[Segment, ...]
    raw_payload_bytes: int
    stored_payload_bytes: int
    bits_per_row: int
    total_bytes: int
    has_token_ids: bool = False  # flag bit 2: T x i32 token ids sit just before the payload lengths
    slots: tuple[str, ...] | None = None  # flag bit 3: the router slot of each layer column
    indexer: IndexerTrace | None = None  # flag bit 4: the DSA indexer's choices of the same rows
    weights_offset: int = -1  # flag bit 5: byte offset of the T x L x K float16 weights (-1: none)


def pack_blob(
    trace: RouteTrace,
    mode: CodecMode,
    flags: int,
    raw_bytes: int,
    stored: bytes | memoryview,
    weights: np.ndarray | None = None,
) -> bytes:
    """The whole blob: header (with `flags`), the stored payload and the CRC32 of everything before it.

    `weights`: (T, L, K) float16 aligned with the ids as they decode (flag bit 5), or None."""
    T, L, K, E = trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts
    flags |= (FLAG_SLOTS if trace.slots is not None else 0) | (FLAG_INDEXER if trace.indexer is not None else 0)
    flags |= FLAG_WEIGHTS if weights is not None else 0
    parts: list[bytes | memoryview] = [
        _FIXED.pack(MAGIC, VERSION, _MODE_CODES[mode], flags, 0, T, L, K, E, trace.start)
    ]
    parts.append(np.asarray(trace.layers, dtype="<u4").tobytes())
    for slot in trace.slots or ():
        name = slot.encode("utf-8")  # <= MAX_SLOT_NAME printable characters: RouteTrace checked them
        parts.append(bytes([len(name)]) + name)
    parts.append(_U32.pack(len(trace.segments)))
    for segment in trace.segments:
        name = str(segment.source).encode("utf-8")
        pv = -1 if segment.policy_version is None else segment.policy_version
        parts.append(_SEGMENT.pack(segment.begin, segment.end, pv, len(name)) + name)
    if trace.indexer is not None:
        indexer = trace.indexer.encode()
        parts.append(_U64.pack(len(indexer)) + indexer)
    if weights is not None:
        parts.append(np.ascontiguousarray(weights, dtype="<f2").tobytes())
    if trace.token_ids is not None:
        parts.append(trace.token_ids.astype("<i4").tobytes())  # ids are in [-1, 2^31): RouteTrace checked them
    parts += [_LENGTHS.pack(raw_bytes, len(stored)), stored]
    crc = 0
    for part in parts:  # the CRC of the joined body, without joining it twice
        crc = zlib.crc32(part, crc)
    parts.append(_U32.pack(crc))
    return b"".join(parts)


def token_ids_offset(payload_offset: int, num_tokens: int) -> int:
    """Byte offset of the T x i32 token ids (flag bit 2): just before the payload lengths."""
    return payload_offset - _LENGTHS.size - 4 * num_tokens


class _Reader:
    """Bounds-checked cursor over `data[:end]`; an overrun is a CodecFormatError naming the field."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: memoryview, end: int) -> None:
        self.data, self.end, self.pos = data, end, 0

    def take(self, size: int, field: str) -> int:
        if size > self.end - self.pos:
            raise CodecFormatError(
                f"truncated blob: {field} at byte offset {self.pos} needs {size} bytes but only "
                f"{self.end - self.pos} remain before the checksum; the blob was cut short - re-export it"
            )
        self.pos += size
        return self.pos - size

    def unpack(self, fmt: struct.Struct, field: str) -> tuple[Any, ...]:
        return fmt.unpack_from(self.data, self.take(fmt.size, field))


def _check_envelope(data: memoryview, verify_crc: bool = True) -> None:
    """Magic, version, minimum length, then the CRC32 - before any other field is trusted."""
    size = len(data)
    truncated = f"truncated blob: {size} bytes, a codec blob has at least {MIN_BLOB_BYTES}; re-export it"
    if data[:4] != MAGIC:
        if size < 4 and MAGIC.startswith(data):
            raise CodecFormatError(truncated)
        raise CodecFormatError(
            f"bad magic {bytes(data[:4])!r} at byte offset 0 (expected {MAGIC!r}): not a routereplay codec blob; "
            "pass the bytes written by routereplay.codec.encode (not base64 text, .npy or JSON)"
        )
    if size < 5:
        raise CodecFormatError(truncated)
    if data[4] not in READABLE_VERSIONS:
        raise CodecVersionError(
            f"blob has codec version {data[4]} (byte offset 4); this release of routereplay reads version(s) "
            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade routereplay (pip install -U routereplay)"
        )
    if size < MIN_BLOB_BYTES:
        raise CodecFormatError(truncated)
    if not verify_crc:
        return
    (stored_crc,) = _U32.unpack_from(data, size - 4)
    actual_crc = zlib.crc32(data[: size - 4])
    if stored_crc == actual_crc:
        return
    declared = _declared_size(data)
    if declared != size:
        what = "truncated" if declared is None or declared > size else "followed by trailing bytes"
        raise CodecFormatError(
            f"blob is {size} bytes but its header declares {declared or 'more'}: it was {what} (or a length "
            "field is corrupt); pass exactly the bytes encode() returned"
        )
    raise ChecksumError(
        f"CRC32 mismatch: stored {stored_crc:#010x} at byte offset {size - 4}, computed {actual_crc:#010x}: "
        "the blob was corrupted or tampered with; re-fetch it or re-export the trace"
    )


def _declared_size(data: memoryview) -> int | None:
    """Total length the header's length fields imply, or None when they point past the end."""
    reader = _Reader(data, len(data))
    try:
        fixed = reader.unpack(_FIXED, "fixed header")
        flags, num_tokens, num_layers = fixed[3], fixed[5], fixed[6]
        reader.take(4 * num_layers, "layer numbers")
        if flags & FLAG_SLOTS:
            for i in range(num_layers):  # each takes >= 1 byte, so this stops at the end of data
                reader.take(reader.data[reader.take(1, f"slot {i} length")], f"slot {i} name")
        (num_segments,) = reader.unpack(_U32, "segment count")
        for i in range(num_segments):  # each takes >= 26 bytes, so this stops at the end of data
            reader.take(reader.unpack(_SEGMENT, f"segment {i}")[3], f"segment {i} source name")
        if flags & FLAG_INDEXER:
            reader.take(reader.unpack(_U64, "indexer length")[0], "indexer choices")
        if flags & FLAG_WEIGHTS:
            reader.take(WEIGHT_BYTES * num_tokens * num_layers * fixed[7], "combine weights")
        if flags & FLAG_TOKEN_IDS:
            reader.take(4 * num_tokens, "token ids")
        stored_bytes = reader.unpack(_LENGTHS, "payload lengths")[1]
    except CodecFormatError:
        return None
    return int(reader.pos + stored_bytes + _U32.size)


def parse_header(data: memoryview, limits: CodecLimits, *, verify_crc: bool = True) -> tuple[CodecHeader, int]:
    """Check the envelope and every header field; return the header and the payload's offset.

    Work and memory are linear in the blob's length (layers, segments) plus, for set mode, C(E, K)
    once `limits.max_set_table` has bounded E and K. `verify_crc=False` skips the CRC pass, for a
    blob `pack_blob` made in this process a moment ago (every other check still runs)."""
    _check_envelope(data, verify_crc)
    reader = _Reader(data, len(data) - _U32.size)
    _, version, mode_code, flags, reserved, T, L, K, E, start = reader.unpack(_FIXED, "fixed header")
    if mode_code not in (0, 1):
        raise CodecFormatError(f"mode byte (offset 5) is {mode_code}, expected 0 (set) or 1 (ordered): corrupt")
    if flags & ~KNOWN_FLAGS or reserved:
        raise CodecFormatError(
            f"unknown bits in flags {flags:#04x} (offset 6) or reserved byte {reserved} (offset 7): the blob is "
            "corrupt or from a newer writer (upgrade routereplay)"
        )
    if K < 1 or not 1 <= E <= MAX_EXPERTS:
        raise CodecFormatError(
            f"header has top_k={K} (offset 20), num_experts={E} (offset 22); need K >= 1 and 1 <= E <= 2^31"
        )
    mode = CodecMode.SET if mode_code == 0 else CodecMode.ORDERED
    layers = tuple(np.frombuffer(data, "<u4", L, reader.take(4 * L, "layer numbers")).tolist())
    slots = _parse_slots(reader, layers) if flags & FLAG_SLOTS else None
    if slots is None and len(set(layers)) != L:
        raise CodecFormatError(f"layer numbers at byte offset {_FIXED.size} repeat ({list(layers)[:8]}...): corrupt")
    segments = _parse_segments(reader, start, T)
    indexer = None
    if flags & FLAG_INDEXER:  # its own blob: checksummed, every length checked within its limits
        size = reader.unpack(_U64, "indexer length")[0]
        at = reader.take(size, "indexer choices")
        indexer = IndexerTrace.decode(reader.data[at : at + size])
    weights_offset = -1
    if flags & FLAG_WEIGHTS:  # bounded by the blob's length: nothing is allocated here
        weights_offset = reader.take(WEIGHT_BYTES * T * L * K, "combine weights")
    has_token_ids = bool(flags & FLAG_TOKEN_IDS)
    if has_token_ids:
        reader.take(4 * T, "token ids")  # bounded by the blob's length: nothing is allocated here
    raw_bytes, stored_bytes = reader.unpack(_LENGTHS, "payload lengths")
    lengths_at, offset = reader.pos - _LENGTHS.size, reader.take(stored_bytes, "payload")
    if reader.pos != reader.end:
        raise CodecFormatError(f"{reader.end - reader.pos} stray bytes at byte offset {reader.pos} before the checksum")
    streams = payload_streams(E, K, mode, limits, "blob header (offsets 20-25)")
    missing = bool(flags & FLAG_MISSING_ROWS)
    bitmap_bytes = -(-T * L // 8) if missing else 0
    full_bytes = bitmap_bytes + payload_bytes(T * L, streams)
    if not (bitmap_bytes <= raw_bytes <= full_bytes if missing else raw_bytes == full_bytes):
        raise CodecFormatError(
            f"raw payload length {raw_bytes} (byte offset {lengths_at}) does not fit {T} x {L} rows "
            f"(at most {full_bytes} bytes): corrupt header; re-export the trace"
        )
    compressed = bool(flags & FLAG_ZSTD)
    if raw_bytes > stored_bytes * _ZSTD_MAX_RATIO if compressed else raw_bytes != stored_bytes:
        raise CodecFormatError(
            f"raw payload length {raw_bytes} (byte offset {lengths_at}) is impossible for a stored payload of "
            f"{stored_bytes} bytes ({'zstd' if compressed else 'uncompressed'}): corrupt header or a zip bomb"
        )
    bits = sum(per_row * b for per_row, b in streams)
    header = CodecHeader(
        version=version, mode=mode, compressed=compressed, has_missing_rows=missing, num_tokens=T, num_layers=L,
        top_k=K, num_experts=E, start=start, layers=layers, segments=segments, raw_payload_bytes=raw_bytes,
        stored_payload_bytes=stored_bytes, bits_per_row=bits, total_bytes=len(data), has_token_ids=has_token_ids,
        slots=slots, indexer=indexer, weights_offset=weights_offset,
    )  # fmt: skip
    return header, offset


@dataclass(frozen=True, slots=True)
class BlobGeometry:
    """What a blob's fixed header says it routes (`peek_geometry`): unchecked beyond its own bounds."""

    num_tokens: int
    top_k: int
    num_experts: int
    start: int
    layers: tuple[int, ...]


def peek_geometry(data: memoryview, *, verify_crc: bool = False) -> BlobGeometry:
    """The blob's rows, top-k, experts, start and layer numbers, after its magic and version (and its CRC
    with `verify_crc`): enough to compare a blob with a model before paying for its set-mode tables or its
    rows. Work: the fixed header and 4 bytes a layer, bounded by the blob's length; nothing else is checked,
    so a blob that matches must still pass `parse_header` / `decode`."""
    _check_envelope(data, verify_crc)
    reader = _Reader(data, len(data) - _U32.size)
    _, _, _, _, _, T, L, K, E, start = reader.unpack(_FIXED, "fixed header")
    layers = tuple(np.frombuffer(data, "<u4", L, reader.take(4 * L, "layer numbers")).tolist())
    return BlobGeometry(T, K, E, start, layers)


def _parse_slots(reader: _Reader, layers: tuple[int, ...]) -> tuple[str, ...]:
    """The router slot names (flag bit 3): one per layer column, distinct within a layer."""
    at = reader.pos
    names = []
    for i in range(len(layers)):  # each takes >= 1 byte: bounded by the blob's length
        size = reader.data[reader.take(1, f"slot {i} length")]
        name_at = reader.take(size, f"slot {i} name")
        try:
            names.append(bytes(reader.data[name_at : name_at + size]).decode("utf-8"))
        except UnicodeDecodeError as error:
            raise CodecFormatError(f"slot {i} name at byte offset {name_at} is not UTF-8: corrupt") from error
    try:
        checked = check_slots(names, layers)
    except RouteReplayError as error:
        raise CodecFormatError(f"router slots at byte offset {at} are malformed: {error}") from error
    return checked or tuple(names)


def _parse_segments(reader: _Reader, start: int, num_tokens: int) -> tuple[Segment, ...]:
    (count,) = reader.unpack(_U32, "segment count")
    segments: list[Segment] = []
    position = start
    for i in range(count):  # each takes >= 26 bytes: bounded by the blob's length
        at = reader.pos
        begin, end, version, name_len = reader.unpack(_SEGMENT, f"segment {i}")
        name_at = reader.take(name_len, f"segment {i} source name")
        try:
            name = bytes(reader.data[name_at : name_at + name_len]).decode("utf-8")
            if begin != position or version < -1:
                raise ValueError(f"must start at {position} with policy_version >= -1")
            segments.append(Segment(begin, end, name, None if version == -1 else version))
        except ValueError as error:  # UnicodeDecodeError and ConfigError are ValueErrors
            raise CodecFormatError(
                f"segment {i} at byte offset {at} ([{begin}, {end}), policy_version {version}) is malformed: "
                f"{error}; segments must tile rows [{start}, {start + num_tokens}) in order"
            ) from error
        position = end
    if position != start + num_tokens:
        raise CodecFormatError(f"segments end at token {position}, the rows at {start + num_tokens}: corrupt header")
    return tuple(segments)
