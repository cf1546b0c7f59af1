"""Threshold replay: force an engine's row only where the trainer's own router nearly agrees with it.

`replay(..., threshold=margin)` (prime-rl #2703). The score is the router's *selection score*: the
tensor its selection `torch.topk` sees (softmax probabilities for Qwen3-MoE / Mixtral, sigmoid plus
selection bias for DeepSeek-V3, ...). For each (token, layer) row, with `kth` the smallest score of
the live top-k (its K-th score), the forced row is kept when every forced id's score is at least
`kth - margin`; otherwise the whole row takes the live choice (row, not slot: a row is a set of K
distinct experts, and mixing slots of two sets could name an expert twice). `margin = 0` keeps only
rows tied with or equal to the live top-k; a large margin keeps every row (plain replay, counted).
-1 rows are fallback rows (live), never counted as replaced.

Counted per call in `RouterSlot.replaced_T` (a bool per token) and folded on the host into
`ReplayStats.replaced_rows` / `replaced_rows_by_layer` (attended positions only) and
`ReplayStats.replace_rate` = replaced / replayed rows. On the CPU that fold reads each call's rows at once;
in a sync-free context (routers on a GPU, `runtime/transfer.py`) each call's count stays on the device and
all are read in one copy when the context closes, so the step itself never waits for the device (the
counts appear in `stats` after the exit). Off, threshold replay costs nothing (bit-identical to plain replay).

Legend: T = tokens in one router call, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from routereplay.errors import ConfigError
from routereplay.runtime.discovery import RouterSite, Selection
from routereplay.runtime.tensor_forms import finite_number


def check_margin(margin: object) -> float | None:
    """`margin` as a float (None: threshold off), or `ConfigError` when it is not a real number whose value is a
    finite float >= 0 (Python or numpy scalars; bools, strings, tensors, NaN, inf, ints beyond float refused)."""
    if margin is None:
        return None
    wanted = (
        "a finite margin >= 0 on the router's selection score (what its torch.topk sees), or None to force every row"
    )
    value = finite_number(margin, "threshold", wanted)
    if value < 0:
        raise ConfigError(f"threshold={margin!r}: give {wanted}")
    return abs(value)  # -0.0 is 0


def refuse_threshold(sites: Sequence[RouterSite]) -> None:
    """`ConfigError` naming the routers threshold replay cannot serve: PhiMoE's sparsemixer (two `max` picks,
    no top-k whose K-th score bounds the margin) and modality routers (each call sees one modality's tokens)."""
    refused = [
        f"layer {s.layer} ({s.family})" for s in sites if s.selection is Selection.SPARSEMIXER or s.modality is not None
    ]
    if refused:
        raise ConfigError(
            f"threshold replay needs a router selecting by one top-k over all its tokens; not so for {refused[:4]}: "
            "replay without threshold="
        )


def thresholded(
    forced_TK: torch.Tensor,
    live_TK: torch.Tensor,
    live_values_TK: torch.Tensor,
    forced_values_TK: torch.Tensor,
    margin: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, replaced_T): each forced row, or the live row where a forced score is below kth - margin.

    `live_values_TK` are the live top-k's scores, `forced_values_TK` the scores at the forced ids
    (any value on -1 rows: those rows are kept as -1, for the fallback to decide)."""
    kth_T1 = live_values_TK.min(dim=-1, keepdim=True).values
    out_T = (forced_values_TK < kth_T1 - margin).any(dim=-1) & (forced_TK[:, 0] >= 0)
    return torch.where(out_T[:, None], live_TK, forced_TK), out_T


def replaced_count(replaced_T: torch.Tensor, attended_T: np.ndarray | None) -> int:
    """Rows of one call a threshold gave back to the live router, attended positions only (a host read)."""
    replaced = replaced_T.detach().cpu().numpy()
    if attended_T is not None and attended_T.size == replaced.size:
        replaced = replaced & attended_T
    return int(np.count_nonzero(replaced))


__all__ = ["check_margin", "refuse_threshold", "replaced_count", "thresholded"]
