"""Bit packing: n unsigned values of b bits (0..64) <-> ceil(n * b / 8) bytes, LSB first.

Value i occupies bits [i * b, (i + 1) * b) of the stream. Eight values of b bits fill exactly b
bytes, so packing is a (groups, b) byte array filled lane by lane with shifts: a few dozen vector
operations however many values there are. Unpacking b <= 57 bits reads each lane j of the groups
as one strided little-endian uint64 view (it starts at byte j * b // 8 of every group, and its
shift j * b % 8 plus b bits fit in 64), so a value costs a shift and a mask; wider values are put
together from bytes. Legend: G = groups of 8 values, B = b bytes per group.
"""

from __future__ import annotations

import numpy as np

from routereplay.errors import CodecFormatError, ConfigError

MAX_VIEW_BITS = 57  # a lane of <= 57 bits plus its shift (<= 7) fits one unaligned uint64 read


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack values (masked to their low `bits` bits, 0..64) LSB-first into ceil(n * bits / 8) bytes.

    Eight values of b bits fill exactly b bytes, so the work is a (groups, b) byte array filled
    column by column: lane j starts at bit j * b of its group.
    """
    _check_bits(bits)
    values_n = np.asarray(values).astype(np.uint64, copy=False).ravel()
    count = values_n.size
    if bits == 0 or count == 0:
        return b""
    groups = -(-count // 8)
    lanes = np.zeros(groups * 8, np.uint64)
    lanes[:count] = values_n
    if bits < 64:
        lanes &= (1 << bits) - 1
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


__all__ = ["pack_bits", "unpack_bits"]
