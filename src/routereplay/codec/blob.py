"""The compact codec: a versioned, checksummed binary format for one `RouteTrace`.

Legend: T = rows (tokens), L = layers, K = top-k, E = experts, R = T * L (token, layer) rows,
N = routed rows (not all -1), b = bits per routed row.

SET mode (default) stores each routed row as the rank of its sorted K-subset in the combinatorial
number system, `rank = sum_i C(c_i, i + 1)` for `c_0 < ... < c_{K-1}`, in `b = ceil(log2 C(E, K))`
bits: within one bit of the entropy of a uniformly random row (41 bits for E=128, K=8, against
56 for plain 7-bit ids). Rows decode sorted ascending. ORDERED mode keeps the order of the ids in a
row and stores every id in `ceil(log2 E)` bits. When `C(E, K) >= 2**64` (e.g. E=512, K=10) SET mode
falls back to exact Python-int ranks (slower, same optimal size), stored as 64-bit words.

The blob's envelope and header (version 1: magic, version, mode, flags, shape, layers, segments,
token ids, payload lengths, CRC32) are laid out, packed and parsed in `routereplay.codec.header`.

Raw payload: when flag bit 1 is set, a validity bitmap of R bits (bit r = row r routed; row-major
(t, l); `np.packbits(bitorder="little")`, padding bits zero), then the routed rows in row-major order.
SET: one stream of N ranks of b bits (when b > 64: one stream per 64-bit word of the ranks, low
word first, the last one b - 64 * (words - 1) bits wide). ORDERED: one stream of N * K ids of
ceil(log2 E) bits. A stream packs value i at bit i * bits, least significant bit first, padded to
whole bytes with zero bits. (`routereplay.codec.rows` reads and writes the payload.)

Decoding trusts nothing: magic, version and the CRC are checked first, then every length against the
shape, then the shape against `CodecLimits` (ids, expansion over the blob's size, set-mode table),
all before anything is allocated. A zstd payload must declare its exact size, within zstd's maximum
ratio, and is inflated once into nothing (bounded pieces) to prove that size before its buffer is
allocated. Rows are then decoded `CodecLimits.chunk_entries` ids at a time straight into the output
array, and ranks / ids / padding bits are checked as they are unpacked. Peak memory of `decode` is
the output (<= min(max_entries, max_expansion * blob bytes / itemsize) ids), plus the decompressed
payload for zstd blobs, plus a fixed working set (`routereplay.codec.limits` gives the numbers);
its CPU work is linear in the same sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from routereplay.codec.header import (
    FLAG_MISSING_ROWS,
    FLAG_TOKEN_IDS,
    FLAG_ZSTD,
    MAX_EXPERTS,
    CodecHeader,
    pack_blob,
    parse_header,
    token_ids_offset,
)
from routereplay.codec.limits import DEFAULT_LIMITS, CodecLimits, checked_limits
from routereplay.codec.native import PackedRows, can_pack, pack_set_rows
from routereplay.codec.rows import PayloadDecoder, encode_rows, id_bits, payload_streams, rank_bits
from routereplay.codec.subsets import binomial_table
from routereplay.enums import CodecMode
from routereplay.errors import (
    CodecFormatError,
    CodecLimitError,
    ConfigError,
    RouteReplayError,
)
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype

WEIGHT_MAX = float(np.finfo(np.float16).max)  # 65504: the largest combine weight a blob stores
_INFLATE_PIECE = 1 << 20  # bytes inflated per step while a zstd frame proves its size


# --- public API -------------------------------------------------------------------------------


def encode(
    trace: RouteTrace,
    *,
    mode: CodecMode | str = CodecMode.SET,
    compress: bool = False,
    level: int = 3,
    native: bool = True,
) -> bytes:
    """Serialise a trace to a blob. The trace is validated first (`trace.validate()`'s named errors
    propagate; with the C kernel, set mode checks each row while it ranks it, and runs `validate()`
    to name a fault). `native=False` keeps to the numpy path (the reference the C kernel is tested
    against; `routereplay.codec.native` says when the kernel applies); the bytes are the same.

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
    _check_native(native)
    T, L, K, E = trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts
    _check_encodable(trace)
    try:
        streams = payload_streams(E, K, mode, DEFAULT_LIMITS, "encode")
    except CodecLimitError:
        trace.validate()  # a bad trace is named first, as on every other path
        raise ConfigError(
            f"set mode with E={E}, K={K} needs a binomial table above CodecLimits.max_set_table="
            f"{DEFAULT_LIMITS.max_set_table} words, which decode() refuses by default; use mode='ordered'"
        ) from None
    experts_RK = trace.experts.reshape(T * L, K)
    packed = _packed_natively(experts_RK, E, K, mode, streams) if native else None
    if packed is not None:  # validated while ranked; a bad row is named by the full catalogue
        if packed.bad_row >= 0:
            trace.validate()
            raise ConfigError(f"row {packed.bad_row} of the trace failed the codec's checks but passed validate()")
        raw: bytes | memoryview = packed.payload
        has_missing = packed.has_missing
    else:
        trace.validate()
        valid_R = experts_RK[:, 0] >= 0
        has_missing = not bool(valid_R.all())
        bitmap = np.packbits(valid_R, bitorder="little").tobytes() if has_missing else b""
        experts_NK = experts_RK[valid_R] if has_missing else experts_RK
        raw = bitmap + encode_rows(experts_NK, E, K, mode, streams)
    stored = _zstd_compress(raw, level) if compress else raw
    flags = (FLAG_ZSTD if compress else 0) | (FLAG_MISSING_ROWS if has_missing else 0)
    flags |= FLAG_TOKEN_IDS if trace.token_ids is not None else 0
    return pack_blob(trace, mode, flags, len(raw), stored, _stored_weights(trace, mode))


