"""EncodedRoutes: random-access rows and span cuts of a resident codec blob, against the whole decode."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routereplay.codec import blob as codec
from routereplay.codec.encoded import BLOCK_ROWS, EncodedRoutes, trusted
from routereplay.errors import ChecksumError, CodecFormatError, ConfigError, RowCountError
from routereplay.testing.synthetic import random_trace
from routereplay.trace.route_trace import RouteTrace
from routereplay.transport.bundle import Placed, RankBundle, pack_bundle

MODES = ("set", "ordered")


def _trace(seed: int, *, tokens: int, layers: int = 5, top_k: int = 4, experts: int = 16, start: int = 0,
           unrouted: float = 0.2) -> RouteTrace:  # fmt: skip
    return random_trace(
        np.random.default_rng(seed), num_tokens=tokens, num_layers=layers, top_k=top_k, num_experts=experts,
        start=start, unrouted_fraction=unrouted,
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unrouted", [0.0, 0.3])
def test_rows_equal_the_whole_decode_across_index_blocks(mode: str, unrouted: float) -> None:
    """A random-access read must give exactly the rows a whole decode gives: an off-by-one in the block index
    or the routed-row count before a row would replay another token's experts, silently."""
    trace = _trace(0, tokens=2000, start=11, unrouted=unrouted)  # 10,000 rows: three index blocks
    assert trace.num_tokens * trace.num_layers > 2 * BLOCK_ROWS
    encoded = EncodedRoutes.encode(trace, mode=mode)
    whole = codec.decode(codec.encode(trace, mode=mode)).experts
    for begin, end in [(11, 2011), (12, 13), (830, 1650), (2010, 2011), (500, 500), (11 + 819, 11 + 820)]:
        assert np.array_equal(encoded.rows(begin, end), whole[begin - 11 : end - 11]), (begin, end)
    assert np.array_equal(encoded.trace().experts, whole)
    assert encoded.routed_tokens == trace.num_routed


@given(
    data=st.data(),
    mode=st.sampled_from(MODES),
    unrouted=st.sampled_from([0.0, 0.05, 0.9]),
    shape=st.sampled_from([(1, 2, 3), (3, 2, 7), (8, 4, 256), (2, 8, 128), (12, 3, 300)]),
)
def test_any_range_and_its_span_cut_decode_exactly(data: st.DataObject, mode: str, unrouted: float,
                                                   shape: tuple[int, int, int]) -> None:  # fmt: skip
    """Every range [a, b), read directly or cut encoded and shipped in a bundle, equals the same rows of the
    whole trace: a wrong stream skip or bitmap offset in a cut would misroute the receiving rank."""
    layers, top_k, experts = shape
    tokens = data.draw(st.integers(1, 300))
    trace = _trace(data.draw(st.integers(0, 10**6)), tokens=tokens, layers=layers, top_k=top_k, experts=experts,
                   unrouted=unrouted)  # fmt: skip
    encoded = EncodedRoutes.encode(trace, mode=mode)
    whole = encoded.rows(0, tokens)
    begin = data.draw(st.integers(0, tokens))
    end = data.draw(st.integers(begin, tokens))
    assert np.array_equal(encoded.rows(begin, end), whole[begin:end])
    dest = data.draw(st.integers(0, 5))
    bundle = RankBundle(pack_bundle(dest + end - begin + 3, [Placed(dest, encoded.span(begin, end))], encoded))
    decoded = bundle.decode()
    assert np.array_equal(decoded[dest : dest + end - begin], whole[begin:end])
    assert (decoded[:dest] == -1).all() and (decoded[dest + end - begin :] == -1).all()


def test_set_mode_reads_sets_and_ordered_mode_keeps_the_order() -> None:
    """The default set store reads each row back sorted (the set replay forces); ordered keeps engine order."""
    trace = _trace(3, tokens=50, unrouted=0.0)
    assert not np.array_equal(trace.experts, np.sort(trace.experts, axis=-1))
    assert np.array_equal(EncodedRoutes.encode(trace).rows(0, 50), np.sort(trace.experts, axis=-1))
    assert np.array_equal(EncodedRoutes.encode(trace, mode="ordered").rows(0, 50), trace.experts)


def test_zstd_blob_is_inflated_once_and_read_at_random() -> None:
    """A compressed blob must stay readable at random (inflated once on load, not per read)."""
    pytest.importorskip("zstandard")
    trace = _trace(4, tokens=400, unrouted=0.1)
    encoded = EncodedRoutes(codec.encode(trace, compress=True))
    assert np.array_equal(encoded.rows(100, 300), EncodedRoutes.encode(trace).rows(100, 300))
    assert encoded.nbytes >= encoded.header.raw_payload_bytes


def test_bad_blobs_and_ranges_are_named_errors() -> None:
    """A tampered blob is refused when it is taken in, and a read outside the rows held names the range."""
    trace = _trace(5, tokens=30, start=4)
    blob = bytearray(codec.encode(trace))
    encoded = EncodedRoutes(bytes(blob))
    with pytest.raises(
        RowCountError, match=r"rows \[0, 10\) are outside the routes held for token positions \[4, 34\)"
    ):
        encoded.rows(0, 10)
    with pytest.raises(RowCountError, match="outside"):
        encoded.span(20, 35)
    with pytest.raises(ConfigError, match="token positions must be ints"):
        encoded.rows(4.0, 10)  # type: ignore[arg-type]
    blob[-10] ^= 1
    with pytest.raises(ChecksumError, match="CRC32 mismatch"):
        EncodedRoutes(bytes(blob))
    with pytest.raises(CodecFormatError, match="bad magic"):
        EncodedRoutes(b"NOPE" + bytes(60))
    with pytest.raises(ConfigError, match="needs the blob as bytes"):
        EncodedRoutes("RRTC")  # type: ignore[arg-type]


def test_pickles_as_its_blob() -> None:
    """Ray and multiprocessing pickle stores: a piece must come back equal, with its index rebuilt."""
    encoded = EncodedRoutes.encode(_trace(6, tokens=900))
    back = pickle.loads(pickle.dumps(encoded))
    assert back == encoded and np.array_equal(back.rows(100, 800), encoded.rows(100, 800))
    assert trusted(encoded.blob) == encoded


def test_resident_set_form_is_under_a_third_of_int16() -> None:
    """The compact store's promise for Qwen3-30B-A3B routing (top-8 of 128): <= 0.35x the int16 ids it replaces."""
    trace = _trace(7, tokens=512, layers=48, top_k=8, experts=128, unrouted=0.01)
    encoded = EncodedRoutes.encode(trace)
    int16_bytes = trace.experts.size * 2
    assert encoded.nbytes <= 0.35 * int16_bytes
    assert EncodedRoutes.encode(trace, mode="ordered").nbytes > encoded.nbytes
