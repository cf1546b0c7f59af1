"""The indexer blob: an `IndexerTrace` as versioned, checksummed bytes, parsed without trusting them.

Version 1 layout, all integers little-endian (offsets in bytes):

    0   4     magic b"RRIX"
    4   u8    version (1)
    5   u8    flags: bit 0 = some rows are unknown (their bits follow the layer numbers)
    6   u16   reserved, 0
    8   u64 T          16  u32 L          20  u32 I (index_topk)          24  u64 start
    32  u32 B (rows per block)
    36  L x u32           global layer numbers
        ceil(L * T / 8)   unknown-row bits, layer-major, LSB first (flag bit 0 only)
        N x (u8, u8, u32) per block (layer-major, `routereplay.indexer.layout`): mode, gap bits, Rice
                          unary bits (`routereplay.indexer.blocks`)
        payload           the blocks' bytes, in order; each length follows from its header
        u32               CRC32 (zlib) of every byte before it

N, and every block's length, follow from the header and the unknown bits, so there is no length
field to forge: a parser checks each size against the bytes that remain before reading them, and
refuses shapes beyond `IndexerLimits` (axes, T * L * I, and T * L * I per blob byte:
`max_expansion`) before anything is allocated. Parsing costs work and memory
linear in the blob's length (a row stored with gaps of b >= 1 bits costs I * b / 8 bytes, a bitmap
row n / 8 >= I / 8 bytes; rows of 0-bit gaps are checked in closed form).
Legend: T = tokens (rows), L = DSA layers, I = index_topk, N = blocks.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from routereplay.errors import ChecksumError, CodecFormatError, CodecVersionError
from routereplay.indexer.blocks import MAX_GAP_BITS, BlockMode, bad_headers, decode_block
from routereplay.indexer.layout import BlockLayout, unpack_unknown
from routereplay.indexer.limits import MAX_BLOCK_ROWS, MAX_POSITION, IndexerLimits


@dataclass(frozen=True, slots=True)
class IndexerParts:
    """An `IndexerTrace`'s compact parts: what a blob holds (`indexer/trace.py` builds the trace from them)."""

    layers: tuple[int, ...]
    index_topk: int
    start: int
    num_tokens: int
    block_rows: int
    unknown: np.ndarray | None  # packed unknown-row bits, L x T, or None when every row is known
    modes: np.ndarray  # per block: BlockMode
    bits: np.ndarray  # per block: gap bits (Rice: the low bits)
    extra: np.ndarray  # per block: Rice unary bits
    offsets: np.ndarray  # N + 1 byte offsets of the blocks in `payload`
    payload: bytes


MAGIC = b"RRIX"
VERSION = 1
READABLE_VERSIONS = (1,)
FLAG_UNKNOWN = 1
_FIXED = struct.Struct("<4sBBHQIIQI")  # magic, version, flags, reserved, T, L, I, start, B
_U32 = struct.Struct("<I")
_TABLE = np.dtype([("mode", "u1"), ("bits", "u1"), ("extra", "<u4")])  # packed: 6 bytes a block
MIN_BLOB_BYTES = _FIXED.size + _U32.size


def pack_blob(trace: IndexerParts) -> bytes:
    """The whole blob of a trace's compact parts, CRC32 last."""
    unknown, modes, bits, extra, payload = trace.unknown, trace.modes, trace.bits, trace.extra, trace.payload
    flags = FLAG_UNKNOWN if unknown is not None else 0
    parts = [
        _FIXED.pack(MAGIC, VERSION, flags, 0, trace.num_tokens, len(trace.layers), trace.index_topk, trace.start,
                    trace.block_rows),
        np.asarray(trace.layers, dtype="<u4").tobytes(),
    ]  # fmt: skip
    if unknown is not None:
        parts.append(unknown.tobytes())
    table = np.empty(modes.size, _TABLE)
    table["mode"], table["bits"], table["extra"] = modes, bits, extra
    parts += [table.tobytes(), payload]
    body = b"".join(parts)
    return body + _U32.pack(zlib.crc32(body))


