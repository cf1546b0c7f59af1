"""Routing disagreement in replay: forced rows the trainer's own router would have routed elsewhere.

`replay(..., count_disagreement=True)` (the default: `Replayer.count_disagreement`) compares, in every
forward router call, each replayed row (a forced route on an attended position; -1 fallback rows and
padding are not compared) with the trainer's *live* choice for that token: the top-k its router computes
from the same scores, the one it would have used without replay. A row disagrees when the two SETS of
K experts differ (order never counts: `order="set"` and `order="engine"` count the same rows). Counted
into `ReplayStats` (`runtime/session.py`):

- `compared_rows` (`_by_layer`): rows compared, the replayed rows of every counted layer;
- `disagree_rows` (`_by_layer`), `disagree_rate`: compared rows whose engine set differs from the live set;
- `forced_disagree_rows` (`_by_layer`): the disagreeing rows replay still forced. Threshold replay
  (`runtime/threshold.py`) gives some disagreeing rows back to the live router: those are
  `replaced_rows` (a replaced row always disagrees: a row whose set is the live set is within any margin),
  so `disagree_rows == forced_disagree_rows + replaced_rows` (on counted layers). Without threshold
  `forced_disagree_rows == disagree_rows`. The experts of a forced-disagreeing row are not the ones the
  trainer's router would have picked: it is what replay changes in the trainer's forward;
- `engine_tokens_by_layer` / `live_tokens_by_layer`: tokens per expert (E entries) over the compared
  rows, by the engine's routes and by the live choice (load skew, and which experts disagreement moves).

Recompute calls in backward are not counted (their forward was). Not counted: PhiMoE's sparsemixer
(two `max` picks, random in training: no live top-k to compare with); modality routers are counted on
their own tokens.

Sync-free (`runtime/transfer.py`): each call's counts are tensor ops on the router's device into one
(3 + 2E) row per layer, added up on the device; the context reads them in one copy when it closes
(with the threshold counts), so a replayed step gains no host read. Where reading waits for nothing
(CPU, not sync-free) they are read at each forward and when `stats` is read. Off, the interceptor runs
no extra top-k and nothing is counted.

Legend: T = tokens in one router call (the block's tokens), K = top-k, E = experts of the layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from routereplay.runtime.discovery import RouterSite

HEAD = 3  # (disagree, forced disagree, compared), then E engine tokens and E live tokens


def same_set(a_TK: torch.Tensor, b_TK: torch.Tensor) -> torch.Tensor:
    """(T,) True where row t of `a_TK` and `b_TK` hold the same set of ids (ids within a row are distinct)."""
    return (a_TK.unsqueeze(-1) == b_TK.unsqueeze(-2)).any(dim=-1).all(dim=-1)


def tokens_per_expert(ids_TK: torch.Tensor, counted_T: torch.Tensor, experts: int) -> torch.Tensor:
    """(E,) how many counted rows name each expert: one scatter-add, no data-dependent shape (no sync)."""
    weights_TK = counted_T[:, None].expand_as(ids_TK).to(torch.long)
    out_E = torch.zeros(experts, dtype=torch.long, device=ids_TK.device)
    return out_E.scatter_add_(0, ids_TK.clamp(min=0).reshape(-1), weights_TK.reshape(-1))


def call_counts(
    forced_TK: torch.Tensor,
    live_TK: torch.Tensor,
    replaced_T: torch.Tensor | None,
    attended_T: torch.Tensor | None,
    experts: int,
) -> torch.Tensor:
    """One router call's (3 + 2E) counts, on its device: see the module docstring.

    `forced_TK` are the layer's routes as given (before a threshold), -1 rows not compared; `live_TK` the
    live top-k's ids (-1 on tokens a modality router did not see); `attended_T` None counts every row."""
    counted_T = (forced_TK[:, 0] >= 0) & (live_TK[:, 0] >= 0)
    if attended_T is not None:
        counted_T = counted_T & attended_T
    disagree_T = counted_T & ~same_set(forced_TK, live_TK)
    kept_T = disagree_T if replaced_T is None else disagree_T & ~replaced_T
    head_3 = torch.stack([disagree_T.sum(), kept_T.sum(), counted_T.sum()]).to(torch.long)
    engine_E = tokens_per_expert(forced_TK, counted_T, experts)
    live_E = tokens_per_expert(live_TK, counted_T, experts)
    return torch.cat([head_3, engine_E, live_E])


class DisagreementCounter:
    """One replay context's disagreement counts: a (3 + 2E) long row per bound router, on its device."""

    def __init__(self, sites: tuple[RouterSite, ...] | list[RouterSite]) -> None:
        self.sites = sites
        self.rows: dict[int, torch.Tensor] = {}  # column index -> counts not yet folded, on the router's device

    def add(
        self,
        index: int,
        forced_TK: torch.Tensor,
        live_TK: torch.Tensor,
        replaced_T: torch.Tensor | None,
        attended: Callable[[torch.device, int], torch.Tensor | None],
    ) -> None:
        """Count one forward call of router `index` (tensor ops only; `attended(device, T)` is the mask or None)."""
        live_TK = live_TK.to(forced_TK.device)
        counts = call_counts(
            forced_TK,
            live_TK,
            None if replaced_T is None else replaced_T.to(forced_TK.device),
            attended(forced_TK.device, forced_TK.shape[0]),
            self.sites[index].num_choices,
        )
        pending = self.rows.get(index)
        self.rows[index] = counts if pending is None else pending + counts

    def take(self) -> dict[int, torch.Tensor]:
        """The pending rows by column index, in column order, emptied (read them with `read_together`)."""
        rows, self.rows = self.rows, {}
        return dict(sorted(rows.items()))


def read_together(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The values of several small long tensors (0-d or 1-d), each as a list: one device->host copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    values: list[list[int]] = [[] for _ in tensors]
    for indices in by_device.values():
        parts = [tensors[i].reshape(-1).to(torch.long) for i in indices]
        flat = torch.cat(parts).cpu().tolist()  # the one read of this device
        start = 0
        for i, part in zip(indices, parts, strict=True):
            values[i] = flat[start : start + part.numel()]
            start += part.numel()
    return values


__all__ = ["HEAD", "DisagreementCounter", "call_counts", "read_together", "same_set", "tokens_per_expert"]