def decode(
    blob: bytes | bytearray | memoryview,
    *,
    limits: CodecLimits | None = None,
    max_entries: int | None = None,
    native: bool = True,
) -> RouteTrace:
    """Parse a blob from `encode` back into a `RouteTrace` (content checks: call `.validate()`).

    Any malformed, truncated or tampered input raises a `CodecError` (a `RouteReplayError`): a blob
    beyond `limits` (default `CodecLimits()`: <= 2**28 ids, <= 4096x the blob's size) raises
    `CodecLimitError` before anything is allocated. The one other exception is ImportError for a
    zstd blob without `zstandard`. Bounds, by construction: peak memory <= the output ids + the
    decompressed payload (zstd only) + `WORKING_BYTES_PER_ENTRY * limits.chunk_entries` + the
    set-mode table (8 * limits.max_set_table bytes); CPU linear in the same sizes
    (`CodecLimits.memory_bound` gives the number). `max_entries=` is short for
    `limits=CodecLimits(max_entries=...)`. `native=False` keeps to the numpy path (see `encode`).
    """
    limits = checked_limits(limits)
    _check_native(native)
    if max_entries is not None:
        limits = dataclasses.replace(limits, max_entries=max_entries)
    data = _as_buffer(blob)
    head, offset = parse_header(data, limits)
    T, L, K, E = head.num_tokens, head.num_layers, head.top_k, head.num_experts
    limits.check_shape(T, L, K, canonical_dtype(E).itemsize, len(data))
    stored = data[offset : offset + head.stored_payload_bytes]
    raw = _zstd_decompress(stored, head.raw_payload_bytes, offset) if head.compressed else stored
    streams = payload_streams(E, K, head.mode, limits, "blob")
    decoder = PayloadDecoder(memoryview(raw), E, K, head.mode, streams, native=native)
    experts_TLK = decoder.decode(T * L, head.has_missing_rows, limits.chunk_entries).reshape(T, L, K)
    token_ids = None
    if head.has_token_ids:  # bounds checked by parse_header: they sit just before the payload lengths
        token_ids = np.frombuffer(data, "<i4", T, token_ids_offset(offset, T)).astype(np.int64)
    weights = None
    if head.weights_offset >= 0:  # bounds checked by parse_header; RouteTrace checks the values
        weights = np.frombuffer(data, "<f2", T * L * K, head.weights_offset).reshape(T, L, K).astype(np.float32)
    try:
        return RouteTrace(
            experts_TLK,
            E,
            head.layers,
            head.start,
            head.segments,
            token_ids,
            slots=head.slots,
            ordered=head.mode is CodecMode.ORDERED,
            indexer=head.indexer,
            weights=weights,
        )
    except RouteReplayError as error:
        raise CodecFormatError(f"blob decodes to an invalid trace: {error}") from error


