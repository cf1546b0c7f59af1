"""RankBundle's bounds: the codec's expansion cap and chunked decode, and padding bounded by the receiver.

A bundle declares its own rows, and some rows cost no bytes: a span of a zero-bit layout (ordered
mode with one expert, set mode with K = E) and every padding row. Without bounds a 73-byte bundle
asks for gigabytes. These tests check the refusals happen on the header, before allocating (traced
peak under `REFUSAL_PEAK`), and that an honest decode allocates its output plus one bounded step.

Legend: P = rows of the rank's layout, L = layers, K = top-k, E = experts.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from routereplay.codec.encoded import EncodedRoutes
from routereplay.codec.limits import MIN_CHUNK_ENTRIES, WORKING_BYTES_PER_ENTRY, CodecLimits
from routereplay.errors import CodecFormatError, CodecLimitError, ConfigError
from routereplay.testing.synthetic import random_trace
from routereplay.transport.bundle import MAGIC, Placed, RankBundle, pack_bundle

FIXED = struct.Struct("<4sBBHQIHII")  # magic, version, mode, reserved, P, L, K, E, S
SPAN = struct.Struct("<QQQBB")  # dest, length, routed, has bitmap, bitmap skip
CUT = struct.Struct("<BQ")  # skip, bytes
REFUSAL_PEAK = 1 << 20  # a refusal reads the header and span records only
DECODE_SLACK = 1 << 20  # unranker tables of E = 16, K = 4, span records, numpy scalars


def _peak(call: Callable[[], object]) -> int:
    """tracemalloc peak of `call()` (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _forged(rows: int, *, layers: int, top_k: int, experts: int, mode: int, spans: list[bytes]) -> bytes:
    body = FIXED.pack(MAGIC, 1, mode, 0, rows, layers, top_k, experts, len(spans)) + bytes(4 * layers)
    body += b"".join(spans)
    return body + struct.pack("<I", zlib.crc32(body))


def _zero_bit(rows: int) -> bytes:
    """One ordered span of `rows` rows of one expert: 0 bits per id, so no data bytes at all."""
    return _forged(rows, layers=1, top_k=1, experts=1, mode=1, spans=[SPAN.pack(0, rows, rows, 0, 0) + CUT.pack(0, 0)])


def test_zero_bit_span_is_refused_by_the_expansion_cap_before_allocating() -> None:
    """A 73-byte bundle declaring 2**24 rows of a zero-bit layout (2**28 decoded to 2.5 GiB in 2.1 s) is
    refused on its span records, even when P is what the rank expects: the span claims rows with no
    bytes behind them."""
    rows = 1 << 24
    data = _zero_bit(rows)
    assert len(data) == 73

    def parse() -> None:
        with pytest.raises(CodecLimitError, match=r"over the rows its spans cover .*max_expansion=4096x; refused"):
            RankBundle(data, expected_rows=rows)

    assert _peak(parse) < REFUSAL_PEAK


def test_zero_bit_layout_decodes_when_the_limit_is_raised() -> None:
    """The cap is a bound, not a ban: a trusted zero-bit bundle decodes to its one expert with
    max_expansion raised (and its -1 padding rows around the span)."""
    n = 500_000  # 1 MB of ids from 73 bytes: 13,698x
    data = _forged(n + 10, layers=1, top_k=1, experts=1, mode=1, spans=[SPAN.pack(2, n, n, 0, 0) + CUT.pack(0, 0)])
    with pytest.raises(CodecLimitError, match="13698x its size"):
        RankBundle(data, expected_rows=n + 10)
    limits = CodecLimits(max_expansion=1 << 20, chunk_entries=MIN_CHUNK_ENTRIES)
    rows = RankBundle(data, expected_rows=n + 10, limits=limits).decode()
    assert (rows[2 : n + 2] == 0).all() and (rows[:2] == -1).all() and (rows[n + 2 :] == -1).all()


def test_padding_only_bundle_is_bounded_by_the_expected_rows() -> None:
    """A 38-byte bundle of no spans declaring 1.17e8 rows (448 MiB of -1) is refused unless the receiver
    vouches for its row count with expected_rows; with it, the rows are the rank's own."""
    forged = _forged(117_000_000, layers=1, top_k=2, experts=8, mode=0, spans=[])
    assert len(forged) == 38

    def parse() -> None:
        with pytest.raises(CodecLimitError, match=r"padding included.*pass RankBundle\(data, expected_rows=P\)"):
            RankBundle(forged)

    assert _peak(parse) < REFUSAL_PEAK
    with pytest.raises(CodecFormatError, match="holds 117000000 layout rows but this rank's layout has 4096"):
        RankBundle(forged, expected_rows=4096)
    honest = _forged(1 << 16, layers=1, top_k=2, experts=8, mode=0, spans=[])  # a rank of padding only
    with pytest.raises(CodecLimitError, match="padding included"):
        RankBundle(honest)
    assert (RankBundle(honest, expected_rows=1 << 16).decode() == -1).all()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "40"])
