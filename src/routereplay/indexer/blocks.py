"""One block of stored indexer rows: gaps bit-packed, Rice-coded, or a bitmap - whichever is smallest.

A stored row (query at position p sees n = p + 1 > I keys and picks I of them) is I sorted positions
out of [0, n). A block is up to `block_rows` consecutive such rows of one layer, in one of three forms:

- GAPS (mode 0): each row as distances back from the query, r = (n - 1) - positions reversed
  (ascending, so recent keys - where the indexer looks most - give small numbers), stored as
  r[0], r[1] - r[0] - 1, r[2] - r[1] - 1, ... in `bits` bits each (`routereplay.bitpack`, the
  block's widest value). I * bits bits a row.
- BITMAP (mode 1): each row as n bits, bit k set when key k is chosen, rows concatenated. n bits a
  row: smaller than gaps once the choices are dense in the visible keys.
- RICE (mode 2): the same gaps, each split at `bits` = k: the low k bits bit-packed (all rows
  first), then the high part q = gap >> k in unary (q zeros, then a one) - `extra` bits in all,
  which the block table records. About I * (k + 1) + n / 2^k bits a row: one wide gap no longer
  sets the width of the whole block (Elias-Fano's bound, log2(n / I) + 2 bits a choice).

Decoding checks what the bytes can get wrong: a bitmap row with other than I bits set, bits set
past the block's last row, a gap row reaching before key 0. Everything else (sorted, distinct,
causal) holds by construction.
Legend: C = rows (cells) of the block, I = index_topk.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from routereplay.bitpack import pack_bits, unpack_bits
from routereplay.errors import CodecFormatError
from routereplay.indexer.limits import MAX_POSITION

MAX_GAP_BITS = 31  # distances are below 2^31: positions are int32


class BlockMode(IntEnum):
    GAPS = 0
    BITMAP = 1
    RICE = 2


def gap_bytes(cells: int, index_topk: int, bits: int) -> int:
    return -(-cells * index_topk * bits // 8)


def bitmap_bytes(visible_total: int) -> int:
    return -(-visible_total // 8)


def encode_block(positions_CI: np.ndarray, visible_C: np.ndarray) -> tuple[BlockMode, int, int, bytes]:
    """(mode, bits, extra, payload) of the smallest form for rows `positions_CI` (canonical, all valid)
    whose queries see `visible_C` keys each (every one > I); `extra` is the Rice unary bit count."""
    cells, index_topk = positions_CI.shape
    if cells == 0:
        return BlockMode.GAPS, 0, 0, b""
    distance_CI = (visible_C[:, None] - 1) - positions_CI[:, ::-1].astype(np.int64)
    gaps_CI = distance_CI.copy()
    gaps_CI[:, 1:] = np.diff(distance_CI, axis=1) - 1
    bits = int(gaps_CI.max()).bit_length()
    count = cells * index_topk
    guess = max(0, int(np.log2(gaps_CI.mean() + 1)))
    rice = {k: count * (k + 1) + int((gaps_CI >> k).sum()) for k in range(max(0, guess - 1), min(bits, guess + 2))}
    k = min(rice, key=rice.__getitem__) if rice else 0
    total = int(visible_C.sum())
    sizes = {BlockMode.GAPS: gap_bytes(cells, index_topk, bits), BlockMode.BITMAP: bitmap_bytes(total)}
    if rice:
        sizes[BlockMode.RICE] = gap_bytes(cells, index_topk, k) + bitmap_bytes(rice[k] - count * k)
    mode = min(sizes, key=lambda m: (sizes[m], m))
    if mode == BlockMode.GAPS:
        return mode, bits, 0, pack_bits(gaps_CI, bits)
    if mode == BlockMode.RICE:
        unary_bits = rice[k] - count * k
        stream = np.zeros(unary_bits, np.bool_)
        stream[np.cumsum((gaps_CI >> k).ravel() + 1) - 1] = True
        return mode, k, unary_bits, pack_bits(gaps_CI, k) + np.packbits(stream, bitorder="little").tobytes()
    starts = np.cumsum(visible_C) - visible_C
    stream = np.zeros(total, np.bool_)
    stream[(starts[:, None] + positions_CI).ravel()] = True
    return BlockMode.BITMAP, 0, 0, np.packbits(stream, bitorder="little").tobytes()


def block_bytes(mode: int, bits: int, extra: int, cells: int, index_topk: int, visible_total: int) -> int:
    """Payload length a block header implies (the caller checked mode and bits)."""
    if mode == BlockMode.GAPS:
        return gap_bytes(cells, index_topk, bits)
    if mode == BlockMode.RICE:
        return gap_bytes(cells, index_topk, bits) + bitmap_bytes(extra)
    return bitmap_bytes(visible_total)


def bad_headers(
    modes: np.ndarray, bits: np.ndarray, extra: np.ndarray, cells: np.ndarray, index_topk: int
) -> np.ndarray:
    """Which block headers are impossible (vectorised over the table, before any payload is read)."""
    return (
        (modes > BlockMode.RICE)
        | ((modes != BlockMode.BITMAP) & (bits > MAX_GAP_BITS))
        | ((modes == BlockMode.BITMAP) & (bits > 0))
        | ((modes != BlockMode.RICE) & (extra > 0))
        | ((modes == BlockMode.RICE) & (extra < cells * index_topk))
        | ((cells == 0) & ((modes > 0) | (bits > 0)))
    )


def decode_block(
    payload: bytes | memoryview, mode: int, bits: int, extra: int, visible_C: np.ndarray, index_topk: int, where: str
) -> np.ndarray:
    """The (C, I) int32 positions of a block, checked; `payload` is exactly `block_bytes` long."""
    cells = visible_C.size
    count = cells * index_topk
    if mode == BlockMode.GAPS:
        return _from_gaps(unpack_bits(payload, count, bits).astype(np.int64), visible_C, index_topk, where)
    if mode == BlockMode.RICE:
        low = unpack_bits(payload, count, bits).astype(np.int64)
        stream = np.unpackbits(
            np.frombuffer(payload[gap_bytes(cells, index_topk, bits) :], np.uint8), bitorder="little"
        )
        ends = np.flatnonzero(stream)
        if ends.size != count or (count and int(ends[-1]) != extra - 1):
            raise CodecFormatError(
                f"{where}: Rice unary stream holds {ends.size} ends (want {count}) or does not end at its declared "
                f"{extra} bits: corrupt blob"
            )
        high = np.diff(ends, prepend=-1) - 1
        if count and int(high.max()) > MAX_POSITION >> bits:
            raise CodecFormatError(f"{where}: a Rice gap exceeds 2^31 positions: corrupt blob")
        return _from_gaps((high << bits) | low, visible_C, index_topk, where)
    total = int(visible_C.sum())
    stream = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")
    if stream[total:].any():
        raise CodecFormatError(f"{where}: bitmap bits set after the block's last row: corrupt blob")
    chosen = np.flatnonzero(stream[:total])
    ends = np.cumsum(visible_C)
    row = np.searchsorted(ends, chosen, side="right")
    counts = np.bincount(row, minlength=cells)
    if chosen.size != count or (counts != index_topk).any():
        c = int(np.argmax(counts != index_topk)) if (counts != index_topk).any() else 0
        raise CodecFormatError(
            f"{where}: bitmap row {c} chooses {int(counts[c])} keys, not index_topk={index_topk}: corrupt blob"
        )
    return (chosen - (ends - visible_C)[row]).reshape(cells, index_topk).astype(np.int32)


def _from_gaps(gaps: np.ndarray, visible_C: np.ndarray, index_topk: int, where: str) -> np.ndarray:
    """Positions from distance gaps (see GAPS), refusing a row that reaches before key 0."""
    distance_CI = np.cumsum(gaps.reshape(visible_C.size, index_topk), axis=1) + np.arange(index_topk)
    reach = distance_CI[:, -1] > visible_C - 1
    if reach.any():
        c = int(np.argmax(reach))
        raise CodecFormatError(
            f"{where}: row {c} of the block reaches {int(distance_CI[c, -1])} keys back from a query that sees "
            f"{int(visible_C[c])}: a choice before key 0 - corrupt blob"
        )
    return ((visible_C[:, None] - 1) - distance_CI[:, ::-1]).astype(np.int32)


__all__ = [
    "MAX_GAP_BITS",
    "BlockMode",
    "bad_headers",
    "bitmap_bytes",
    "block_bytes",
    "decode_block",
    "encode_block",
    "gap_bytes",
]
