"""Canonical indexer choices for the tests: random rows, with unknown rows and a start offset; the blob of an
all-implicit trace, built without its dense form."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from routereplay.indexer.blob import MAGIC, VERSION

_FIXED = struct.Struct("<4sBBHQIIQI")  # magic, version, flags, reserved, T, L, I, start, B


def random_choices(
    num_tokens: int, num_layers: int, index_topk: int, *, start: int = 0, unknown: float = 0.0, seed: int = 0
) -> np.ndarray:
    """A canonical (T, L, I) int32 array: each row picks min(I, p + 1) distinct keys of 0..p, sorted."""
    rng = np.random.default_rng(seed)
    out_TLI = np.full((num_tokens, num_layers, index_topk), -1, np.int32)
    for t in range(num_tokens):
        visible = start + t + 1
        for layer in range(num_layers):
            if rng.random() < unknown:
                continue
            count = min(index_topk, visible)
            out_TLI[t, layer, :count] = np.sort(rng.choice(visible, count, replace=False))
    return out_TLI


def implicit_blob(num_tokens: int, num_layers: int, index_topk: int, start: int = 0) -> bytes:
    """The blob of a trace whose every row is implicit (start + T <= I): header, layer numbers, CRC32 - exactly
    what `encode` writes for one, built without its dense form."""
    assert start + num_tokens <= index_topk, "every row must see at most index_topk keys"
    body = _FIXED.pack(MAGIC, VERSION, 0, 0, num_tokens, num_layers, index_topk, start, 128)
    body += np.arange(num_layers, dtype="<u4").tobytes()
    return body + struct.pack("<I", zlib.crc32(body))