def test_expected_rows_must_be_a_row_count(bad: object) -> None:
    with pytest.raises(ConfigError, match="must be this rank's layout rows"):
        RankBundle(_zero_bit(4), expected_rows=bad)  # type: ignore[arg-type]


def _encoded(mode: str, unrouted: float, tokens: int, seed: int = 0) -> EncodedRoutes:
    trace = random_trace(np.random.default_rng(seed), num_tokens=tokens, num_layers=4, top_k=4, num_experts=16,
                         unrouted_fraction=unrouted)  # fmt: skip
    return EncodedRoutes.encode(trace, mode=mode)


@pytest.mark.parametrize("mode", ["set", "ordered"])
@pytest.mark.parametrize("unrouted", [0.0, 0.3])
def test_decode_allocates_the_output_plus_one_bounded_step(mode: str, unrouted: float) -> None:
    """2**20 ids (2 MiB of int16) in two spans: the decode's peak is the output plus one step's working set
    (WORKING_BYTES_PER_ENTRY x chunk_entries) plus small tables, not the 8+ bytes per id of uint64 arrays
    over whole spans the unchunked decode allocated."""
    encoded = _encoded(mode, unrouted, tokens=1 << 16)
    half = 1 << 15
    data = pack_bundle((1 << 16) + 7, [Placed(3, encoded.span(0, half)), Placed(half + 7, encoded.span(half, 1 << 16))],
                       encoded)  # fmt: skip
    limits = CodecLimits(chunk_entries=MIN_CHUNK_ENTRIES)
    bundle = RankBundle(data, expected_rows=(1 << 16) + 7, limits=limits)
    output = bundle.rows * 4 * 4 * 2
    peak = _peak(bundle.decode)
    bound = output + WORKING_BYTES_PER_ENTRY * MIN_CHUNK_ENTRIES + DECODE_SLACK
    assert peak <= bound, f"decode peaked at {peak} bytes for {output} bytes of ids (bound {bound})"
    rows = bundle.decode()
    assert np.array_equal(rows[3 : 3 + half], encoded.rows(0, half))
    assert np.array_equal(rows[half + 7 :], encoded.rows(half, 1 << 16))
    assert (rows[:3] == -1).all() and (rows[3 + half : half + 7] == -1).all()


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_chunked_decode_equals_the_rows_across_step_boundaries(mode: str) -> None:
    """Spans starting at odd rows and bits (bitmap skips 1..7), decoded 1024 ids (64 rows of L x K) per step:
    a step boundary that lost or repeated a routed row would shift every later row onto another token."""
    encoded = _encoded(mode, 0.4, tokens=700, seed=3)
    cuts = [(1, 90), (91, 333), (400, 699)]
    placed, dest = [], 5
    for begin, end in cuts:
        placed.append(Placed(dest, encoded.span(begin, end)))
        dest += end - begin + 3
    data = pack_bundle(dest, placed, encoded)
    for chunk in (MIN_CHUNK_ENTRIES, 3000, 1 << 18):
        rows = RankBundle(data, expected_rows=dest, limits=CodecLimits(chunk_entries=chunk)).decode()
        for p, (begin, end) in zip(placed, cuts, strict=True):
            assert np.array_equal(rows[p.dest : p.dest + end - begin], encoded.rows(begin, end)), (chunk, begin)
