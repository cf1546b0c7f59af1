"""Which encoded rows each rank needs, and the bundles that carry exactly those.

A rank's layout plan (`routereplay.layout.plan`: pack, SP/CP/TP shard, ... run on `token_index(B, S)`)
names, for each of its P rows, the source token it holds: flat index b * S + s of row b (a sample) and
position s, or -1 for padding. `spans_of` turns that into runs of consecutive positions of one sample
(one run per sample for a packed + Ulysses shard, two for CP zigzag); `bundles_for` cuts each run from
the store's encoded routes without decoding and packs one `RankBundle` per rank. A rank's bundle holds
its rows and nothing else: its DP share, then its CP/SP/PP slice.

Legend: P = rows of one rank's layout, B = samples of the source batch, S = positions per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from routereplay.compact.bundle import Placed, pack_bundle
from routereplay.compact.encoded import EncodedRoutes
from routereplay.errors import BatchShapeError, ConfigError

if TYPE_CHECKING:
    from routereplay.store import RouteStore, SampleId


@dataclass(frozen=True, slots=True)
class Span:
    """Layout rows [dest, dest + end - begin) hold positions [begin, end) of source sample `sample`."""

    dest: int
    sample: int
    begin: int
    end: int


def spans_of(index_P: torch.Tensor | np.ndarray, positions: int) -> list[Span]:
    """Runs of consecutive positions of one sample in a rank's plan (flat b * positions + s, -1 = none)."""
    if not isinstance(positions, int) or positions < 1:
        raise ConfigError(f"positions={positions!r} must be the padded batch's positions per row (S >= 1)")
    index = torch.as_tensor(index_P).reshape(-1).to(torch.int64).numpy()
    if index.size and int(index.max()) >= 2**62:
        raise BatchShapeError(f"the plan names token {int(index.max())}: not a token of a (B, {positions}) batch")
    valid = index >= 0
    sample, position = index // positions, index % positions
    starts = valid.copy()
    starts[1:] &= ~(valid[:-1] & (sample[1:] == sample[:-1]) & (position[1:] == position[:-1] + 1))
    first = np.flatnonzero(starts)
    stops = np.flatnonzero(valid & np.append(starts[1:] | ~valid[1:], True)) + 1  # the row after each run
    return [
        Span(int(d), int(sample[d]), int(position[d]), int(position[d]) + int(e - d))
        for d, e in zip(first, stops, strict=True)
    ]


def placed_spans(routes: Sequence[EncodedRoutes], span: Span) -> list[Placed]:
    """The encoded cuts of `span` from a sample's pieces (sorted, disjoint); rows no piece holds stay -1."""
    placed = []
    for piece in routes:
        begin, end = max(span.begin, piece.start), min(span.end, piece.stop)
        if begin < end:
            placed.append(Placed(span.dest + begin - span.begin, piece.span(begin, end)))
    return placed


def bundles_for(
    store: RouteStore, sample_ids: Sequence[SampleId], plans: Sequence[torch.Tensor | np.ndarray], positions: int
) -> list[bytes]:
    """One `RankBundle` per plan: rank r's rows `plans[r]` over the batch of `sample_ids` (row b = sample
    `sample_ids[b]`) padded to `positions`. Only the rows each plan names are cut; nothing is decoded."""
    pieces = [store.encoded(sample_id) for sample_id in sample_ids]
    like = next((p[0] for p in pieces if p), None)
    if like is None:
        raise ConfigError("no sample of this batch has routes yet; add_turn routes before delivering them")
    bundles = []
    for rank, plan in enumerate(plans):
        placed: list[Placed] = []
        rows = int(torch.as_tensor(plan).numel())
        for span in spans_of(plan, positions):
            if span.sample >= len(pieces):
                raise BatchShapeError(
                    f"rank {rank}'s plan names batch row {span.sample}, but the batch has {len(pieces)} samples"
                )
            placed += placed_spans(pieces[span.sample], span)
        bundles.append(pack_bundle(rows, placed, like))
    return bundles


__all__ = ["Span", "bundles_for", "placed_spans", "spans_of"]
