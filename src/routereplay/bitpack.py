"""Bit packing: n unsigned values of b bits (0..64) <-> ceil(n * b / 8) bytes, LSB first.

Value i occupies bits [i * b, (i + 1) * b) of the stream. Eight values of b bits fill exactly b
bytes. Packing 8 <= b <= 57 bits ORs each lane j of the groups, shifted by j * b % 8, into one
strided little-endian uint64 view of the output starting at byte j * b // 8 (lane windows of one j
never overlap since b >= 8): 8 shifts and 8 ORs however many values. Other widths fill a
(groups, b) byte array lane by lane with shifts: a few dozen vector operations. Unpacking
b <= 57 bits reads each lane j of the groups as one strided little-endian uint64 view (it starts
at byte j * b // 8 of every group, and its shift j * b % 8 plus b bits fit in 64), so a value
costs a shift and a mask; wider values are put together from bytes.
Legend: n = values, G = groups of 8 values, B = bytes (b per group), M = runs of m merged values.
"""

from __future__ import annotations

import numpy as np

from routereplay.errors import CodecFormatError, ConfigError

MAX_VIEW_BITS = 57  # a lane of <= 57 bits plus its shift (<= 7) fits one unaligned uint64 read
MIN_LANE_PACK_BITS = 8  # narrower lanes: one lane's 8-byte windows would overlap each other


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack values (masked to their low `bits` bits, 0..64) LSB-first into ceil(n * bits / 8) bytes.

    Eight values of b bits fill exactly b bytes, so the work is a (groups, b) byte array filled
    column by column: lane j starts at bit j * b of its group. Below 8 bits, runs of m = 57 // b
    values are first merged into one value of m * b bits (the same bits of the same stream).
    """
    _check_bits(bits)
    values_n = np.asarray(values).astype(np.uint64, copy=False).ravel()
    count = values_n.size
    if bits == 0 or count == 0:
        return b""
    if bits < MIN_LANE_PACK_BITS:
        per = MAX_VIEW_BITS // bits
        runs_n = np.zeros(-(-count // per) * per, np.uint64)
        runs_n[:count] = values_n
        runs_n &= (1 << bits) - 1
        runs_Mm = runs_n.reshape(-1, per)
        merged_M = runs_Mm[:, 0].copy()
        for j in range(1, per):
            merged_M |= runs_Mm[:, j] << np.uint64(j * bits)
        return pack_bits(merged_M, per * bits)[: -(-count * bits // 8)]
    groups = -(-count // 8)
    lanes = np.zeros(groups * 8, np.uint64)
    lanes[:count] = values_n
    if bits < 64:
        lanes &= (1 << bits) - 1
    if MIN_LANE_PACK_BITS <= bits <= MAX_VIEW_BITS:
        out_B = np.zeros(groups * bits + 8, np.uint8)  # the last lane's 8-byte window ends in the padding
        pack_lanes_into(lanes, bits, out_B, 0)
        return out_B[: -(-count * bits // 8)].tobytes()
    lanes_G8 = lanes.reshape(groups, 8)
    out_GB = np.zeros((groups, bits), np.uint8)
    for j in range(8):
        byte, shift = divmod(j * bits, 8)
        lane = lanes_G8[:, j]
        out_GB[:, byte] |= (lane << shift).astype(np.uint8)
        m = 1
        while 8 * m - shift < bits:
            out_GB[:, byte + m] |= (lane >> (8 * m - shift)).astype(np.uint8)
            m += 1
    return out_GB.tobytes()[: -(-count * bits // 8)]


def pack_lanes_into(values_n: np.ndarray, bits: int, out_B: np.ndarray, start: int) -> None:
    """OR uint64 `values_n` (each below 2**bits, 8 <= bits <= 57) packed LSB-first into `out_B[start:]`.

    `out_B` (uint8) must be zero where the values go and hold 8 more bytes than the groups of 8 values
    need: value i lands at bit 8 * start + i * bits. Eight values end on a byte boundary, so a long
    stream can be packed in pieces of a multiple of 8 values at their byte offsets; a piece that is
    not a multiple of 8 must be the last.
    """
    assert MIN_LANE_PACK_BITS <= bits <= MAX_VIEW_BITS and values_n.dtype == np.uint64
    count = len(values_n)
    groups = -(-count // 8)
    if count % 8:
        padded = np.zeros(groups * 8, np.uint64)
        padded[:count] = values_n
        values_n = padded
    assert len(out_B) >= start + groups * bits + 8
    lanes_G8 = values_n.reshape(groups, 8)
    shifted_G = np.empty(groups, np.uint64)
    for j in range(8):
        byte, shift = divmod(j * bits, 8)
        window_G = np.ndarray((groups,), "<u8", out_B, start + byte, (bits,))  # unaligned, strided, no copy
        np.left_shift(lanes_G8[:, j], shift, out=shifted_G)
        np.bitwise_or(window_G, shifted_G, out=window_G)


def unpack_bits(buf: bytes | bytearray | memoryview | np.ndarray, count: int, bits: int, first: int = 0) -> np.ndarray:
    """Inverse of `pack_bits`: values first .. first + count - 1 of `bits` bits from `buf`, as uint64.

    Works on `count` values only (a few uint64 arrays of that length), whatever the length of `buf`:
    decode a long stream in slices to bound the memory.
    """
    _check_bits(bits)
    for name, value in (("count", count), ("first", first)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"unpack_bits: {name}={value!r} must be an int >= 0")
    skip, start = first % 8, first // 8 * bits  # eight values fill exactly `bits` bytes
    count += skip
    needed = -(-count * bits // 8)
    data = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).ravel()
    data = data[start : start + needed]
    if data.size < needed:
        raise CodecFormatError(
            f"bit stream holds {data.size + start} bytes; values up to {first + count - skip} of {bits} bits "
            f"need {start + needed}"
        )
    if bits == 0 or count == 0:
        return np.zeros(count - skip, np.uint64)
    groups = -(-count // 8)
    if bits <= MAX_VIEW_BITS:
        return _unpack_lanes(data, groups, bits)[skip:count]
    padded = np.zeros(groups * bits, np.uint8)
    padded[:needed] = data[:needed]
    bytes_GB = padded.reshape(groups, bits)
    out_G8 = np.empty((groups, 8), np.uint64)
    for j in range(8):
        byte, shift = divmod(j * bits, 8)
        lane = bytes_GB[:, byte].astype(np.uint64) >> shift
        m = 1
        while 8 * m - shift < bits:
            lane |= bytes_GB[:, byte + m].astype(np.uint64) << (8 * m - shift)
            m += 1
        if bits < 64:
            lane &= (1 << bits) - 1
        out_G8[:, j] = lane
    return out_G8.ravel()[skip:count]


def _unpack_lanes(data: np.ndarray, groups: int, bits: int) -> np.ndarray:
    """All 8 * groups values of `bits` <= 57 from `data` (the groups' bytes, the last group maybe short)."""
    padded = np.zeros(groups * bits + 8, np.uint8)  # the last lane's 8-byte read ends within the padding
    padded[: len(data)] = data
    out_G8 = np.empty((groups, 8), np.uint64)
    for j in range(8):
        byte, shift = divmod(j * bits, 8)
        lane_G = np.ndarray((groups,), "<u8", padded, byte, (bits,))  # unaligned, strided, no copy
        np.right_shift(lane_G, shift, out=out_G8[:, j])
    np.bitwise_and(out_G8, (1 << bits) - 1, out=out_G8)
    return out_G8.ravel()


def _check_bits(bits: object) -> None:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 0 <= bits <= 64:
        raise ConfigError(f"bits={bits!r} must be an int in 0..64")


__all__ = ["MAX_VIEW_BITS", "MIN_LANE_PACK_BITS", "pack_bits", "pack_lanes_into", "unpack_bits"]
