"""`RankBundle`: the encoded routes one trainer rank needs, as one checked byte string.

A bundle carries the spans of samples that land in a rank's layout rows (its DP share, then its
CP/SP/PP slice) still encoded, cut by `EncodedRoutes.span` without decoding; the rank decodes it
straight into its replay-ready (P, L, K) rows. Rows no span covers (padding, the last token of each
sample, positions no engine routed) are -1. Version 1 layout, little-endian:

    0   4     magic b"RRRB"
    4   u8    version (1)
    5   u8    mode: 0 = set, 1 = ordered
    6   u16   reserved, 0
    8   u64   P rows        16  u32 L    20  u16 K    22  u32 E    26  u32 S spans
    30  L x u32             global layer numbers
        S x span:           u64 dest row, u64 length (tokens), u64 routed rows, u8 bitmap (0/1),
                            u8 bitmap skip (bits), then per packed stream: u8 skip (values), u64 bytes
        data:               per span, its bitmap bytes (when present) then each stream's bytes
        u32                 CRC32 (zlib) of every byte before it

Parsing trusts nothing: magic, version, CRC, then every length against the shape and the others
(spans in order, inside [0, P), not overlapping; each bitmap's popcount equals its routed rows; each
stream exactly as long as its values), all before the output is allocated. The bounds are the codec's
(`CodecLimits`):

- `max_entries` caps P x L x K, the decoded ids;
- `max_expansion` caps the decoded bytes per bundle byte of the rows the spans cover (a zero-bit
  layout, K = E in set mode or E = 1 in ordered mode, or a forged span, costs no bytes per row);
- padding rows (no span covers them) cost no bytes at all, so they are bounded by the receiver:
  with `expected_rows=P` (the rank's own layout rows) they are the rank's own claim; without it the
  whole P x L x K ids must also fit `max_expansion` x the bundle's bytes;
- `chunk_entries` is the decode step: spans are unpacked, checked and unranked at most
  max(chunk_entries, K) ids at a time, so `decode()` allocates the (P, L, K) output plus a working
  set of at most `WORKING_BYTES_PER_ENTRY * max(chunk_entries, K)` bytes (and the set-mode tables).

Values are checked as they are unpacked (ranks < C(E, K), ids < E). A bundle always comes from
another process, so there is no trusted constructor: raise the named limit for a trusted source.
What was checked is what is decoded: the bundle keeps `bytes` as they are and copies any buffer the
caller could refill (a reused bytearray) before checking it; `decode(out=)` / `to_torch(out=)` write
only an aligned, plain output apart from those bytes (`buffers.py`).

Legend: P = rows of the rank's layout, L = layers, K = top-k, E = experts, S = spans, n = routed rows.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from routereplay.codec.encoded import EncodedRoutes, EncodedSpan
from routereplay.codec.header import MAX_EXPERTS
from routereplay.codec.limits import CodecLimits, checked_limits
from routereplay.codec.native import may_unrank
from routereplay.codec.rows import PayloadDecoder, payload_streams, rank_bits
from routereplay.codec.subsets import SubsetUnranker, binomial_table
from routereplay.enums import CodecMode
from routereplay.errors import ChecksumError, CodecFormatError, CodecLimitError, CodecVersionError, ConfigError
from routereplay.trace.validation import canonical_dtype
from routereplay.transport.buffers import checked_out, checked_out_tensor, owned_bytes

MAGIC = b"RRRB"
VERSION = 1
_FIXED = struct.Struct("<4sBBHQIHII")  # magic, version, mode, reserved, P, L, K, E, S
_SPAN = struct.Struct("<QQQBB")  # dest, length, routed, has bitmap, bitmap skip
_CUT = struct.Struct("<BQ")  # skip, bytes
_CRC = struct.Struct("<I")
_MODES = {CodecMode.SET: 0, CodecMode.ORDERED: 1}


@dataclass(frozen=True, slots=True)
class Placed:
    """One span and the first row of the rank's layout it fills."""

    dest: int
    span: EncodedSpan


def pack_bundle(rows: int, placed: Sequence[Placed], like: EncodedRoutes) -> bytes:
    """The bundle of `placed` spans for a rank of `rows` layout rows; `like` gives the geometry and mode
    (every span must come from routes of that model)."""
    head = like.header
    ordered = sorted(placed, key=lambda p: p.dest)
    parts = [_FIXED.pack(MAGIC, VERSION, _MODES[head.mode], 0, rows, head.num_layers, head.top_k,
                         head.num_experts, len(ordered))]  # fmt: skip
    parts.append(np.asarray(head.layers, "<u4").tobytes())
    data: list[bytes] = []
    for p in ordered:
        s = p.span
        parts.append(_SPAN.pack(p.dest, s.end - s.begin, s.num_routed, s.bitmap is not None, s.bitmap_skip))
        parts += [_CUT.pack(cut.skip, len(cut.data)) for cut in s.streams]
        data += [s.bitmap or b"", *(cut.data for cut in s.streams)]
    crc = 0
    for part in parts + data:  # the CRC of the joined body, so the body is joined once, with its CRC
        crc = zlib.crc32(part, crc)
    return b"".join([*parts, *data, _CRC.pack(crc)])


