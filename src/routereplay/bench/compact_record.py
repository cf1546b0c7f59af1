"""What the batch-routes suites (`bench verl`, `bench skyrl`) report about routereplay's compact blobs.

Both measure a framework's forms of a batch's routes against one codec blob per sample, and close their
record and their table the same way: the set codec's bits per (token, layer) row, the encode / decode
time per sample (one core), and the table rows of the two compact modes. Legend: Q = the table of
route sets, K = top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def set_table(rng: np.random.Generator, experts: int, top_k: int) -> np.ndarray:
    """(Q, K) int16: 65,536 uniformly drawn top-k sets of `experts`, which a suite indexes at random."""
    keys = rng.random((1 << 16, experts), dtype=np.float32)
    return np.argpartition(keys, top_k, axis=1)[:, :top_k].astype(np.int16)


def compact_timings(experts: int, top_k: int, encode_s: float, decode_s: float, samples: int) -> dict[str, Any]:
    """The record's tail: set bits per row, encode / decode ms per sample over `samples`, no targets."""
    from routereplay.codec import bits_per_row

    return {
        "set_bits_per_row": bits_per_row(experts, top_k, "set"),
        "encode_ms_per_sample": 1e3 * encode_s / samples,
        "decode_ms_per_sample": 1e3 * decode_s / samples,
        "targets": {},
    }


def compact_rows(result: dict[str, Any]) -> list[str]:
    """The table rows of the set-mode and ordered-mode blobs, bytes per sample from `result`."""
    sizes = result["bytes_per_sample"]
    return [
        f"| routereplay compact blob, set mode ({result['set_bits_per_row']} bits per row; the default) | "
        f"{sizes['routereplay_compact_set']:,.0f} |",
        f"| routereplay compact blob, ordered mode | {sizes['routereplay_compact_ordered']:,.0f} |",
    ]


__all__ = ["compact_rows", "compact_timings", "set_table"]
