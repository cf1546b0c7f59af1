"""The compact codec: a versioned, checksummed binary format for one `RouteTrace`.

Legend: T = rows (tokens), L = layers, K = top-k, E = experts, R = T * L (token, layer) rows,
N = routed rows (not all -1), b = bits per routed row.

SET mode (default) stores each routed row as the rank of its sorted K-subset in the combinatorial
number system, `rank = sum_i C(c_i, i + 1)` for `c_0 < ... < c_{K-1}`, in `b = ceil(log2 C(E, K))`
bits: within one bit of the entropy of a uniformly random row (41 bits for E=128, K=8, against
56 for plain 7-bit ids). Rows decode sorted ascending. ORDERED mode keeps the order of the ids in a
row and stores every id in `ceil(log2 E)` bits. When `C(E, K) >= 2**64` (e.g. E=512, K=10) SET mode
falls back to exact Python-int ranks (slower, same optimal size), stored as 64-bit words.

Version 1 layout, all integers little-endian (offsets in bytes):

    0   4     magic b"RRTC"
    4   u8    version (1)
    5   u8    mode: 0 = set, 1 = ordered
    6   u8    flags: bit 0 = payload is zstd-compressed, bit 1 = some rows are all -1 (bitmap present),
              bit 2 = token ids present (a blob without it decodes with `token_ids` None)
    7   u8    reserved, 0
    8   u64   T          16  u32 L          20  u16 K          22  u32 E          26  u64 start
    34  L x u32           global layer numbers
        u32               segment count S, then S x (u64 begin, u64 end, i64 policy_version
                          (-1 = None), u16 n, n bytes UTF-8 source name)
        T x i32           token ids, only when flag bit 2 is set (`RouteTrace.token_ids`, -1 = unknown)
        u64, u64          raw (uncompressed) payload length, stored payload length
        stored payload
        u32               CRC32 (zlib) of every byte before it

Raw payload: when flag bit 1 is set, a validity bitmap of R bits (bit r = row r routed; row-major
(t, l); `np.packbits(bitorder="little")`, padding bits zero), then the routed rows in row-major order.
SET: one stream of N ranks of b bits (when b > 64: one stream per 64-bit word of the ranks, low
word first, the last one b - 64 * (words - 1) bits wide). ORDERED: one stream of N * K ids of
ceil(log2 E) bits. A stream packs value i at bit i * bits, least significant bit first, padded to
whole bytes with zero bits. (`routereplay.codec_rows` reads and writes the payload.)

Decoding trusts nothing: magic, version and the CRC are checked first, then every length against the
shape, then the shape against `CodecLimits` (ids, expansion over the blob's size, set-mode table),
all before anything is allocated. A zstd payload must declare its exact size, within zstd's maximum
ratio, and is inflated once into nothing (bounded pieces) to prove that size before its buffer is
allocated. Rows are then decoded `CodecLimits.chunk_entries` ids at a time straight into the output
array, and ranks / ids / padding bits are checked as they are unpacked. Peak memory of `decode` is
the output (<= min(max_entries, max_expansion * blob bytes / itemsize) ids), plus the decompressed
payload for zstd blobs, plus a fixed working set (`routereplay.codec_limits` gives the numbers);
its CPU work is linear in the same sizes.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.codec_limits import DEFAULT_LIMITS, CodecLimits, checked_limits
from routereplay.codec_rows import PayloadDecoder, encode_rows, id_bits, payload_bytes, payload_streams, rank_bits
from routereplay.enums import CodecMode
from routereplay.errors import (
    ChecksumError,
    CodecFormatError,
    CodecLimitError,
    CodecVersionError,
    ConfigError,
    RouteReplayError,
)
from routereplay.trace import RouteTrace, Segment, canonical_dtype

MAGIC = b"RRTC"
VERSION = 1
READABLE_VERSIONS = (1,)
FLAG_ZSTD, FLAG_MISSING_ROWS, FLAG_TOKEN_IDS = 1, 2, 4
MAX_EXPERTS = 1 << 31  # ids must fit the int32 canonical dtype
_ZSTD_MAX_RATIO = 1 << 15  # no zstd frame expands more (a 128 KiB block from a 4-byte RLE block)
_INFLATE_PIECE = 1 << 20  # bytes inflated per step while a zstd frame proves its size
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


# --- public API -------------------------------------------------------------------------------


def encode(
    trace: RouteTrace, *, mode: CodecMode | str = CodecMode.SET, compress: bool = False, level: int = 3
) -> bytes:
    """Serialise a trace to a blob. `trace.validate()` runs first (its named errors propagate).

    SET mode stores route sets (decode returns each row sorted); ORDERED keeps the id order.
    `compress=True` zstd-compresses the payload (needs `routereplay[zstd]`); random routes are already
    at their entropy, so it only pays on skewed or repetitive routes. What `encode` writes, `decode`
    reads within the default `CodecLimits` unless the trace is beyond them (more than
    `max_entries` ids, or a zero-bit layout / almost only -1 rows expanding past `max_expansion`).
    """
    if not isinstance(trace, RouteTrace):
        raise ConfigError(f"encode() takes a RouteTrace, got {type(trace).__name__}")
    mode = _as_mode(mode)
    if not isinstance(compress, (bool, int, np.bool_, np.integer)) or compress not in (0, 1):
        raise ConfigError(f"compress must be True or False, got {type(compress).__name__} {compress!r}")
    trace.validate()
    T, L, K, E = trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts
    _check_encodable(trace)
    try:
        streams = payload_streams(E, K, mode, DEFAULT_LIMITS, "encode")
    except CodecLimitError:
        raise ConfigError(
            f"set mode with E={E}, K={K} needs a binomial table above CodecLimits.max_set_table="
            f"{DEFAULT_LIMITS.max_set_table} words, which decode() refuses by default; use mode='ordered'"
        ) from None
    experts_RK = trace.experts.reshape(T * L, K)
    valid_R = experts_RK[:, 0] >= 0
    has_missing = not bool(valid_R.all())
    bitmap = np.packbits(valid_R, bitorder="little").tobytes() if has_missing else b""
    experts_NK = experts_RK[valid_R] if has_missing else experts_RK
    raw = bitmap + encode_rows(experts_NK, E, K, mode, streams)
    stored = _zstd_compress(raw, level) if compress else raw
    flags = (FLAG_ZSTD if compress else 0) | (FLAG_MISSING_ROWS if has_missing else 0)
    flags |= FLAG_TOKEN_IDS if trace.token_ids is not None else 0
    parts = [_FIXED.pack(MAGIC, VERSION, _MODE_CODES[mode], flags, 0, T, L, K, E, trace.start)]
    parts.append(np.asarray(trace.layers, dtype="<u4").tobytes())
    parts.append(_U32.pack(len(trace.segments)))
    for segment in trace.segments:
        name = str(segment.source).encode("utf-8")
        pv = -1 if segment.policy_version is None else segment.policy_version
        parts.append(_SEGMENT.pack(segment.begin, segment.end, pv, len(name)) + name)
    if trace.token_ids is not None:
        parts.append(trace.token_ids.astype("<i4").tobytes())  # ids are in [-1, 2^31): RouteTrace checked them
    parts += [_LENGTHS.pack(len(raw), len(stored)), stored]
    body = b"".join(parts)
    return body + _U32.pack(zlib.crc32(body))


def decode(
    blob: bytes | bytearray | memoryview, *, limits: CodecLimits | None = None, max_entries: int | None = None
) -> RouteTrace:
    """Parse a blob from `encode` back into a `RouteTrace` (content checks: call `.validate()`).

    Any malformed, truncated or tampered input raises a `CodecError` (a `RouteReplayError`): a blob
    beyond `limits` (default `CodecLimits()`: <= 2**28 ids, <= 4096x the blob's size) raises
    `CodecLimitError` before anything is allocated. The one other exception is ImportError for a
    zstd blob without `zstandard`. Bounds, by construction: peak memory <= the output ids + the
    decompressed payload (zstd only) + `WORKING_BYTES_PER_ENTRY * limits.chunk_entries` + the
    set-mode table (8 * limits.max_set_table bytes); CPU linear in the same sizes
    (`CodecLimits.memory_bound` gives the number). `max_entries=` is short for
    `limits=CodecLimits(max_entries=...)`.
    """
    limits = checked_limits(limits)
    if max_entries is not None:
        limits = dataclasses.replace(limits, max_entries=max_entries)
    data = _as_buffer(blob)
    head, offset = _parse(data, limits)
    T, L, K, E = head.num_tokens, head.num_layers, head.top_k, head.num_experts
    limits.check_shape(T, L, K, canonical_dtype(E).itemsize, len(data))
    stored = data[offset : offset + head.stored_payload_bytes]
    raw = _zstd_decompress(stored, head.raw_payload_bytes, offset) if head.compressed else stored
    streams = payload_streams(E, K, head.mode, limits, "blob")
    decoder = PayloadDecoder(memoryview(raw), E, K, head.mode, streams)
    experts_TLK = decoder.decode(T * L, head.has_missing_rows, limits.chunk_entries).reshape(T, L, K)
    token_ids = None
    if head.has_token_ids:  # bounds checked by _parse: they sit just before the payload lengths
        token_ids = np.frombuffer(data, "<i4", T, offset - _LENGTHS.size - 4 * T).astype(np.int64)
    try:
        return RouteTrace(experts_TLK, E, head.layers, head.start, head.segments, token_ids)
    except RouteReplayError as error:
        raise CodecFormatError(f"blob decodes to an invalid trace: {error}") from error


def header_info(blob: bytes | bytearray | memoryview, *, limits: CodecLimits | None = None) -> CodecHeader:
    """Check the envelope (magic, version, CRC) and parse the header, without decoding the payload."""
    return _parse(_as_buffer(blob), checked_limits(limits))[0]


def bits_per_row(num_experts: int, top_k: int, mode: CodecMode | str = CodecMode.SET) -> int:
    """Payload bits of one routed (token, layer) row: ceil(log2 C(E, K)) in SET mode, K * ceil(log2 E)."""
    _check_shape_args(num_experts, top_k)
    if _as_mode(mode) is CodecMode.ORDERED:
        return top_k * id_bits(num_experts)
    return rank_bits(math.comb(num_experts, top_k))


def entropy_bits_per_row(num_experts: int, top_k: int) -> float:
    """log2 C(E, K): the information in one uniformly random K-subset of E experts."""
    _check_shape_args(num_experts, top_k)
    if min(top_k, num_experts - top_k) <= 4096:
        return math.log2(math.comb(num_experts, top_k))  # math.log2 is exact enough on big ints
    n, k = num_experts, top_k
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def _check_shape_args(num_experts: Any, top_k: Any) -> None:
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ConfigError(f"need 1 <= top_k <= num_experts <= 2^31, got top_k={top_k}, num_experts={num_experts}")


# --- envelope and header ----------------------------------------------------------------------


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


def _check_envelope(data: memoryview) -> None:
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
        (num_segments,) = reader.unpack(_U32, "segment count")
        for i in range(num_segments):  # each takes >= 26 bytes, so this stops at the end of data
            reader.take(reader.unpack(_SEGMENT, f"segment {i}")[3], f"segment {i} source name")
        if flags & FLAG_TOKEN_IDS:
            reader.take(4 * num_tokens, "token ids")
        stored_bytes = reader.unpack(_LENGTHS, "payload lengths")[1]
    except CodecFormatError:
        return None
    return int(reader.pos + stored_bytes + _U32.size)


def _parse(data: memoryview, limits: CodecLimits) -> tuple[CodecHeader, int]:
    """Check the envelope and every header field; return the header and the payload's offset.

    Work and memory are linear in the blob's length (layers, segments) plus, for set mode, C(E, K)
    once `limits.max_set_table` has bounded E and K."""
    _check_envelope(data)
    reader = _Reader(data, len(data) - _U32.size)
    _, version, mode_code, flags, reserved, T, L, K, E, start = reader.unpack(_FIXED, "fixed header")
    if mode_code not in (0, 1):
        raise CodecFormatError(f"mode byte (offset 5) is {mode_code}, expected 0 (set) or 1 (ordered): corrupt")
    if flags & ~(FLAG_ZSTD | FLAG_MISSING_ROWS | FLAG_TOKEN_IDS) or reserved:
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
    if len(set(layers)) != L:
        raise CodecFormatError(f"layer numbers at byte offset {_FIXED.size} repeat ({list(layers)[:8]}...): corrupt")
    segments = _parse_segments(reader, start, T)
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
    )  # fmt: skip
    return header, offset


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


# --- small helpers ----------------------------------------------------------------------------


def _as_mode(mode: CodecMode | str) -> CodecMode:
    try:
        return CodecMode(mode)
    except (ValueError, TypeError):
        raise ConfigError(
            f"mode={mode!r} is not a codec mode; use 'set' (route sets, smallest) or 'ordered' (keeps id order)"
        ) from None


def _as_buffer(blob: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of the blob, without copying it (a strided memoryview is copied once)."""
    if isinstance(blob, (bytes, bytearray, memoryview)):
        view = memoryview(blob)
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    raise ConfigError(
        f"a codec blob is bytes, bytearray or memoryview, got {type(blob).__name__}; base64 text must be "
        "decoded first (base64.b64decode)"
    )


def _check_encodable(trace: RouteTrace) -> None:
    """Refuse values that the fixed-width header fields cannot hold."""
    limits = {
        "num_layers": (trace.num_layers, 1 << 32),
        "top_k": (trace.top_k, 1 << 16),
        "num_experts": (trace.num_experts, MAX_EXPERTS + 1),
        "start + num_tokens": (trace.stop, 1 << 64),
        "a layer number": (max(tuple(trace.layers or ()), default=0), 1 << 32),
        "a policy_version": (max((s.policy_version or 0 for s in trace.segments), default=0), 1 << 63),
        "a source name (UTF-8 bytes)": (max((len(str(s.source).encode()) for s in trace.segments), default=0), 1 << 16),
    }
    for name, (value, limit) in limits.items():
        if value >= limit:
            raise ConfigError(f"cannot encode: {name} = {value} does not fit its header field (at most {limit - 1})")


def _zstd_compress(raw: bytes, level: int) -> bytes:
    if not isinstance(level, int) or isinstance(level, bool) or not -(1 << 17) <= level <= 22:
        raise ConfigError(f"level={level!r} must be a zstd level, an int in -131072..22 (3 is the default)")
    try:
        import zstandard
    except ImportError:
        raise ImportError("encode(compress=True) needs zstandard: pip install 'routereplay[zstd]'") from None
    return bytes(zstandard.ZstdCompressor(level=level).compress(raw))


def _zstd_decompress(stored: memoryview, raw_bytes: int, offset: int) -> bytes:
    """Inflate a zstd payload of `raw_bytes` (already within the limits), proving its size first.

    The frame must declare exactly `raw_bytes`; it is then inflated in `_INFLATE_PIECE` steps into
    one reused buffer, and only when it has produced exactly that many bytes is the output buffer
    allocated and the frame decoded for real (strictly: one frame, no trailing data). A lying frame
    costs CPU linear in what it really inflates to, never an allocation of what it claims.
    """
    try:
        import zstandard
    except ImportError:
        raise ImportError("this blob's payload is zstd-compressed: pip install 'routereplay[zstd]'") from None
    where = f"zstd payload at byte offset {offset}"
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as error:
        raise CodecFormatError(f"{where} is not one valid zstd frame ({error}): corrupt payload") from error
    if declared != raw_bytes:
        raise CodecFormatError(
            f"{where} declares {'no size' if declared < 0 else f'{declared} bytes'}, the header {raw_bytes}: "
            "corrupt payload"
        )
    produced, piece = 0, bytearray(min(_INFLATE_PIECE, raw_bytes + 1))
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored)
        while produced <= raw_bytes:
            got = reader.readinto(piece)
            if not got:
                break
            produced += got
        if produced == raw_bytes:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_bytes, allow_extra_data=False)
    except (zstandard.ZstdError, ValueError) as error:
        raise CodecFormatError(f"{where} is not one valid zstd frame ({error}): corrupt payload") from error
    if produced != raw_bytes or len(raw) != raw_bytes:
        raise CodecFormatError(
            f"{where} inflates to {'more than ' if produced > raw_bytes else ''}{produced} bytes, the header "
            f"says {raw_bytes}: corrupt payload"
        )
    return bytes(raw)


__all__ = [
    "CodecHeader",
    "CodecLimits",
    "bits_per_row",
    "decode",
    "encode",
    "entropy_bits_per_row",
    "header_info",
]
