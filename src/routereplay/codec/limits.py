"""Bounds of `routereplay.codec.decode`: what a blob may ask for, checked before anything is allocated.

A codec blob declares its own shape, and some layouts need few or no payload bits per row (a -1
row costs one bitmap bit; set mode with K = E and ordered mode with E = 1 cost none; zstd shrinks
repetitive bytes up to 32768x). So a blob of a few bytes can honestly declare gigabytes of ids.
`CodecLimits` bounds the output and the work before any of it is done:

- `max_entries` caps T * L * K (and T): the decoded ids. The default, 2**28, holds a 256k-token x
  128-layer x top-8 trace (a 128k x 96 x 8 trace is 1.0e8 ids): 512 MiB of int16 ids, 1 GiB of
  int32 ids when E > 32767.
- `max_expansion` caps the decoded bytes per byte of blob (default 4096). Real routes cost
  log2 C(E, K) bits per routed row, so an uncompressed blob expands at most 8 * K * itemsize times
  (a trace of only -1 rows: 128x for top-8 int16). Above 4096x sit only degenerate or forged
  blobs: zero-bit layouts (K = E, or E = 1) and zstd-compressed traces of almost only -1 rows.
  This is what stops a 100-byte blob from becoming hundreds of MiB.
- `max_set_table` caps the set-mode binomial table in 8-byte words (default 2**20, 8 MiB):
  (E + 1) * (K + 1) entries of one word when C(E, K) < 2**64, of 6 + ceil(bits / 64) words (exact
  Python ints) above. The table, and the CPU spent building and searching it, stays bounded however
  large E and K are declared: E = K = 1000 fits, E = K = 2000 (4.0e6 entries) and E = 70000, K = 8
  do not (use ordered mode, or raise the limit). Real models (E <= 512, K <= 16) need under 2e4
  words; E = 1024, K = 32 (ranks of 4 words) needs 3.4e5.
- `chunk_entries` is not a refusal but the step of the decoder: ids are unpacked, checked and
  unranked max(chunk_entries, K) at a time (default 2**18) and written into the output array, so
  the working set stays a fixed few MiB instead of several uint64 copies of the whole payload.

With these limits, `decode` of an n-byte blob allocates at most the output (T * L * K * itemsize
<= min(max_entries * itemsize, max_expansion * n)), plus the decompressed payload for zstd blobs
(never more than the output: a row's bitmap bit and payload bits never exceed its ids' bits), plus
a working set of at most `WORKING_BYTES_PER_ENTRY * max(chunk_entries, K)` bytes (16 MiB by default),
plus the binomial table (`TABLE_PEAK_FACTOR * 8 * max_set_table` bytes, 24 MiB, at most), its column
searches (`SEARCH_BUDGET_BYTES`, 8 MiB) and, for set-mode blobs of many rows, the table of the lowest
ids (`LOW_TABLE_BUDGET_BYTES`, 4 MiB, at most twice that while it is built; see `routereplay.codec.subsets`).
`CodecLimits.memory_bound(n)` adds these up; the fuzz tests check every input against it.
The CPU work is linear in the same quantities: after the O(n) envelope checks, about 2 ns per
decoded ordered id and 30 ns per set-mode row of ranks below 2**64 (E = 128, K = 8: 4 ns an id),
about 250 ns per id for exact Python-int ranks (C(E, K) >= 2**64, e.g. E = 512, K = 10), and at
most ~0.2 s for the largest default table (E = 1000, K = 999); measured on one core of a 2-core x86
machine, for scale only (no test times anything). A 128k x 96 x 8 trace (E = 128, 61.5 MiB blob)
decodes in 0.34 s with a peak of 196 MiB for its 192 MiB of ids.
Legend: T = rows (tokens), L = layers, K = top-k, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.codec.subsets import LOW_TABLE_BUDGET_BYTES, SEARCH_BUDGET_BYTES
from routereplay.errors import CodecLimitError, ConfigError

DEFAULT_MAX_ENTRIES = 1 << 28  # T * L * K ids: 512 MiB int16 / 1 GiB int32; 256k x 128 x 8 fits
DEFAULT_MAX_EXPANSION = 1 << 12  # decoded bytes per blob byte; uncompressed real traces stay <= 8 * K * itemsize
DEFAULT_MAX_SET_TABLE = 1 << 20  # set-mode binomial table words: 8 MiB; real models need < 2e4
DEFAULT_CHUNK_ENTRIES = 1 << 18  # ids decoded per step: bounds the working set
MIN_CHUNK_ENTRIES = 1 << 10
MAX_TOP_K = (1 << 16) - 1  # the header's u16: one decode step holds at least one row of K ids
WORKING_BYTES_PER_ENTRY = 64  # working set of one decode step per id of `chunk_entries` (measured <= 25)
TABLE_PEAK_FACTOR = 3  # building the table and its searches peaks below 3x the table's words


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecLimits:
    """Bounds `decode` checks against a blob's header before allocating (see the module docstring).

    Raise a bound for a trusted blob: `decode(blob, limits=CodecLimits(max_entries=1 << 30))`.
    """

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_expansion: int = DEFAULT_MAX_EXPANSION
    max_set_table: int = DEFAULT_MAX_SET_TABLE
    chunk_entries: int = DEFAULT_CHUNK_ENTRIES

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_entries", 0),
            ("max_expansion", 1),
            ("max_set_table", 1),
            ("chunk_entries", MIN_CHUNK_ENTRIES),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
                raise ConfigError(f"CodecLimits.{name} must be an int >= {minimum}, got {type(value).__name__}")
            if value < minimum:
                raise ConfigError(f"CodecLimits.{name}={value} must be >= {minimum}")
            object.__setattr__(self, name, int(value))

    def memory_bound(self, blob_bytes: int) -> int:
        """Most bytes `decode` allocates for a blob of `blob_bytes` bytes (what the fuzz tests check).

        Output ids (<= min(4 * max_entries, max_expansion * n)) + the zstd payload (<= the output) +
        the set-mode table (TABLE_PEAK_FACTOR * 8 * max_set_table), its searches (SEARCH_BUDGET_BYTES)
        and low-id table (2 * LOW_TABLE_BUDGET_BYTES while built) + one step's working set
        (max(chunk_entries, K) ids) + header
        objects (layer numbers, segments: < 64 bytes per blob byte) + the 1 MiB zstd inflate buffer.
        """
        output = min(4 * self.max_entries, self.max_expansion * blob_bytes)
        return (
            2 * output
            + TABLE_PEAK_FACTOR * 8 * self.max_set_table
            + SEARCH_BUDGET_BYTES
            + 2 * LOW_TABLE_BUDGET_BYTES
            + WORKING_BYTES_PER_ENTRY * max(self.chunk_entries, MAX_TOP_K)
            + 64 * blob_bytes
            + (2 << 20)
        )

    def check_shape(self, num_tokens: int, num_layers: int, top_k: int, itemsize: int, blob_bytes: int) -> None:
        """Refuse a declared (T, L, K) whose ids exceed `max_entries` or `max_expansion` x the blob."""
        entries = num_tokens * num_layers * top_k
        shape = f"{num_tokens} x {num_layers} x {top_k}"
        if entries > self.max_entries or num_tokens > self.max_entries:
            raise CodecLimitError(
                f"blob declares {shape} = {entries} expert ids, above CodecLimits.max_entries="
                f"{self.max_entries}; refused before allocating. If the blob is trusted, pass "
                "decode(blob, limits=CodecLimits(max_entries=...))"
            )
        output = entries * itemsize
        if output > self.max_expansion * blob_bytes:
            raise CodecLimitError(
                f"blob of {blob_bytes} bytes declares {shape} ids ({output} bytes decoded, "
                f"{output // max(blob_bytes, 1)}x its size), above CodecLimits.max_expansion="
                f"{self.max_expansion}x; refused before allocating. Only a forged blob, a zero-bit layout "
                "(top_k == num_experts, or one expert) or a zstd-compressed trace of almost only -1 rows "
                "expands this much: if the blob is trusted, pass decode(blob, limits=CodecLimits("
                "max_expansion=...)), or re-encode it without compress=True"
            )

    def check_set_table(self, num_experts: int, top_k: int, words_per_entry: int, what: str) -> None:
        """Refuse a set-mode layout whose binomial table exceeds `max_set_table` words."""
        size = (num_experts + 1) * (top_k + 1) * words_per_entry
        if size > self.max_set_table:
            raise CodecLimitError(
                f"{what}: set mode with E={num_experts}, K={top_k} needs a binomial table of {size} words, "
                f"above CodecLimits.max_set_table={self.max_set_table}; encode such traces with "
                "mode='ordered', or pass decode(blob, limits=CodecLimits(max_set_table=...)) for a trusted blob"
            )


DEFAULT_LIMITS = CodecLimits()


def checked_limits(limits: Any) -> CodecLimits:
    """`limits` itself, `DEFAULT_LIMITS` for None, or a ConfigError for anything else."""
    if limits is None:
        return DEFAULT_LIMITS
    if not isinstance(limits, CodecLimits):
        raise ConfigError(
            f"limits must be a routereplay.codec.CodecLimits or None, got {type(limits).__name__}; "
            "e.g. limits=CodecLimits(max_entries=1 << 30)"
        )
    return limits


__all__ = [
    "DEFAULT_CHUNK_ENTRIES",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_EXPANSION",
    "DEFAULT_MAX_SET_TABLE",
    "CodecLimits",
    "checked_limits",
]
