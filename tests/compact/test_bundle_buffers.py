"""RankBundle's buffers: it decodes the bytes it checked, and writes only a plain, aligned, separate `out=`.

Defects guarded against: a reused receive buffer refilled between `RankBundle(buf)` and `decode()` was
decoded as its new content, unchecked (other ids, silently); `decode(out=)` / `to_torch(out=)` on a
view at an odd address had the C kernel write int16 through a misaligned pointer (undefined behaviour);
a strided memoryview raised TypeError, a nested or negative-bit tensor torch's RuntimeError, and an
`out=` over the bundle's own bytes was written while they were still being read.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from routereplay.codec.encoded import EncodedRoutes
from routereplay.errors import ConfigError
from routereplay.testing.synthetic import random_trace
from routereplay.transport.bundle import Placed, RankBundle, pack_bundle

P, L, K, E = 40, 3, 2, 8
SHAPE = (P, L, K)


def _bundle(seed: int, mode: str = "set") -> tuple[bytes, EncodedRoutes]:
    trace = random_trace(np.random.default_rng(seed), num_tokens=64, num_layers=L, top_k=K, num_experts=E)
    encoded = EncodedRoutes.encode(trace, mode=mode)
    return pack_bundle(P, [Placed(2, encoded.span(5, 20)), Placed(25, encoded.span(40, 52))], encoded), encoded


@pytest.mark.parametrize("mode", ["set", "ordered"])
@pytest.mark.parametrize("wrap", [bytearray, lambda b: memoryview(bytearray(b))])
def test_a_receive_buffer_refilled_after_the_check_decodes_what_was_checked(mode: str, wrap: object) -> None:
    """The receiver parses bundle 1 in its reused buffer, the next message (bundle 2, same length) lands in it
    before decode(): the rows are bundle 1's, not bundle 2's ids taken unchecked."""
    first, encoded = _bundle(0, mode)
    second, _ = _bundle(1, mode)
    assert len(first) == len(second) and first != second
    buffer = wrap(first)  # type: ignore[operator]
    bundle = RankBundle(buffer, expected_rows=P)
    buffer[:] = second
    rows = bundle.decode()
    assert np.array_equal(rows, RankBundle(first, expected_rows=P).decode())
    assert np.array_equal(rows[2:17], encoded.rows(5, 20))
    assert not np.array_equal(rows, RankBundle(second, expected_rows=P).decode())


def test_bytes_are_read_in_place_in_any_contiguous_shape() -> None:
    """Immutable bytes need no copy (a memoryview slice of a larger message included); a 2-d C-contiguous
    view is the same bytes in order."""
    data, _ = _bundle(0)
    message = b"head" + data + b"tail"
    expected = RankBundle(data, expected_rows=P).decode()
    assert np.array_equal(RankBundle(memoryview(message)[4:-4], expected_rows=P).decode(), expected)
    grid = memoryview(bytearray(data)).cast("B", (1, len(data)))  # a 2-d C-contiguous view: the same bytes
    assert np.array_equal(RankBundle(grid, expected_rows=P).decode(), expected)


def test_a_strided_memoryview_is_refused_by_name() -> None:
    data, _ = _bundle(0)
    doubled = bytes(b for byte in data for b in (byte, 0))
    with pytest.raises(ConfigError, match="one contiguous run of bytes; got a strided memoryview"):
        RankBundle(memoryview(doubled)[::2], expected_rows=P)
    assert np.array_equal(
        RankBundle(memoryview(doubled)[::2].tobytes(), expected_rows=P).decode(), RankBundle(data).decode()
    )


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_an_out_at_an_odd_address_is_refused_not_written_unaligned(mode: str) -> None:
    data, _ = _bundle(0, mode)
    bundle = RankBundle(data, expected_rows=P)
    raw = np.zeros(P * L * K * 2 + 2, np.uint8)
    odd = raw[1:-1].view(np.int16).reshape(SHAPE)
    assert not odd.flags.aligned and odd.flags.c_contiguous
    with pytest.raises(ConfigError, match="not a multiple of its 2-byte items .*offset=1"):
        bundle.decode(out=odd)
    assert (raw == 0).all()  # nothing was written
    tensor = torch.frombuffer(bytearray(P * L * K * 2 + 1), dtype=torch.int16, offset=1, count=P * L * K)
    with pytest.raises(ConfigError, match="not a multiple of its 2-byte items"):
        bundle.to_torch(out=tensor.view(SHAPE))
    aligned = raw[2:].view(np.int16).reshape(SHAPE)
    assert np.array_equal(bundle.decode(out=aligned), bundle.decode())


def test_tensors_whose_memory_is_not_their_values_are_refused_by_name() -> None:
    bundle = RankBundle(_bundle(0)[0], expected_rows=P)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensor API's prototype warning
        nested = torch.nested.nested_tensor([torch.zeros(L, K, dtype=torch.int16)] * P)
    with pytest.raises(ConfigError, match="out= is a nested tensor"):
        bundle.to_torch(out=nested)
    negated = torch._neg_view(torch.zeros(SHAPE, dtype=torch.int16))
    assert negated.is_neg()
    with pytest.raises(ConfigError, match="out= is a lazily negated .*resolve_neg"):
        bundle.to_torch(out=negated)
    sparse = torch.zeros(SHAPE, dtype=torch.int16).to_sparse()
    with pytest.raises(ConfigError, match="out= is a torch.sparse_coo \\(not strided\\) tensor"):
        bundle.to_torch(out=sparse)
    plain = negated.resolve_neg()
    assert bundle.to_torch(out=plain) is plain and torch.equal(plain, torch.from_numpy(bundle.decode()))


def test_an_out_over_the_bundle_bytes_is_refused() -> None:
    """A message whose bytes hold the bundle and then room for its rows: decoding into that room is fine,
    decoding over the bundle's own bytes is refused before a row is written."""
    data, _ = _bundle(0)
    room = P * L * K * 2
    message = bytes(data) + bytes(-len(data) % 2) + bytes(room)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer on immutable bytes
        whole = torch.frombuffer(message, dtype=torch.int16)
    bundle = RankBundle(memoryview(message)[: len(data)], expected_rows=P)
    with pytest.raises(ConfigError, match="out= overlaps the bundle's own bytes"):
        bundle.to_torch(out=whole[: room // 2].view(SHAPE))
    assert message[: len(data)] == data
    after = whole[-room // 2 :].view(SHAPE)
    assert torch.equal(bundle.to_torch(out=after), torch.from_numpy(RankBundle(data).decode()))