@dataclass(frozen=True, slots=True)
class _SpanEntry:
    dest: int
    length: int
    routed: int
    bitmap_at: int | None
    bitmap_skip: int
    cuts: tuple[tuple[int, int, int], ...]  # (data offset, bytes, skip) per stream


class RankBundle:
    """A parsed, checked bundle (see the module docstring); `decode()` gives the rank's rows."""

    __slots__ = ("_chunk_rows", "_data", "_entries", "layers", "mode", "num_experts", "rows", "streams", "top_k")

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        *,
        expected_rows: int | None = None,
        limits: CodecLimits | None = None,
    ) -> None:
        """Parse and check `data` against `limits` (see the module docstring), before anything is allocated.

        `expected_rows`: the rank's layout rows, which the receiver knows from its own plan; the bundle's P
        must equal it. Pass it on the delivery path: it is what bounds the padding rows, which carry no
        bytes (without it, all P rows must fit `limits.max_expansion` x the bundle's bytes). `data` that is
        not `bytes` (a bytearray, a memoryview of one) is copied first: the bundle decodes what it checked."""
        view = owned_bytes(data)  # ConfigError for anything but a contiguous bytes-like
        limits = checked_limits(limits)
        _check_envelope(view)
        end = len(view) - _CRC.size
        if end < _FIXED.size:
            raise CodecFormatError(f"truncated rank bundle: {len(view)} bytes")
        _, _, mode_code, reserved, P, L, K, E, S = _FIXED.unpack_from(view, 0)
        if mode_code not in (0, 1) or reserved or K < 1 or not 1 <= E <= MAX_EXPERTS or K > E:
            raise CodecFormatError(
                f"rank bundle header is corrupt: mode {mode_code}, reserved {reserved}, top_k {K}, experts {E}"
            )
        self.mode = CodecMode.SET if mode_code == 0 else CodecMode.ORDERED
        self.rows, self.top_k, self.num_experts = P, K, E
        if expected_rows is not None and (
            not isinstance(expected_rows, (int, np.integer)) or isinstance(expected_rows, bool) or expected_rows < 0
        ):
            raise ConfigError(f"expected_rows={expected_rows!r} must be this rank's layout rows (an int >= 0) or None")
        if expected_rows is not None and P != expected_rows:
            raise CodecFormatError(
                f"rank bundle holds {P} layout rows but this rank's layout has {expected_rows}: it was built for "
                "another rank or batch; rebuild the bundles from this step's layout plan"
            )
        if P * L * K > limits.max_entries:
            raise CodecLimitError(
                f"rank bundle declares {P} x {L} x {K} = {P * L * K} expert ids, above CodecLimits.max_entries="
                f"{limits.max_entries}; refused before allocating (raise the limit for a trusted bundle)"
            )
        itemsize = canonical_dtype(E).itemsize
        if expected_rows is None:
            _check_expansion(P, L, K, itemsize, len(view), limits, padding=True)
        pos = _FIXED.size + 4 * L
        if pos > end:
            raise CodecFormatError(f"truncated rank bundle: {L} layer numbers need {4 * L} bytes")
        self.layers = tuple(np.frombuffer(view, "<u4", L, _FIXED.size).tolist())
        self.streams = payload_streams(E, K, self.mode, limits, "rank bundle")
        record = _SPAN.size + _CUT.size * len(self.streams)
        if S * record > end - pos:
            raise CodecFormatError(
                f"rank bundle declares {S} spans; {end - pos} bytes hold at most {(end - pos) // record}"
            )
        headers, pos = pos, pos + S * record
        self._chunk_rows = max(1, limits.chunk_entries // K)  # rows per decode step: <= max(chunk_entries, K) ids
        self._entries = self._parse_spans(view, headers, S, pos, end)
        _check_expansion(self.covered_rows, L, K, itemsize, len(view), limits, padding=False)
        self._data = view

    def _parse_spans(self, view: memoryview, at: int, count: int, data_at: int, end: int) -> list[_SpanEntry]:
        L, P = len(self.layers), self.rows
        entries, next_row, data = [], 0, data_at
        for i in range(count):
            dest, length, routed, has_bitmap, skip = _SPAN.unpack_from(view, at)
            at += _SPAN.size
            where = f"rank bundle span {i} (rows [{dest}, {dest + length}))"
            if dest < next_row or dest + length > P or has_bitmap > 1 or skip > 7 or routed > length * L:
                raise CodecFormatError(
                    f"{where} is out of order, overlaps the previous span, ends past the {P} rows, or declares "
                    f"{routed} routed of {length * L} rows: corrupt bundle; rebuild it with pack_bundle"
                )
            if not has_bitmap and routed != length * L:
                raise CodecFormatError(f"{where} has no validity bitmap but {routed} routed of {length * L} rows")
            next_row = dest + length
            bitmap_at = None
            if has_bitmap:
                size = -(-(skip + length * L) // 8)
                if size > end - data:
                    raise CodecFormatError(f"{where}: its bitmap of {size} bytes runs past the data")
                bitmap_at, data = data, data + size
                marked = self._popcount(view, bitmap_at, skip, length * L)
                if marked != routed:
                    raise CodecFormatError(f"{where}: its bitmap marks {marked} routed rows, not {routed}")
            cuts = []
            for q, (per_row, bits_per) in enumerate(self.streams):
                value_skip, size = _CUT.unpack_from(view, at)
                at += _CUT.size
                needed = -(-(value_skip + routed * per_row) * bits_per // 8)
                if value_skip > 7 or size != needed or size > end - data:
                    raise CodecFormatError(
                        f"{where}: stream {q} is {size} bytes from value {value_skip}; {routed} routed rows need "
                        f"{needed}: corrupt bundle"
                    )
                cuts.append((data, size, value_skip))
                data += size
            entries.append(_SpanEntry(dest, length, routed, bitmap_at, skip, tuple(cuts)))
        if data != end:
            raise CodecFormatError(f"rank bundle has {end - data} stray bytes before its checksum")
        return entries

    def _popcount(self, view: memoryview, at: int, skip: int, count: int) -> int:
        """Set bits [skip, skip + count) of the bitmap at byte `at`, a bounded number of bytes per step."""
        step = 8 * max(1, self._chunk_rows // 8)  # bits per step, a whole number of bytes
        total = 0
        for b0 in range(0, count, step):
            total += int(np.count_nonzero(_bits(view, at, skip + b0, min(count, b0 + step) - b0)))
        return total

    @property
    def spans(self) -> int:
        return len(self._entries)

    @property
    def covered_rows(self) -> int:
        """Layout rows some span fills (the rest decode to -1)."""
        return sum(e.length for e in self._entries)

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """(P, L, K) ids in the canonical dtype, -1 where no route (padding, last tokens, unrouted).

        Decodes each span max(chunk_entries, K) ids at a time straight into the output: a new array, or
        `out` (a C-contiguous (P, L, K) array of the canonical dtype, e.g. a slice of a buffer the
        trainer keeps from step to step, pinned for the copy to its GPU), every row of which is written."""
        L, K = len(self.layers), self.top_k
        out_PLK = self._output(out)  # each row written once
        out_RK = out_PLK.reshape(-1, K)
        covered_P = np.zeros(self.rows, bool)
        routed = sum(entry.routed for entry in self._entries)
        unranker = _unranker(self.num_experts, K, self.mode, routed) if routed else None  # one for every span
        step = self._chunk_rows
        for entry in self._entries:
            covered_P[entry.dest : entry.dest + entry.length] = True
            if entry.routed == 0:
                out_PLK[entry.dest : entry.dest + entry.length] = -1
                continue
            decoder = _SpanDecoder(self._data, entry, self.num_experts, K, self.mode, self.streams)
            decoder.unranker = unranker
            first_row, span_rows, done = entry.dest * L, entry.length * L, 0
            for c0 in range(0, span_rows, step):
                c1 = min(span_rows, c0 + step)
                dest_CK = out_RK[first_row + c0 : first_row + c1]
                if entry.bitmap_at is None:
                    decoder._rows_into(c0, dest_CK)
                    continue
                valid_C = _bits(self._data, entry.bitmap_at, entry.bitmap_skip + c0, c1 - c0).view(bool)
                dest_CK[...] = -1
                n = int(np.count_nonzero(valid_C))
                if n:
                    dense_nK = np.empty((n, K), out_PLK.dtype)
                    decoder._rows_into(done, dense_nK)
                    dest_CK[valid_C] = dense_nK
                    done += n
        out_PLK[~covered_P] = -1  # padding and rows no span names
        return out_PLK

    def _output(self, out: np.ndarray | None) -> np.ndarray:
        shape, dtype = (self.rows, len(self.layers), self.top_k), canonical_dtype(self.num_experts)
        if out is None:
            return np.empty(shape, dtype)
        return checked_out(out, shape, dtype, self._data)  # aligned, writable, apart from the bundle's bytes

    def to_torch(self, device: str | None = None, out: object = None) -> object:
        """`decode()` as a torch tensor (int16 or int32), moved to `device`. `out`: a CPU tensor to decode
        into (dense, contiguous, aligned, this bundle's shape and dtype; e.g. a slice of a pinned buffer reused
        every step), returned as it is (then moved to `device` when one is given)."""
        import torch

        if out is None:
            tensor = torch.from_numpy(self.decode())
        else:
            shape = (self.rows, len(self.layers), self.top_k)
            self.decode(checked_out_tensor(out, shape, canonical_dtype(self.num_experts)))
            assert isinstance(out, torch.Tensor)  # checked_out_tensor refused anything else
            tensor = out
        return tensor if device is None else tensor.to(device)


class _SpanDecoder(PayloadDecoder):
    """A `PayloadDecoder` over one span's stream cuts, each read from its own skip."""

    __slots__ = ("skips",)

    def __init__(
        self,
        data: memoryview,
        entry: _SpanEntry,
        num_experts: int,
        top_k: int,
        mode: CodecMode,
        streams: list[tuple[int, int]],
    ) -> None:
        super().__init__(data, num_experts, top_k, mode, streams)
        self.starts = [offset for offset, _, _ in entry.cuts]
        self.skips = [skip for _, _, skip in entry.cuts]

    def _position(self, stream: int, first: int) -> int:
        return first + self.skips[stream]


def _bits(view: memoryview, at: int, first: int, count: int) -> np.ndarray:
    """Bits [first, first + count) of the little-endian bitmap at byte `at`, one uint8 (0/1) each."""
    byte0 = first // 8
    packed = np.frombuffer(view, np.uint8, -(-(first + count) // 8) - byte0, at + byte0)
    return np.unpackbits(packed, bitorder="little")[first % 8 : first % 8 + count]


def _check_expansion(
    rows: int, layers: int, top_k: int, itemsize: int, size: int, limits: CodecLimits, *, padding: bool
) -> None:
    """Refuse `rows` x L x K ids whose bytes exceed `limits.max_expansion` x the bundle's `size` bytes;
    `padding`: the rows include padding (no `expected_rows` was given to bound it)."""
    output = rows * layers * top_k * itemsize
    if output <= limits.max_expansion * size:
        return
    what, fix = "rows its spans cover", "raise max_expansion for a trusted source"
    if padding:
        what = "rows, padding included,"
        fix = "pass RankBundle(data, expected_rows=P) with this rank's layout rows, or raise max_expansion"
    raise CodecLimitError(
        f"rank bundle of {size} bytes declares {rows} x {layers} x {top_k} ids over the {what} ({output} bytes "
        f"decoded, {output // max(size, 1)}x its size), above CodecLimits.max_expansion={limits.max_expansion}x; "
        "refused before allocating. Only a forged bundle or a zero-bit layout (top_k == num_experts, or one "
        f"expert) expands this much: {fix}"
    )


def _unranker(num_experts: int, top_k: int, mode: CodecMode, rows: int) -> SubsetUnranker | None:
    """One unranker for a whole bundle (`rows` routed rows: the bulk lookup table when it pays, which is
    only on the numpy path; the C kernel walks float columns instead)."""
    count = math.comb(num_experts, top_k)
    if mode is not CodecMode.SET or rank_bits(count) == 0:
        return None
    low_table_rows = 0 if may_unrank(count, top_k) else rows
    return SubsetUnranker(binomial_table(num_experts, top_k, count), count, rows=low_table_rows)


def _check_envelope(view: memoryview) -> None:
    if len(view) < 4 or bytes(view[:4]) != MAGIC:
        raise CodecFormatError(
            f"bad magic {bytes(view[:4])!r} (expected {MAGIC!r}): not a routereplay rank bundle; pass the bytes "
            "pack_bundle / bundles_for produced"
        )
    if len(view) < 5 or view[4] != VERSION:
        version = view[4] if len(view) > 4 else None
        raise CodecVersionError(f"rank bundle version {version}; this release reads version {VERSION}: upgrade")
    if len(view) < _FIXED.size + _CRC.size:
        raise CodecFormatError(f"truncated rank bundle: {len(view)} bytes, at least {_FIXED.size + _CRC.size} needed")
    (stored,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    actual = zlib.crc32(view[: len(view) - _CRC.size])
    if stored != actual:
        raise ChecksumError(
            f"rank bundle CRC32 mismatch: stored {stored:#010x}, computed {actual:#010x}: corrupted or truncated "
            "in transit; resend it"
        )


__all__ = ["MAGIC", "VERSION", "Placed", "RankBundle", "pack_bundle"]
