"""What the batch-routes suites (`bench verl`, `bench skyrl`) share about routereplay's compact blobs.

Both draw a batch of samples of drawn lengths (`BatchRoutesBenchConfig`), measure a framework's forms of
the batch's routes against one codec blob per sample, and close their record and their table the same
way: the set codec's bits per (token, layer) row, the encode / decode time per sample (one core), and
the table rows of the two compact modes. Legend: Q = the table of route sets, K = top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.bench.config import RoutedBenchConfig, require_positive, require_routing
from routereplay.trace.route_trace import RouteTrace


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRoutesBenchConfig(RoutedBenchConfig):
    """A batch of `samples` samples of `min_tokens` to `max_tokens` tokens, measured in one pass."""

    repeats: int = 1  # one pass over the batch
    samples: int = 64
    min_tokens: int = 1024
    max_tokens: int = 8192

    def check_batch(self, suite: str, *sizes: str) -> None:
        """Refuse a routing no MoE layer has, or a size below 1 among `samples` and `sizes`."""
        require_routing(self, suite)
        require_positive(self, suite, "samples", *sizes)


def set_table(rng: np.random.Generator, experts: int, top_k: int) -> np.ndarray:
    """(Q, K) int16: 65,536 uniformly drawn top-k sets of `experts`, which a suite indexes at random."""
    keys = rng.random((1 << 16, experts), dtype=np.float32)
    return np.argpartition(keys, top_k, axis=1)[:, :top_k].astype(np.int16)


@dataclass(slots=True)
class CompactTally:
    """The compact blobs of a batch, one sample at a time: bytes in both modes, set-mode encode / decode time."""

    set_bytes: int = 0
    ordered_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    def add(self, trace: RouteTrace) -> None:
        """Encode `trace` in set mode (timed) and decode it (timed), and encode it in ordered mode."""
        from routereplay.codec import decode, encode

        began = time.perf_counter()
        blob = encode(trace)
        self.encode_s += time.perf_counter() - began
        began = time.perf_counter()
        decode(blob)
        self.decode_s += time.perf_counter() - began
        self.set_bytes += len(blob)
        self.ordered_bytes += len(encode(trace, mode="ordered"))

    def timings(self, experts: int, top_k: int, samples: int) -> dict[str, Any]:
        """The record's tail: set bits per row, encode / decode ms per sample over `samples`, no targets."""
        from routereplay.codec import bits_per_row

        return {
            "set_bits_per_row": bits_per_row(experts, top_k, "set"),
            "encode_ms_per_sample": 1e3 * self.encode_s / samples,
            "decode_ms_per_sample": 1e3 * self.decode_s / samples,
            "targets": {},
        }


def table_head(result: dict[str, Any], suite: str, sample: str, samples: str, setting: str) -> list[str]:
    """The lines above the table: machine, batch (`sample` / `samples` name one / several samples, `setting`
    ends the sentence with the suite's own facts) and the table's header."""
    from routereplay.bench.environment import measured_on

    c = result["config"]
    return [
        measured_on(result["machine"], suite, "torch")
        + f". {c['samples']} {samples} of {c['min_tokens']}-{c['max_tokens']} tokens (mean "
        f"{result['mean_tokens']:,.0f}), {c['layers']} MoE layers, top-{c['top_k']} of {c['experts']}, {setting}.",
        "",
        f"| form of a {sample}'s routes | bytes per sample |",
        "|---|---:|",
    ]


def timing_text(result: dict[str, Any]) -> str:
    """'encode <ms> ms and decode <ms> ms per sample' from the record's tail."""
    encode_ms, decode_ms = result["encode_ms_per_sample"], result["decode_ms_per_sample"]
    return f"encode {encode_ms:.1f} ms and decode {decode_ms:.1f} ms per sample"


def compact_rows(result: dict[str, Any]) -> list[str]:
    """The table rows of the set-mode and ordered-mode blobs, bytes per sample from `result`."""
    sizes = result["bytes_per_sample"]
    return [
        f"| routereplay compact blob, set mode ({result['set_bits_per_row']} bits per row; the default) | "
        f"{sizes['routereplay_compact_set']:,.0f} |",
        f"| routereplay compact blob, ordered mode | {sizes['routereplay_compact_ordered']:,.0f} |",
    ]


__all__ = ["BatchRoutesBenchConfig", "CompactTally", "compact_rows", "set_table", "table_head", "timing_text"]
