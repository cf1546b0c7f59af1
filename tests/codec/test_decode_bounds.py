"""Decoding stays bounded on blobs from outside: zero-bit rows declaring huge counts, a huge set table and
zstd bombs are refused by `CodecLimits` before their output is allocated (traced peak under 64 MiB), and a
real trace decodes with intermediates near its output size. Blobs are forged with a valid CRC
(`tests/codec/blobs.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay import RouteTrace, decode, encode
from routereplay.codec.limits import CodecLimits
from routereplay.errors import CodecError, CodecLimitError
from tests.codec.blobs import FLAG_ZSTD, ORDERED, SET, forge, traced_peak
from tests.wire.payloads import distinct_routes

MEMORY_BOUND = 64 << 20


def test_an_88_byte_zero_bit_blob_declaring_1e8_rows_is_refused() -> None:
    """An 88-byte codec blob, ordered mode with E = 1 (0 bits per
    row), declaring 1e8 rows is refused with CodecLimitError before the 954 MiB output is allocated."""
    blob = forge(T=10**8, L=1, K=1, E=1, mode=ORDERED)
    assert len(blob) == 88
    result, peak = traced_peak(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert peak < MEMORY_BOUND


def test_a_set_mode_blob_of_k_equal_e_and_2_pow_32_rows_is_refused() -> None:
    """Set mode with K = E (0 bits per row) and T = 2**32 rows is
    refused with CodecLimitError within a small memory bound (it asked for 32 GiB)."""
    blob = forge(T=2**32, L=1, K=4, E=4, mode=SET)
    result, peak = traced_peak(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert peak < MEMORY_BOUND


def test_a_small_zero_bit_trace_still_round_trips() -> None:
    """A legitimate small E = 1 trace still round-trips."""
    trace = RouteTrace(np.zeros((5, 2, 1), dtype=np.int16), 1)
    assert decode(encode(trace, mode="ordered")) == trace


def test_a_2000_expert_set_table_is_refused_by_max_set_table() -> None:
    """Set mode with E = K = 2000 in a tiny blob is refused by the
    set-table limit (CodecLimitError naming max_set_table), not decoded for 11-21 s of CPU."""
    blob = forge(T=1, L=1, K=2000, E=2000, mode=SET)
    assert len(blob) == 88
    with pytest.raises(CodecLimitError, match="max_set_table"):
        decode(blob)


def test_a_zstd_frame_claiming_2_56_gib_is_refused_before_allocating() -> None:
    """A zstd payload that claims 2.56 GiB raw is refused with a
    CodecError, not a MemoryError, and nothing near its size is allocated - also with every limit raised."""
    zstd = pytest.importorskip("zstandard")
    frame = zstd.ZstdCompressor().compress(b"\0" * 4096)
    claimed = int(2.56 * (1 << 30))
    T = claimed // 8  # ordered mode, E = 256: 8 bits per id, K = L = 1
    blob = forge(T=T, L=1, K=1, E=256, mode=ORDERED, flags=FLAG_ZSTD, payload=frame, raw_bytes=claimed)
    for limits in (None, CodecLimits(max_entries=2**40, max_expansion=2**40)):
        result, peak = traced_peak(lambda limits=limits: decode(blob, limits=limits))
        assert isinstance(result, CodecError), result
        assert peak < MEMORY_BOUND


def test_a_real_zstd_bomb_is_refused_by_max_expansion_and_decodes_when_raised() -> None:
    """A genuine bomb within the old defaults - an encode(compress=
    True) trace of almost only -1 rows, a few hundred bytes expanding to 16 MiB - is refused by the
    documented max_expansion limit; raising that limit decodes it exactly."""
    pytest.importorskip("zstandard")
    experts_TLK = np.full((1 << 18, 4, 8), -1, dtype=np.int16)
    experts_TLK[0] = np.arange(8)
    trace = RouteTrace(experts_TLK, 64)
    blob = encode(trace, mode="ordered", compress=True)
    assert len(blob) * 4096 < experts_TLK.nbytes
    result, peak = traced_peak(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert "max_expansion" in str(result)
    assert peak < MEMORY_BOUND
    assert decode(blob, limits=CodecLimits(max_expansion=1 << 20)) == trace


def test_decoding_a_real_trace_peaks_near_its_output_size() -> None:
    """Decoding a real 8 MiB trace peaks at a small multiple of its
    output, not 4-5x the ids in intermediates."""
    rng = np.random.default_rng(0)
    trace = RouteTrace(distinct_routes(rng, 1 << 14, 32, 8, 64).astype(np.int16), 64)
    blob = encode(trace, mode="ordered")
    result, peak = traced_peak(lambda: decode(blob))
    assert result == trace
    assert peak < 2 * trace.experts.nbytes + (24 << 20)
