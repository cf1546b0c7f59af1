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

import numpy as np

from routereplay.store_sample import Sample
from routereplay.trace import UNROUTED_SOURCE


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
        trace = sample.trace
        for segment in () if trace is None else trace.segments:
            by_source[str(segment.source)] += segment.end - segment.begin
        by_source[UNROUTED_SOURCE] += len(sample.tokens) - 1 - (0 if trace is None else trace.num_tokens)
    tokens = sum(len(sample.tokens) for sample in samples)
    rows = tokens - len(samples)
    routed = sum(sample.trace.num_routed for sample in samples if sample.trace is not None)
    conflicts = sum(sample.conflicting_rows for sample in samples)
    sources = {name: count for name, count in by_source.items() if count}
    return StoreStats(len(samples), tokens, rows, routed, rows - routed, conflicts, sources)


def stale_fraction_of(samples: Iterable[Sample], current_version: int) -> float:
    """Routed rows made under a policy version older than `current_version` (or unknown), as a fraction."""
    stale = routed = 0
    for trace in (sample.trace for sample in samples if sample.trace is not None):
        cumulative = np.concatenate([[0], np.cumsum(trace.routed_mask.all(axis=1))])
        for segment in trace.segments:
            count = int(cumulative[segment.end - trace.start] - cumulative[segment.begin - trace.start])
            routed += count
            if segment.policy_version is None or segment.policy_version < current_version:
                stale += count
    return stale / routed if routed else 0.0
