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
    6   u8    flags: bit 0 = payload is zstd-compressed, bit 1 = some rows are all -1 (bitmap present)
    7   u8    reserved, 0
    8   u64   T          16  u32 L          20  u16 K          22  u32 E          26  u64 start
    34  L x u32           global layer numbers
        u32               segment count S, then S x (u64 begin, u64 end, i64 policy_version
                          (-1 = None), u16 n, n bytes UTF-8 source name)
        u64, u64          raw (uncompressed) payload length, stored payload length
        stored payload
        u32               CRC32 (zlib) of every byte before it

Raw payload: when flag bit 1 is set, a validity bitmap of R bits (bit r = row r routed; row-major
(t, l); `np.packbits(bitorder="little")`, padding bits zero), then the routed rows in row-major order.
SET: one stream of N ranks of b bits (when b > 64: one stream per 64-bit word of the ranks, low
word first, the last one b - 64 * (words - 1) bits wide). ORDERED: one stream of N * K ids of
ceil(log2 E) bits. A stream packs value i at bit i * bits, least significant bit first, padded to
whole bytes with zero bits.

Decoding trusts nothing: magic, version and the CRC are checked first, then every length against the
shape before anything is allocated (T * L * K <= `max_entries`; a zstd payload must declare its exact
size, within zstd's maximum ratio), and ranks / ids / padding bits are checked after unpacking.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.bitpack import pack_bits, unpack_bits
from routereplay.enums import CodecMode
from routereplay.errors import ChecksumError, CodecFormatError, CodecVersionError, ConfigError, RouteReplayError
from routereplay.subsets import U64_MAX, binomial_table, rank_subsets, unrank_subsets
from routereplay.trace import RouteTrace, Segment, canonical_dtype

MAGIC = b"RRTC"
VERSION = 1
READABLE_VERSIONS = (1,)
FLAG_ZSTD, FLAG_MISSING_ROWS = 1, 2
DEFAULT_MAX_ENTRIES = 1 << 32  # decode() refuses T * L * K above this (8 GiB of int16 ids)
MAX_EXPERTS = 1 << 31  # ids must fit the int32 canonical dtype
_MAX_SET_TABLE = 1 << 22  # set mode: (E + 1) * (K + 1) * ceil(b / 64) binomial-table words
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


# --- public API -------------------------------------------------------------------------------


def encode(
    trace: RouteTrace, *, mode: CodecMode | str = CodecMode.SET, compress: bool = False, level: int = 3
) -> bytes:
    """Serialise a trace to a blob. `trace.validate()` runs first (its named errors propagate).

    SET mode stores route sets (decode returns each row sorted); ORDERED keeps the id order.
    `compress=True` zstd-compresses the payload (needs `routereplay[zstd]`); random routes are already
    at their entropy, so it only pays on skewed or repetitive routes.
    """
    mode = _as_mode(mode)
    trace.validate()
    T, L, K, E = trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts
    _check_encodable(trace)
    experts_RK = trace.experts.reshape(T * L, K)
    valid_R = experts_RK[:, 0] >= 0
    has_missing = not bool(valid_R.all())
    bitmap = np.packbits(valid_R, bitorder="little").tobytes() if has_missing else b""
    experts_NK = experts_RK[valid_R] if has_missing else experts_RK
    raw = bitmap + _encode_rows(experts_NK, E, K, mode)
    stored = _zstd_compress(raw, level) if compress else raw
    flags = (FLAG_ZSTD if compress else 0) | (FLAG_MISSING_ROWS if has_missing else 0)
    parts = [_FIXED.pack(MAGIC, VERSION, _MODE_CODES[mode], flags, 0, T, L, K, E, trace.start)]
    parts.append(np.asarray(trace.layers, dtype="<u4").tobytes())
    parts.append(_U32.pack(len(trace.segments)))
    for segment in trace.segments:
        name = str(segment.source).encode("utf-8")
        pv = -1 if segment.policy_version is None else segment.policy_version
        parts.append(_SEGMENT.pack(segment.begin, segment.end, pv, len(name)) + name)
    parts += [_LENGTHS.pack(len(raw), len(stored)), stored]
    body = b"".join(parts)
    return body + _U32.pack(zlib.crc32(body))


def decode(blob: bytes | bytearray | memoryview, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> RouteTrace:
    """Parse a blob from `encode` back into a `RouteTrace` (content checks: call `.validate()`).

    Any malformed, truncated or tampered input raises a `CodecError` (a `RouteReplayError`); the one
    other exception is ImportError for a zstd blob without `zstandard`. Nothing is allocated beyond
    what the header promises and the sizes confirm; `max_entries` caps T * L * K.
    """
    data = _as_bytes(blob)
    head, offset = _parse(data)
    T, L, K, E = head.num_tokens, head.num_layers, head.top_k, head.num_experts
    if T * L * K > max_entries:
        raise CodecFormatError(
            f"blob declares {T} x {L} x {K} = {T * L * K} expert ids, above max_entries={max_entries}; "
            "refusing to allocate. If the blob is trusted, pass a larger decode(max_entries=...)"
        )
    stored = data[offset : offset + head.stored_payload_bytes]
    raw = _zstd_decompress(stored, head.raw_payload_bytes, offset) if head.compressed else stored
    rows = T * L
    valid_R: np.ndarray | None = None
    num_valid, pos = rows, 0
    if head.has_missing_rows:
        pos = -(-rows // 8)
        bitmap = np.frombuffer(raw, np.uint8, pos)
        if rows % 8 and int(bitmap[-1]) >> (rows % 8):
            raise CodecFormatError(f"validity bitmap has padding bits set past row {rows}: corrupt payload")
        valid_R = np.unpackbits(bitmap, count=rows, bitorder="little").view(bool)
        num_valid = int(np.count_nonzero(valid_R))
        if num_valid == rows:
            raise CodecFormatError("flags bit 1 says some rows are all -1 but the validity bitmap marks none")
    expected = pos + _payload_bytes(num_valid, _streams(E, K, head.mode))
    if expected != len(raw):
        raise CodecFormatError(
            f"raw payload is {len(raw)} bytes but {num_valid} routed rows of {head.bits_per_row} bits "
            f"(+ {pos} bitmap bytes) need {expected}: corrupt payload; re-export the trace"
        )
    experts_NK = _decode_rows(raw, pos, num_valid, E, K, head.mode)
    if valid_R is None:
        experts_TLK = experts_NK.reshape(T, L, K)
    else:
        experts_TLK = np.full((T, L, K), -1, dtype=experts_NK.dtype)
        experts_TLK.reshape(rows, K)[valid_R] = experts_NK
    try:
        return RouteTrace(experts_TLK, E, head.layers, head.start, head.segments)
    except RouteReplayError as error:
        raise CodecFormatError(f"blob decodes to an invalid trace: {error}") from error


def header_info(blob: bytes | bytearray | memoryview) -> CodecHeader:
    """Check the envelope (magic, version, CRC) and parse the header, without decoding the payload."""
    return _parse(_as_bytes(blob))[0]


def bits_per_row(num_experts: int, top_k: int, mode: CodecMode | str = CodecMode.SET) -> int:
    """Payload bits of one routed (token, layer) row: ceil(log2 C(E, K)) in SET mode, K * ceil(log2 E)."""
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if _as_mode(mode) is CodecMode.ORDERED:
        return top_k * _id_bits(num_experts)
    return _rank_bits(math.comb(num_experts, top_k))


def entropy_bits_per_row(num_experts: int, top_k: int) -> float:
    """log2 C(E, K): the information in one uniformly random K-subset of E experts."""
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if min(top_k, num_experts - top_k) <= 4096:
        return math.log2(math.comb(num_experts, top_k))  # math.log2 is exact enough on big ints
    n, k = num_experts, top_k
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


# --- rows <-> payload -------------------------------------------------------------------------


def _id_bits(num_experts: int) -> int:
    return (num_experts - 1).bit_length()


def _rank_bits(count: int) -> int:
    return (count - 1).bit_length() if count > 1 else 0


def _streams(num_experts: int, top_k: int, mode: CodecMode) -> list[tuple[int, int]]:
    """(values per row, bits per value) of each packed stream of the payload."""
    if mode is CodecMode.ORDERED:
        return [(top_k, _id_bits(num_experts))]
    if (num_experts + 1) * (top_k + 1) > _MAX_SET_TABLE:
        raise ConfigError(
            f"set mode supports (E + 1) * (K + 1) <= {_MAX_SET_TABLE}, got E={num_experts}, K={top_k}; "
            "use mode='ordered'"
        )
    bits = _rank_bits(math.comb(num_experts, top_k))
    if (num_experts + 1) * (top_k + 1) * -(-bits // 64) > _MAX_SET_TABLE:
        raise ConfigError(f"set-mode ranks of {bits} bits (E={num_experts}, K={top_k}) are too wide; use mode=ordered")
    if bits <= 64:
        return [(1, bits)]
    return [(1, min(64, bits - 64 * q)) for q in range(-(-bits // 64))]


def _payload_bytes(num_rows: int, streams: list[tuple[int, int]]) -> int:
    return sum(-(-num_rows * per_row * bits // 8) for per_row, bits in streams)


def _encode_rows(experts_NK: np.ndarray, num_experts: int, top_k: int, mode: CodecMode) -> bytes:
    streams = _streams(num_experts, top_k, mode)
    if mode is CodecMode.ORDERED:
        return pack_bits(experts_NK.astype(np.uint64), streams[0][1])
    count = math.comb(num_experts, top_k)
    if len(experts_NK) == 0 or _rank_bits(count) == 0:
        return b""
    ranks_N = rank_subsets(experts_NK, binomial_table(num_experts, top_k, count))
    words = [ranks_N] if len(streams) == 1 else [((ranks_N >> (64 * q)) & U64_MAX) for q in range(len(streams))]
    return b"".join(pack_bits(word.astype(np.uint64), bits) for word, (_, bits) in zip(words, streams, strict=True))


def _decode_rows(raw: bytes, pos: int, num_rows: int, num_experts: int, top_k: int, mode: CodecMode) -> np.ndarray:
    streams = _streams(num_experts, top_k, mode)
    values: list[np.ndarray] = []
    for per_row, bits in streams:
        nbits = num_rows * per_row * bits
        if nbits % 8 and raw[pos + nbits // 8] >> (nbits % 8):
            raise CodecFormatError(f"payload stream has padding bits set after bit {nbits}: corrupt payload")
        values.append(unpack_bits(memoryview(raw)[pos:], num_rows * per_row, bits))
        pos += -(-nbits // 8)
    dtype = canonical_dtype(num_experts)
    if mode is CodecMode.ORDERED:
        ids = values[0]
        if ids.size and int(ids.max()) >= num_experts:
            row = int(np.flatnonzero(ids >= num_experts)[0]) // top_k
            raise CodecFormatError(f"routed row {row} holds expert id {int(ids.max())} >= E={num_experts}: corrupt")
        return ids.astype(dtype).reshape(num_rows, top_k)
    count = math.comb(num_experts, top_k)
    if num_rows == 0:
        return np.zeros((0, top_k), dtype)
    if count == 0:
        raise CodecFormatError(f"blob has routed rows but top_k={top_k} > num_experts={num_experts}: corrupt header")
    if len(values) == 1:
        ranks_N = values[0]
    else:
        ranks_N = sum((v.astype(object) << (64 * q) for q, v in enumerate(values)), np.zeros(num_rows, object))
    bad = ranks_N >= count
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise CodecFormatError(f"routed row {row} has set rank {ranks_N[row]} >= C({num_experts}, {top_k}): corrupt")
    return unrank_subsets(ranks_N, binomial_table(num_experts, top_k, count), top_k, count, dtype)


# --- envelope and header ----------------------------------------------------------------------


class _Reader:
    """Bounds-checked cursor over `data[:end]`; an overrun is a CodecFormatError naming the field."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, end: int) -> None:
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


def _check_envelope(data: bytes) -> None:
    """Magic, version, minimum length, then the CRC32 - before any other field is trusted."""
    size = len(data)
    truncated = f"truncated blob: {size} bytes, a codec blob has at least {MIN_BLOB_BYTES}; re-export it"
    if data[:4] != MAGIC:
        if size < 4 and MAGIC.startswith(data):
            raise CodecFormatError(truncated)
        raise CodecFormatError(
            f"bad magic {data[:4]!r} at byte offset 0 (expected {MAGIC!r}): not a routereplay codec blob; "
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
    actual_crc = zlib.crc32(memoryview(data)[: size - 4])
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


def _declared_size(data: bytes) -> int | None:
    """Total length the header's length fields imply, or None when they point past the end."""
    reader = _Reader(data, len(data))
    try:
        num_layers = reader.unpack(_FIXED, "fixed header")[6]
        reader.take(4 * num_layers, "layer numbers")
        (num_segments,) = reader.unpack(_U32, "segment count")
        for i in range(num_segments):  # each takes >= 26 bytes, so this stops at the end of data
            reader.take(reader.unpack(_SEGMENT, f"segment {i}")[3], f"segment {i} source name")
        stored_bytes = reader.unpack(_LENGTHS, "payload lengths")[1]
    except CodecFormatError:
        return None
    return int(reader.pos + stored_bytes + _U32.size)


def _parse(data: bytes) -> tuple[CodecHeader, int]:
    """Check the envelope and every header field; return the header and the payload's offset."""
    _check_envelope(data)
    reader = _Reader(data, len(data) - _U32.size)
    _, version, mode_code, flags, reserved, T, L, K, E, start = reader.unpack(_FIXED, "fixed header")
    if mode_code not in (0, 1):
        raise CodecFormatError(f"mode byte (offset 5) is {mode_code}, expected 0 (set) or 1 (ordered): corrupt")
    if flags & ~(FLAG_ZSTD | FLAG_MISSING_ROWS) or reserved:
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
    raw_bytes, stored_bytes = reader.unpack(_LENGTHS, "payload lengths")
    lengths_at, offset = reader.pos - _LENGTHS.size, reader.take(stored_bytes, "payload")
    if reader.pos != reader.end:
        raise CodecFormatError(f"{reader.end - reader.pos} stray bytes at byte offset {reader.pos} before the checksum")
    try:
        streams = _streams(E, K, mode)
    except ConfigError as error:
        raise CodecFormatError(f"header (offsets 20-25) cannot be a codec blob: {error}") from error
    missing = bool(flags & FLAG_MISSING_ROWS)
    bitmap_bytes = -(-T * L // 8) if missing else 0
    full_bytes = bitmap_bytes + _payload_bytes(T * L, streams)
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
        stored_payload_bytes=stored_bytes, bits_per_row=bits, total_bytes=len(data),
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
            name = reader.data[name_at : name_at + name_len].decode("utf-8")
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
    except ValueError:
        raise ConfigError(
            f"mode={mode!r} is not a codec mode; use 'set' (route sets, smallest) or 'ordered' (keeps id order)"
        ) from None


def _as_bytes(blob: bytes | bytearray | memoryview) -> bytes:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return bytes(blob)
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
    if not isinstance(level, int) or not -(1 << 17) <= level <= 22:
        raise ConfigError(f"level={level!r} must be a zstd level, an int in -131072..22 (3 is the default)")
    try:
        import zstandard
    except ImportError:
        raise ImportError("encode(compress=True) needs zstandard: pip install 'routereplay[zstd]'") from None
    return bytes(zstandard.ZstdCompressor(level=level).compress(raw))


def _zstd_decompress(stored: bytes, raw_bytes: int, offset: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise ImportError("this blob's payload is zstd-compressed: pip install 'routereplay[zstd]'") from None
    where = f"zstd payload at byte offset {offset}"
    try:
        declared = zstandard.frame_content_size(stored)
        if declared != raw_bytes:  # checked before anything is allocated
            raise CodecFormatError(f"{where} declares {declared} bytes, the header {raw_bytes}: corrupt payload")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_bytes, allow_extra_data=False)
    except (zstandard.ZstdError, ValueError) as error:
        raise CodecFormatError(f"{where} is not one valid zstd frame ({error}): corrupt payload") from error
    if len(raw) != raw_bytes:
        raise CodecFormatError(f"{where} inflates to {len(raw)} bytes, the header says {raw_bytes}: corrupt payload")
    return bytes(raw)


__all__ = [
    "CodecHeader",
    "bits_per_row",
    "decode",
    "encode",
    "entropy_bits_per_row",
    "header_info",
]
