"""Bit packing: n unsigned values of b bits (0..64) <-> ceil(n * b / 8) bytes, LSB first.

Value i occupies bits [i * b, (i + 1) * b) of the stream. Eight values of b bits fill exactly b
bytes, so packing is a (groups, b) byte array filled lane by lane with shifts: a few dozen vector
operations however many values there are. Legend: G = groups of 8 values, B = b bytes per group.
"""

from __future__ import annotations

import numpy as np

from routereplay.errors import CodecFormatError, ConfigError


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack values (masked to their low `bits` bits, 0..64) LSB-first into ceil(n * bits / 8) bytes.

    Eight values of b bits fill exactly b bytes, so the work is a (groups, b) byte array filled
    column by column: lane j starts at bit j * b of its group.
    """
    if not 0 <= bits <= 64:
        raise ConfigError(f"bits={bits} must be in 0..64")
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


def unpack_bits(buf: bytes | bytearray | memoryview | np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of `pack_bits`: the first `count` values of `bits` bits from `buf`, as uint64."""
    if not 0 <= bits <= 64:
        raise ConfigError(f"bits={bits} must be in 0..64")
    needed = -(-count * bits // 8)
    data = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).ravel()
    if data.size < needed:
        raise CodecFormatError(f"bit stream holds {data.size} bytes; {count} values of {bits} bits need {needed}")
    if bits == 0 or count == 0:
        return np.zeros(count, np.uint64)
    groups = -(-count // 8)
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
    return out_G8.ravel()[:count]


__all__ = ["pack_bits", "unpack_bits"]
