"""RankBundle from outside: forged, truncated and tampered bundles are named errors before allocation."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from routereplay.codec.encoded import EncodedRoutes
from routereplay.codec.limits import CodecLimits
from routereplay.errors import ChecksumError, CodecFormatError, CodecLimitError, CodecVersionError, ConfigError
from routereplay.testing.synthetic import random_trace
from routereplay.transport.bundle import Placed, RankBundle, pack_bundle

FIXED = struct.Struct("<4sBBHQIHII")
SPAN = struct.Struct("<QQQBB")


def _encoded(mode: str = "set", unrouted: float = 0.25) -> EncodedRoutes:
    trace = random_trace(np.random.default_rng(0), num_tokens=64, num_layers=3, top_k=2, num_experts=8,
                         unrouted_fraction=unrouted)  # fmt: skip
    return EncodedRoutes.encode(trace, mode=mode)


def _bundle(mode: str = "set") -> tuple[bytes, EncodedRoutes]:
    encoded = _encoded(mode)
    return pack_bundle(40, [Placed(2, encoded.span(5, 20)), Placed(25, encoded.span(40, 52))], encoded), encoded


def _recrc(body: bytes) -> bytes:
    """A forged bundle with a valid checksum: the checks after the CRC must catch it."""
    return body + struct.pack("<I", zlib.crc32(body))


def _spans_at() -> int:
    return FIXED.size + 4 * 3


def test_round_trip_places_each_span_and_leaves_the_rest_unrouted() -> None:
    """Rows no span covers (padding, last tokens) must decode to -1, never to stale or zero ids."""
    for mode in ("set", "ordered"):
        data, encoded = _bundle(mode)
        bundle = RankBundle(data, expected_rows=40)
        rows = bundle.decode()
        assert bundle.spans == 2 and bundle.covered_rows == 27
        assert np.array_equal(rows[2:17], encoded.rows(5, 20)) and np.array_equal(rows[25:37], encoded.rows(40, 52))
        assert (rows[:2] == -1).all() and (rows[17:25] == -1).all() and (rows[37:] == -1).all()
        assert bundle.to_torch().shape == (40, 3, 2)


def test_decode_into_a_reused_buffer_writes_every_row() -> None:
    """A trainer's buffer holds the last step's rows: decoding into it must overwrite every one, padding
    and unrouted rows included, and give exactly the fresh decode (both modes, numpy and torch)."""
    import torch

    for mode in ("set", "ordered"):
        data, _ = _bundle(mode)
        bundle = RankBundle(data, expected_rows=40)
        fresh = bundle.decode()
        buffer = np.full((64, 3, 2), 7, fresh.dtype)  # stale ids everywhere, and more rows than needed
        assert bundle.decode(out=buffer[:40]) is not None
        assert np.array_equal(buffer[:40], fresh) and (buffer[40:] == 7).all()
        pinned = torch.full((64, 3, 2), 7, dtype=torch.int16)
        tensor = bundle.to_torch(out=pinned[:40])
        assert tensor.data_ptr() == pinned.data_ptr() and torch.equal(pinned[:40], torch.from_numpy(fresh))
        assert (pinned[40:] == 7).all()


def test_a_wrong_buffer_is_refused_by_name() -> None:
    import torch

    data, _ = _bundle()
    bundle = RankBundle(data, expected_rows=40)
    with pytest.raises(ConfigError, match="shape \\(40, 3, 2\\).*buffer\\[:40\\]"):
        bundle.decode(out=np.empty((41, 3, 2), np.int16))
    with pytest.raises(ConfigError, match="C-contiguous int16"):
        bundle.decode(out=np.empty((40, 3, 2), np.int32))
    with pytest.raises(ConfigError, match="that shape that is not C-contiguous"):
        bundle.decode(out=np.empty((40, 3, 4), np.int16)[:, :, ::2])
    read_only = np.empty((40, 3, 2), np.int16)
    read_only.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        bundle.decode(out=read_only)
    with pytest.raises(ConfigError, match="C-contiguous int16 array"):
        bundle.decode(out=[[0]])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="CPU torch tensor"):
        bundle.to_torch(out=np.empty((40, 3, 2), np.int16))
    with pytest.raises(ConfigError, match="contiguous: False"):
        bundle.to_torch(out=torch.empty((40, 3, 4), dtype=torch.int16)[:, :, ::2])
    with pytest.raises(ConfigError, match="got torch.int32 \\(40, 3, 2\\)"):
        bundle.to_torch(out=torch.empty((40, 3, 2), dtype=torch.int32))


def test_envelope_errors_name_the_cause() -> None:
    """Not a bundle, a newer version, a flipped bit, a cut-short transfer: each is refused by name."""
    data, _ = _bundle()
    with pytest.raises(CodecFormatError, match="not a routereplay rank bundle"):
        RankBundle(b"RRTC" + data[4:])
    with pytest.raises(CodecVersionError, match="rank bundle version 9"):
        RankBundle(data[:4] + b"\x09" + data[5:])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    with pytest.raises(ChecksumError, match="corrupted or truncated in transit"):
        RankBundle(bytes(flipped))
    with pytest.raises(ChecksumError):
        RankBundle(data[:-7])
    with pytest.raises(CodecFormatError, match="truncated rank bundle"):
        RankBundle(data[:12])
    with pytest.raises(ConfigError, match="a rank bundle is bytes"):
        RankBundle(data.hex())  # type: ignore[arg-type]


def test_forged_row_count_is_refused_before_allocating() -> None:
    """A forged P (2**40 rows) must not allocate terabytes: limits are checked on the header alone."""
    data, _ = _bundle()
    forged = bytearray(data[:-4])
    struct.pack_into("<Q", forged, 8, 1 << 40)
    with pytest.raises(CodecLimitError, match="refused before allocating"):
        RankBundle(_recrc(bytes(forged)))
    with pytest.raises(CodecFormatError, match="built for another rank or batch"):
        RankBundle(data, expected_rows=41)
    with pytest.raises(CodecLimitError, match="max_entries=100"):
        RankBundle(data, limits=CodecLimits(max_entries=100))


def test_overlapping_or_out_of_range_spans_are_refused() -> None:
    """Two spans writing the same rows (or past the rank's rows) would replay one token with another's routes."""
    data, _ = _bundle()
    body = bytearray(data[:-4])
    record = SPAN.size + 9  # one stream cut (u8 skip, u64 bytes) for set mode with C(8, 2) = 28
    second = _spans_at() + record
    struct.pack_into("<Q", body, second, 10)  # dest 10: inside the first span's rows [2, 17)
    with pytest.raises(CodecFormatError, match="overlaps the previous span"):
        RankBundle(_recrc(bytes(body)))
    body = bytearray(data[:-4])
    struct.pack_into("<Q", body, second, 30)  # rows [30, 42) past P = 40
    with pytest.raises(CodecFormatError, match="ends past the 40 rows"):
        RankBundle(_recrc(bytes(body)))


def test_lengths_that_disagree_are_refused() -> None:
    """A bitmap whose popcount lies, a stream of the wrong length, stray bytes: all refused before decoding."""
    data, _ = _bundle()
    body = bytearray(data[:-4])
    routed_at = _spans_at() + 16
    (routed,) = struct.unpack_from("<Q", body, routed_at)
    struct.pack_into("<Q", body, routed_at, routed - 1)
    with pytest.raises(CodecFormatError, match="bitmap marks .* routed rows, not"):
        RankBundle(_recrc(bytes(body)))
    with pytest.raises(CodecFormatError, match="stray bytes before its checksum"):
        RankBundle(_recrc(data[:-4] + b"\x00"))
    body = bytearray(data[:-4])
    struct.pack_into("<Q", body, _spans_at() + SPAN.size + 1, 1)  # the first span's stream: 1 byte
    with pytest.raises(CodecFormatError, match="stream 0 is 1 bytes"):
        RankBundle(_recrc(bytes(body)))
    with pytest.raises(CodecFormatError, match="declares 4294967295 spans"):
        RankBundle(_recrc(data[:26] + struct.pack("<I", 2**32 - 1) + data[30:-4]))


def test_corrupt_values_are_caught_while_unpacking() -> None:
    """Payload bits that pass every length check but hold an impossible set rank must not decode to ids."""
    encoded = _encoded(unrouted=0.0)
    data = pack_bundle(10, [Placed(0, encoded.span(0, 10))], encoded)
    body = bytearray(data[:-4])
    payload_at = len(body) - (-(-30 * 5 // 8))  # 30 routed rows of ceil(log2 28) = 5 bits
    body[payload_at] |= 0x1F  # rank 31 >= C(8, 2) = 28
    with pytest.raises(CodecFormatError, match=r"set rank 31 >= C\(8, 2\)"):
        RankBundle(_recrc(bytes(body))).decode()
