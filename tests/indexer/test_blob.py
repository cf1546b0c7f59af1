"""The indexer blob against hostile bytes: truncation, flipped bits, forged shapes and tables - named errors only,
and nothing large allocated for a small blob."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest

from routereplay.errors import ChecksumError, CodecError, CodecFormatError, CodecLimitError, CodecVersionError
from routereplay.indexer import IndexerLimits, IndexerTrace
from routereplay.indexer.blob import MAGIC, MIN_BLOB_BYTES
from routereplay.indexer.canonical import check_dense
from tests.indexer.choices import random_choices

_FIXED = struct.Struct("<4sBBHQIIQI")


def _small() -> tuple[IndexerTrace, bytes]:
    dense = random_choices(40, 2, 6, start=2, unknown=0.15, seed=11)
    trace = IndexerTrace.from_dense(dense, [3, 9], 6, 2, block_rows=8)
    return trace, trace.encode()


def _resealed(body: bytes | bytearray) -> bytes:
    """Bytes with a valid CRC32: what a forger (not a corrupting link) sends."""
    return bytes(body) + zlib.crc32(body).to_bytes(4, "little")


def _forged_header(blob: bytes, **fields: int) -> bytes:
    names = ("magic", "version", "flags", "reserved", "T", "L", "I", "start", "B")
    values = dict(zip(names, _FIXED.unpack_from(blob), strict=True))
    values.update(fields)
    return _resealed(_FIXED.pack(*values.values()) + blob[_FIXED.size : -4])


def test_every_truncation_is_a_format_error() -> None:
    """A blob cut at any byte must raise CodecFormatError, never decode or crash."""
    _, blob = _small()
    for size in range(len(blob)):
        with pytest.raises(CodecFormatError):
            IndexerTrace.decode(blob[:size])


def test_flipped_bytes_fail_the_checksum_or_the_format() -> None:
    """Any single corrupted byte must be caught (ChecksumError, or a named format/limit/version error)."""
    _, blob = _small()
    kinds = set()
    for at in range(len(blob)):
        corrupt = bytearray(blob)
        corrupt[at] ^= 0x24
        with pytest.raises(CodecError) as caught:
            IndexerTrace.decode(bytes(corrupt))
        kinds.add(type(caught.value))
    assert ChecksumError in kinds


def test_resealed_bit_flips_decode_valid_or_refuse() -> None:
    """With the CRC recomputed, a flipped bit must give a named error or a trace whose rows are still canonical."""
    _, blob = _small()
    body = blob[:-4]
    for at in range(len(body)):
        for bit in (0, 3, 7):
            forged = bytearray(body)
            forged[at] ^= 1 << bit
            try:
                other = IndexerTrace.decode(_resealed(forged))
            except CodecError:
                continue
            check_dense(other.to_dense(), other.layers, other.index_topk, other.start)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"T": 1 << 40}, CodecLimitError, "max_tokens"),
        ({"L": 1 << 20}, CodecLimitError, "max_layers"),
        ({"I": 1 << 30}, CodecLimitError, "max_index_topk"),
        ({"T": 1 << 22, "L": 1000, "I": 2048}, CodecLimitError, "max_entries"),
        ({"T": 1 << 22}, CodecFormatError, "truncated"),  # 32k blocks declared, their table is missing
        ({"B": 0}, CodecFormatError, "rows per block"),
        ({"flags": 4}, CodecFormatError, "flags"),
        ({"start": 1 << 31}, CodecFormatError, "int32"),
    ],
)
def test_forged_headers_are_refused_before_allocating(fields: dict[str, int], error: type, match: str) -> None:
    """Forged counts (with a valid CRC) must raise the named error without allocating anything near their size."""
    _, blob = _small()
    forged = _forged_header(blob, **fields)
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            IndexerTrace.decode(forged)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_limits_are_honoured_for_genuine_blobs() -> None:
    """A genuine blob beyond caller-given limits must be refused; within them it decodes."""
    trace, blob = _small()
    with pytest.raises(CodecLimitError, match="max_entries"):
        IndexerTrace.decode(blob, IndexerLimits(max_entries=100))
    assert IndexerTrace.decode(blob, IndexerLimits(max_entries=480)) == trace


def test_forged_block_table_is_refused() -> None:
    """An impossible block mode or gap width (CRC valid) must be a CodecFormatError naming the block."""
    _, blob = _small()
    body = bytearray(blob[:-4])
    table_at = _FIXED.size + 4 * 2 + 10  # fixed header, 2 layer numbers, ceil(2 * 40 / 8) unknown-row bits
    for mode, bits in ((7, 0), (1, 3), (0, 40)):
        forged = bytearray(body)
        forged[table_at], forged[table_at + 1] = mode, bits
        with pytest.raises(CodecFormatError, match="block 0"):
            IndexerTrace.decode(_resealed(forged))


def test_envelope_errors_name_the_problem() -> None:
    """Wrong magic, a newer version, trailing bytes and non-bytes must each give a specific error."""
    _, blob = _small()
    with pytest.raises(CodecFormatError, match="bad magic"):
        IndexerTrace.decode(b"RRTC" + blob[4:])
    with pytest.raises(CodecVersionError, match="version 9"):
        IndexerTrace.decode(MAGIC + bytes([9]) + blob[5:])
    with pytest.raises(CodecFormatError, match="payload bytes"):
        IndexerTrace.decode(_resealed(blob[:-4] + b"\0"))
    with pytest.raises(CodecFormatError, match="bytes"):
        IndexerTrace.decode("not bytes")  # type: ignore[arg-type]
    assert len(blob) > MIN_BLOB_BYTES


def test_empty_and_unknown_only_traces_round_trip() -> None:
    """Zero rows, and a trace whose rows are all unknown, must survive encode/decode exactly."""
    empty = IndexerTrace.from_dense(np.zeros((0, 2, 4), np.int32), [0, 1], 4)
    assert IndexerTrace.decode(empty.encode()) == empty and empty.to_dense().shape == (0, 2, 4)
    unknown = np.full((50, 1, 4), -1, np.int32)
    trace = IndexerTrace.decode(IndexerTrace.from_dense(unknown, [7], 4).encode())
    assert np.array_equal(trace.to_dense(), unknown) and trace.unknown_rows().all()
