"""Which encoded rows each rank needs, and the bundles that carry exactly those.

A rank's layout plan (`routereplay.layout.plan`: pack, SP/CP/TP shard, ... run on `token_index(B, S)`)
names, for each of its P rows, the source token it holds: flat index b * S + s of row b (a sample) and
position s, or -1 for padding. `spans_of` turns that into runs of consecutive positions of one sample
(one run per sample for a packed + Ulysses shard, two for CP zigzag); `bundles_for` cuts each run from
the store's encoded routes without decoding and packs one `RankBundle` per rank. A rank's bundle holds
its rows and nothing else: its DP share, then its CP/SP/PP slice.

A plan is an integer tensor or array (any shape, read flat) of -1 or flat indices below 2**62, and
`positions` an int in [1, 2**62]; anything else (a float plan would be truncated to other tokens,
NaN read as padding) is a `ConfigError` or `BatchShapeError` naming the rank, before any cut is made.

Legend: P = rows of one rank's layout, B = samples of the source batch, S = positions per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from routereplay.codec.encoded import EncodedRoutes
from routereplay.errors import BatchShapeError, ConfigError
from routereplay.transport.bundle import Placed, pack_bundle

if TYPE_CHECKING:
    from routereplay.store.route_store import RouteStore
    from routereplay.store.sample import SampleId


@dataclass(frozen=True, slots=True)
class Span:
    """Layout rows [dest, dest + end - begin) hold positions [begin, end) of source sample `sample`."""

    dest: int
    sample: int
    begin: int
    end: int


MAX_INDEX = 1 << 62  # flat b * S + s stays far inside int64 (and positions with it)


def spans_of(index_P: torch.Tensor | np.ndarray, positions: int) -> list[Span]:
    """Runs of consecutive positions of one sample in a rank's plan (flat b * positions + s, -1 = none)."""
    _check_positions(positions)
    return _runs(plan_index(index_P), int(positions))


def plan_index(plan: object, where: str = "the plan") -> np.ndarray:
    """`plan` read flat as int64 (P,), checked: an integer tensor or array of -1 or flat indices < 2**62."""
    if isinstance(plan, torch.Tensor):
        if plan.is_floating_point() or plan.is_complex() or plan.dtype == torch.bool:
            raise ConfigError(
                f"{where} is a {plan.dtype} tensor; a plan names token rows by integer index (-1 = padding), e.g. "
                "routereplay.layout.plan.token_index(B, S) put through the layout: pass an integer tensor"
            )
        plan = plan.detach().cpu().numpy()
    array = np.asarray(plan) if isinstance(plan, (np.ndarray, list, tuple)) else None
    if array is None or array.dtype.kind not in "iu":
        kind = f"a {array.dtype} array" if array is not None else type(plan).__name__
        raise ConfigError(
            f"{where} is {kind}; a plan is an integer tensor or array of flat token indices b * positions + s "
            "(-1 = padding), e.g. routereplay.layout.plan.token_index(B, S) put through the layout"
        )
    flat = array.reshape(-1)
    if flat.size and (int(flat.max()) >= MAX_INDEX or int(flat.min()) < -1):
        bad = int(flat.max()) if int(flat.max()) >= MAX_INDEX else int(flat.min())
        raise BatchShapeError(
            f"{where} names token {bad}: a plan holds flat indices b * positions + s in [0, 2**62) or -1 (padding, "
            "the one marker for no token); rebuild it from routereplay.layout.plan.token_index"
        )
    return flat.astype(np.int64)


def _sample_list(sample_ids: object) -> list[SampleId]:
    """`sample_ids` as a list (a list, tuple or 1-d array of the store's sample ids, row b = sample b)."""
    if isinstance(sample_ids, np.ndarray) and sample_ids.ndim == 1:
        return list(sample_ids.tolist())
    if not isinstance(sample_ids, Sequence) or isinstance(sample_ids, (str, bytes)):
        raise ConfigError(
            f"sample_ids must list the batch's samples in row order (a list of the ids given to the store's "
            f"add_turn), got {type(sample_ids).__name__}"
        )
    return list(sample_ids)


def _check_positions(positions: object) -> None:
    if not isinstance(positions, (int, np.integer)) or isinstance(positions, (bool, np.bool_)):
        raise ConfigError(f"positions={positions!r} must be the padded batch's positions per row (an int S >= 1)")
    if not 1 <= positions <= MAX_INDEX:
        raise ConfigError(f"positions={positions!r} must be the padded batch's positions per row, in [1, 2**62]")


def _runs(index: np.ndarray, positions: int) -> list[Span]:
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
    _check_positions(positions)
    if not isinstance(plans, Sequence) or isinstance(plans, (str, bytes)):
        raise ConfigError(f"plans must be a list with one plan per rank, got {type(plans).__name__}")
    indices = [plan_index(plan, f"rank {rank}'s plan") for rank, plan in enumerate(plans)]  # all, before any cut
    if not callable(getattr(store, "encoded", None)):
        raise ConfigError(f"store must be the RouteStore that holds the batch's routes, got {type(store).__name__}")
    pieces = [store.encoded(sample_id) for sample_id in _sample_list(sample_ids)]
    like = next((p[0] for p in pieces if p), None)
    if like is None:
        raise ConfigError("no sample of this batch has routes yet; add_turn routes before delivering them")
    bundles = []
    for rank, index in enumerate(indices):
        placed: list[Placed] = []
        for span in _runs(index, int(positions)):
            if span.sample >= len(pieces):
                raise BatchShapeError(
                    f"rank {rank}'s plan names batch row {span.sample}, but the batch has {len(pieces)} samples"
                )
            placed += placed_spans(pieces[span.sample], span)
        bundles.append(pack_bundle(index.size, placed, like))
    return bundles


__all__ = ["MAX_INDEX", "Span", "bundles_for", "placed_spans", "plan_index", "spans_of"]