def _stored_weights(trace: RouteTrace, mode: CodecMode) -> np.ndarray | None:
    """The trace's weights as float16, aligned with its ids as they decode (set mode: ids ascending).

    A weight above `WEIGHT_MAX` (65504, float16's largest finite value) is a `ConfigError`, checked before the
    float16 copy: IEEE rounding would store weights in (65504, 65520) as 65504 and larger ones as inf, and
    the codec keeps only weights it holds to float16's precision (docs/codec.md "Combine weights")."""
    if trace.weights is None:
        return None
    weights_TLK = trace.weights
    if weights_TLK.size and not float(weights_TLK.max()) <= WEIGHT_MAX:  # `not <=`: a NaN is refused too
        t, layer, k = (int(i) for i in np.argwhere(~(weights_TLK <= WEIGHT_MAX))[0])
        raise ConfigError(
            f"combine weight {k} of row {t}, layer column {layer} is {float(weights_TLK[t, layer, k])!r}, above "
            f"{WEIGHT_MAX:g}, float16's range: the codec stores weights in half precision and keeps only those it "
            "can hold; rescale them (combine weights lie in [0, routed_scaling_factor]) or encode without weights"
        )
    if mode is CodecMode.SET:
        weights_TLK = np.take_along_axis(weights_TLK, np.argsort(trace.experts, axis=2, kind="stable"), axis=2)
    return weights_TLK.astype(np.float16)


def header_info(blob: bytes | bytearray | memoryview, *, limits: CodecLimits | None = None) -> CodecHeader:
    """Check the envelope (magic, version, CRC) and parse the header, without decoding the payload."""
    return parse_header(_as_buffer(blob), checked_limits(limits))[0]


def fresh_header(blob: bytes) -> CodecHeader:
    """`header_info` of a blob `encode` returned in this process (no CRC pass: nothing has touched it)."""
    return parse_header(memoryview(blob), CodecLimits(max_set_table=1 << 62), verify_crc=False)[0]


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


def _check_native(native: object) -> None:
    if not isinstance(native, (bool, np.bool_)):
        raise ConfigError(f"native must be True or False, got {type(native).__name__} {native!r}")


def _packed_natively(
    experts_RK: np.ndarray, num_experts: int, top_k: int, mode: CodecMode, streams: list[tuple[int, int]]
) -> PackedRows | None:
    """The payload from the C kernel (validation fused with ranking), or None where it does not apply."""
    if mode is not CodecMode.SET or len(streams) != 1 or not experts_RK.dtype.isnative:
        return None
    if not can_pack(num_experts, top_k, streams[0][1]):
        return None
    count = math.comb(num_experts, top_k)
    return pack_set_rows(experts_RK, num_experts, binomial_table(num_experts, top_k, count), streams[0][1])


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


def _zstd_compress(raw: bytes | memoryview, level: int) -> bytes:
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


__all__ = ["WEIGHT_MAX", "bits_per_row", "decode", "encode", "entropy_bits_per_row", "header_info"]