def parse_blob(blob: bytes | bytearray | memoryview, limits: IndexerLimits) -> IndexerParts:
    """Check the envelope, then every field and block; return the trace's parts."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CodecFormatError(f"an indexer blob is bytes, got {type(blob).__name__}; pass what encode() returned")
    data = memoryview(blob).cast("B")
    _check_magic(data)
    (stored_crc,) = _U32.unpack_from(data, len(data) - 4)
    if stored_crc != zlib.crc32(data[:-4]):
        _parse(data, limits, MAX_BLOCK_ROWS, check_rows=False)  # a truncation or forged shape says so itself
        raise ChecksumError(
            f"CRC32 mismatch: stored {stored_crc:#010x} at byte offset {len(data) - 4}, computed "
            f"{zlib.crc32(data[:-4]):#010x}: the indexer blob was corrupted or tampered with; re-fetch or re-export it"
        )
    return _parse(data, limits, MAX_BLOCK_ROWS, check_rows=True)


def _check_magic(data: memoryview) -> None:
    size = len(data)
    truncated = f"truncated indexer blob: {size} bytes, a blob has at least {MIN_BLOB_BYTES}; re-export it"
    if bytes(data[:4]) != MAGIC:
        if size < 4 and MAGIC.startswith(bytes(data)):
            raise CodecFormatError(truncated)
        raise CodecFormatError(
            f"bad magic {bytes(data[:4])!r} at byte offset 0 (expected {MAGIC!r}): not a routereplay indexer blob; "
            "pass the bytes IndexerTrace.encode() returned (not base64 text or a route codec blob)"
        )
    if size > 4 and data[4] not in READABLE_VERSIONS:
        raise CodecVersionError(
            f"indexer blob has version {data[4]} (byte offset 4); this release reads version(s) "
            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade routereplay (pip install -U routereplay)"
        )
    if size < MIN_BLOB_BYTES:
        raise CodecFormatError(truncated)


class _Reader:
    """Bounds-checked cursor over data[:end]; an overrun is a CodecFormatError naming the field."""

    __slots__ = ("end", "pos")

    def __init__(self, end: int) -> None:
        self.end, self.pos = end, 0

    def take(self, size: int, field: str) -> int:
        if size > self.end - self.pos:
            raise CodecFormatError(
                f"truncated indexer blob: {field} at byte offset {self.pos} needs {size} bytes but only "
                f"{self.end - self.pos} remain before the checksum; the blob was cut short (or a header field is "
                "corrupt) - re-export it"
            )
        self.pos += size
        return self.pos - size


def _parse(data: memoryview, limits: IndexerLimits, max_block_rows: int, *, check_rows: bool) -> IndexerParts:
    reader = _Reader(len(data) - _U32.size)
    _, _, flags, reserved, T, L, index_topk, start, block_rows = _FIXED.unpack_from(
        data, reader.take(_FIXED.size, "header")
    )
    if flags & ~FLAG_UNKNOWN or reserved:
        raise CodecFormatError(
            f"unknown bits in flags {flags:#04x} (offset 5) or reserved {reserved} (offset 6): corrupt blob, or one "
            "from a newer writer (upgrade routereplay)"
        )
    if L < 1 or index_topk < 1 or not 1 <= block_rows <= max_block_rows:
        raise CodecFormatError(
            f"header declares L={L} layers, I={index_topk}, B={block_rows} rows per block; need L >= 1, I >= 1, "
            f"1 <= B <= {max_block_rows}: corrupt blob"
        )
    limits.check_blob(T, L, index_topk)
    limits.check_expansion(T, L, index_topk, len(data), "indexer blob")  # the dense form per byte of this blob
    if start + T > MAX_POSITION + 1:
        raise CodecFormatError(f"header declares tokens {start} .. {start + T - 1}, beyond int32 positions: corrupt")
    layers = tuple(np.frombuffer(data, "<u4", L, reader.take(4 * L, "layer numbers")).tolist())
    if len(set(layers)) != L:
        raise CodecFormatError(f"layer numbers at byte offset {_FIXED.size} repeat ({list(layers)[:8]}): corrupt")
    unknown = None
    if flags & FLAG_UNKNOWN:
        size = -(-L * T // 8)
        unknown = np.frombuffer(data, np.uint8, size, reader.take(size, "unknown-row bits")).copy()
        mask = np.unpackbits(unknown, bitorder="little")
        if mask[L * T :].any() or not mask[: L * T].any():
            raise CodecFormatError(
                "unknown-row bits are set past the last row, or flag bit 0 is set with none: corrupt"
            )
    layout = BlockLayout(T, L, index_topk, start, block_rows)
    table_at = reader.take(_TABLE.itemsize * layout.num_blocks, "block table")  # bounds N before N-sized arrays
    table = np.frombuffer(data, _TABLE, layout.num_blocks, table_at)
    modes, bits, extra = table["mode"].copy(), table["bits"].copy(), table["extra"].copy()
    unknown_LT = unpack_unknown(unknown, L, T)
    cells, seen = layout.block_stats(unknown_LT)
    bad = bad_headers(modes, bits, extra.astype(np.int64), cells, index_topk)
    if bad.any():
        index = int(np.argmax(bad))
        raise CodecFormatError(
            f"block {index} declares mode {int(modes[index])}, {int(bits[index])} bits, {int(extra[index])} unary bits "
            f"for {int(cells[index])} stored rows (0 = gaps / 2 = Rice of 0..{MAX_GAP_BITS} bits, 1 = bitmap of 0 "
            "bits, unary bits for Rice only and at least one a choice, an empty block 0/0/0): corrupt blob"
        )
    packed = -(-cells * index_topk * bits.astype(np.int64) // 8)
    lengths = np.select(
        [modes == BlockMode.GAPS, modes == BlockMode.RICE],
        [packed, packed + -(-extra.astype(np.int64) // 8)],
        -(-seen // 8),
    )
    payload_at = reader.pos
    if int(lengths.sum()) != reader.end - payload_at:
        raise CodecFormatError(
            f"the block table implies {int(lengths.sum())} payload bytes but {reader.end - payload_at} remain before "
            "the checksum: truncated or corrupt blob"
        )
    offsets = np.zeros(layout.num_blocks + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = bytes(data[payload_at : reader.end])
    if check_rows:
        for index in np.flatnonzero((cells > 0) & ((modes != BlockMode.GAPS) | (bits > 0))).tolist():
            layer, begin, end = layout.block(index)
            tokens = np.arange(begin, end)
            if unknown_LT is not None:
                tokens = tokens[~unknown_LT[layer, begin:end]]
            block = memoryview(payload)[int(offsets[index]) : int(offsets[index + 1])]
            where = f"indexer blob block {index} (layer {layers[layer]}, tokens {start + begin}..)"
            decode_block(
                block, int(modes[index]), int(bits[index]), int(extra[index]), layout.visible(tokens), index_topk, where
            )
    return IndexerParts(layers, index_topk, start, T, block_rows, unknown, modes, bits, extra, offsets, payload)


__all__ = ["MAGIC", "MIN_BLOB_BYTES", "VERSION", "IndexerParts", "pack_blob", "parse_blob"]
