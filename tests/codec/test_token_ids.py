"""Token ids in the codec header (issue 11 item 21): carried, backward compatible, bounds-checked."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay import RouteTrace

# A blob written before token ids existed (routereplay 8f27145): 3 rows of layers (1, 3), start 2.
OLD_BLOB_HEX = (
    "5252544301000200030000000000000002000000020008000000020000000000000001000000030000000100000002000000000000000500"
    "000000000000ffffffffffffffff0700756e6b6e6f776e050000000000000005000000000000003b43b80b01e07caae8"
)


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_codec_carries_token_ids(mode: str) -> None:
    """Data loss (issue 11 item 21): the codec dropped nothing else, and now keeps the token ids too."""
    from routereplay.codec.blob import decode, encode, header_info

    trace = _trace(4, 6, [3, 1, -1, 2**31 - 1, 0, 7])
    blob = encode(trace, mode=mode)
    back = decode(blob)
    assert back.token_ids is not None and back.token_ids.tolist() == [3, 1, -1, 2**31 - 1, 0, 7]
    assert header_info(blob).has_token_ids
    plain = _trace(4, 6, None)
    assert decode(encode(plain, mode=mode)).token_ids is None and not header_info(encode(plain)).has_token_ids
    assert len(blob) == len(encode(plain, mode=mode)) + 4 * 6  # 4 bytes per token


def test_old_blobs_decode_without_token_ids() -> None:
    """Data loss (issue 11 item 21): the header change is backward compatible; a trace without ids
    still encodes to the very bytes the previous release wrote."""
    from routereplay.codec.blob import decode, encode

    old = bytes.fromhex(OLD_BLOB_HEX)
    trace = decode(old)
    assert trace.token_ids is None and trace.layers == (1, 3) and trace.start == 2
    assert trace.experts[1, 0].tolist() == [-1, -1] and trace.experts[2, 1].tolist() == [1, 6]
    assert encode(trace) == old


def test_truncated_token_ids_are_a_codec_error() -> None:
    """Error that is not a RouteReplayError (issue 11 item 21): a blob whose flag promises token ids it
    does not hold is refused by name, before any allocation."""
    import struct
    import zlib

    from routereplay.codec.blob import decode, encode
    from routereplay.errors import CodecError

    body = bytearray(encode(_trace(0, 3, None))[:-4])
    body[6] |= 4  # claim token ids: 12 more bytes the blob does not have
    with pytest.raises(CodecError, match="truncated blob"):
        decode(bytes(body) + struct.pack("<I", zlib.crc32(body)))


def _trace(start: int, rows: int, token_ids: list[int] | None, seed: int = 0) -> RouteTrace:
    generator = np.random.default_rng(seed)
    experts = np.stack([generator.permutation(8)[:2] for _ in range(rows * 2)]).reshape(rows, 2, 2)
    return RouteTrace(experts, 8, start=start, token_ids=token_ids)
