"""What a `RouteStore` reports about its samples: row counts by source, and how stale the routes are.

A row is one token position of a sample (its last token has none). `summarise` counts rows, routed
rows (ids in every layer), fallback rows (-1 in some layer), conflicting re-sent rows and rows per
source (`UNROUTED_SOURCE` for positions no engine call routed); `stale_fraction_of` is the share of
routed rows produced under an older policy version (or an unknown one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from routereplay.store.sample import Sample
from routereplay.trace.provenance import UNROUTED_SOURCE


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts over the assembled traces. A row is one token position; `routed_rows` have ids in every
    layer, `fallback_rows` have -1 in some layer (the live router decides there)."""

    samples: int
    tokens: int
    rows: int
    routed_rows: int
    fallback_rows: int
    conflicting_rows: int  # re-sent rows whose routes disagreed with the stored ones (as sets)
    rows_by_source: dict[str, int]


def summarise(samples: Collection[Sample]) -> StoreStats:
    """The counts of `RouteStore.stats` over `samples`."""
    by_source: Counter[str] = Counter()
    for sample in samples:
        pieces = sample.routes.pieces
        for segment in (segment for piece in pieces for segment in piece.segments):
            by_source[str(segment.source)] += segment.end - segment.begin
        by_source[UNROUTED_SOURCE] += len(sample.tokens) - 1 - sum(piece.num_tokens for piece in pieces)
    tokens = sum(len(sample.tokens) for sample in samples)
    rows = tokens - len(samples)
    routed = sum(piece.routed_tokens for sample in samples for piece in sample.routes.pieces)
    conflicts = sum(sample.conflicting_rows for sample in samples)
    sources = {name: count for name, count in by_source.items() if count}
    return StoreStats(len(samples), tokens, rows, routed, rows - routed, conflicts, sources)


def stale_fraction_of(samples: Iterable[Sample], current_version: int) -> float:
    """Routed rows made under a policy version older than `current_version` (or unknown), as a fraction."""
    stale = routed = 0
    for piece in (piece for sample in samples for piece in sample.routes.pieces):
        for segment, count in zip(piece.segments, piece.routed_by_segment, strict=True):
            routed += count
            if segment.policy_version is None or segment.policy_version < current_version:
                stale += count
    return stale / routed if routed else 0.0
