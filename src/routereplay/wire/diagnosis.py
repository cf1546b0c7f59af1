"""Diagnosis of flat route payloads, whose (layers, top_k) split is the caller's guess.

SGLang sends routes as raw flattened integers with no shape header; the decoder splits them with
the caller's `num_layers` and `top_k`. A wrong pair fails in misleading ways: a wrong top-k changes
the row count (which looks like "routes of another sequence"), and a pair with the same product
(24 x 16 for 48 x 8) splits every row across two layers (which looks like zero padding). These
helpers list the splits the ids actually fit, so the error names the argument to fix.

Legend: T = rows, L = layers, K = top-k, E = experts, N = ids in the payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from routereplay.wire.limits import WireLimits

MAX_CHECKED_SPLITS = 16  # splits tried for a clean fit on an error path (each costs one sort of N ids)


@dataclass(frozen=True, slots=True)
class Split:
    """One way to read a flat row of L*K ids: `num_layers` lists of `top_k` ids."""

    num_layers: int
    top_k: int

    def describe(self) -> str:
        return f"num_layers={self.num_layers}, top_k={self.top_k}"


def splits_of(width: int, limits: WireLimits) -> list[Split]:
    """Every (L, K) with L * K == width within the limits, widest top-k first."""
    return [
        Split(width // k, k)
        for k in range(min(width, limits.max_top_k), 0, -1)
        if width % k == 0 and width // k <= limits.max_layers
    ]


def fits_cleanly(ids_N: np.ndarray, rows: int, split: Split, num_experts: int) -> bool:
    """Whether the ids read as (rows, L, K) pass the content catalogue's row checks.

    Ids in [-1, E), no row mixing -1 with ids, no id twice in a routed row, at least one routed row
    that is not all zeros (an all-zero payload fits every split and proves nothing).
    """
    if ids_N.size != rows * split.num_layers * split.top_k or ids_N.size == 0:
        return False
    if int(ids_N.min()) < -1 or int(ids_N.max()) >= num_experts:
        return False
    rows_RK = np.sort(ids_N.reshape(-1, split.top_k), axis=1)
    # -1 rows (no route) and all-zero rows (dense layers of an all-layer payload) say nothing
    skipped_R = (rows_RK[:, -1] == -1) | ((rows_RK[:, 0] == 0) & (rows_RK[:, -1] == 0))
    if skipped_R.all() or ((rows_RK[:, 0] == -1) & ~skipped_R).any():
        return False
    repeated_R = (rows_RK[:, 1:] == rows_RK[:, :-1]).any(axis=1)
    return not (repeated_R & ~skipped_R).any()


def split_hint_for_rows(num_ids: int, expected_rows: int, given: Split, limits: WireLimits) -> tuple[Split, ...]:
    """Splits under which `num_ids` ids make exactly `expected_rows` rows.

    Only those that keep the given num_layers (a wrong top_k) or the given top_k (a wrong
    num_layers) are returned when any exist: one argument wrong is the likely mistake.
    """
    if expected_rows <= 0 or num_ids % expected_rows:
        return ()
    width = num_ids // expected_rows
    if width == given.num_layers * given.top_k:
        return ()
    found = splits_of(width, limits)
    same_layers = [s for s in found if s.num_layers == given.num_layers]
    same_top_k = [s for s in found if s.top_k == given.top_k]
    return tuple(same_layers + same_top_k) or tuple(found)


def clean_alternatives(
    ids_N: np.ndarray, rows: int, given: Split, num_experts: int, limits: WireLimits
) -> tuple[Split, ...]:
    """Other splits of the same row width under which the ids pass the row checks, widest first.

    A divisor of the true top-k always reads cleanly (its rows are subsets of true rows), while a
    split wider than the true one merges two layers' routes and repeats ids: the widest clean split
    is the likely truth. Top-1 splits (which can never repeat an id) are left out.
    """
    width = given.num_layers * given.top_k
    candidates = [s for s in splits_of(width, limits) if s != given and s.top_k > 1][:MAX_CHECKED_SPLITS]
    return tuple(s for s in candidates if fits_cleanly(ids_N, rows, s, num_experts))


def describe(splits: tuple[Split, ...], limit: int = 4) -> str:
    """'num_layers=48, top_k=8; or num_layers=96, top_k=4 (and 3 more)'."""
    text = "; or ".join(s.describe() for s in splits[:limit])
    return text + (f" (and {len(splits) - limit} more)" if len(splits) > limit else "")


__all__ = [
    "MAX_CHECKED_SPLITS",
    "Split",
    "clean_alternatives",
    "describe",
    "fits_cleanly",
    "split_hint_for_rows",
    "splits_of",
]
