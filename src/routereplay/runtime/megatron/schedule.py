"""One record/replay context of the Megatron adapter: the schedule it consumes and what it routed.

A `Schedule` holds one micro-batch list of forced routes (replay) or none (record), what each router
used per forward call (reused verbatim by its activation-checkpoint recompute), and checks on a
clean exit that every router consumed every micro-batch exactly once. `MegatronRecording` is the
read-only view a context yields.

Legend: N = tokens a router sees in one micro-batch (router order), L = layers, K = top-k.
"""

from __future__ import annotations

import torch

from routereplay.enums import ReplayMode
from routereplay.errors import BatchShapeError, MicroBatchCountError, RecomputeError, ReplayStateError
from routereplay.runtime.megatron.binding import MegatronSite
from routereplay.runtime.replayer import ReplayStats


class Schedule:
    """State of one record or replay context: routes per micro-batch, what each router used."""

    def __init__(
        self, mode: ReplayMode, layers: tuple[int, ...], routes: list[dict[int, tuple[torch.Tensor, int]]] | None
    ) -> None:
        self.mode, self.routes = mode, routes
        self.used: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}  # per forward call
        self.recomputed: dict[int, int] = dict.fromkeys(layers, 0)
        self.forwards = 0

    def forced(self, site: MegatronSite, rows: int) -> tuple[torch.Tensor, int]:
        assert self.routes is not None
        n = len(self.used[site.layer])
        if n >= len(self.routes):
            raise MicroBatchCountError(
                f"layer {site.layer} ({site.name}) routes a micro-batch {n + 1} but the schedule holds "
                f"{len(self.routes)}; give one routes tensor per micro-batch of this forward_backward call"
            )
        forced_NK, fallbacks = self.routes[n][site.layer]
        if forced_NK.shape[0] != rows:
            raise BatchShapeError(
                f"micro-batch {n}, layer {site.layer} ({site.name}): the router sees {rows} tokens (its local shard "
                f"after SP/CP/packing, S * B order) but the routes have {forced_NK.shape[0]} rows; align them "
                "with routereplay.layout first"
            )
        return forced_NK, fallbacks

    def recompute(self, site: MegatronSite, rows: int) -> torch.Tensor:
        used, n = self.used[site.layer], self.recomputed[site.layer]
        if n >= len(used):
            raise RecomputeError(
                f"layer {site.layer} ({site.name}): backward recompute #{n + 1} but only {len(used)} forward(s) "
                "routed in this context; it would route differently from its forward"
            )
        chosen_NK = used[n]
        if chosen_NK.shape[0] != rows:
            raise RecomputeError(
                f"layer {site.layer} ({site.name}): recompute {n} sees {rows} tokens but its forward routed "
                f"{chosen_NK.shape[0]}; recomputes must follow forwards in order (no partial checkpointing)"
            )
        self.recomputed[site.layer] = n + 1
        return chosen_NK

    def check_complete(self) -> None:
        """On a clean exit: every micro-batch consumed once per router, recompute all-or-none."""
        counts = {layer: len(used) for layer, used in self.used.items()}
        expected = len(self.routes) if self.routes is not None else max(counts.values(), default=0)
        short = {layer: count for layer, count in counts.items() if count != expected}
        if short:
            raise MicroBatchCountError(
                f"routers routed a different number of micro-batches than the schedule's {expected}: "
                f"{_layer_counts(short)}; leftover routes would leak into the next pass. Run every micro-batch "
                "of the schedule inside one context, and only those"
            )
        partial = {layer: n for layer, n in self.recomputed.items() if n not in (0, counts[layer])}
        if partial:
            raise RecomputeError(
                f"routers were recomputed for only some of their {expected} forwards: {_layer_counts(partial)}; "
                "forward-only and checkpointed micro-batches must not share a context"
            )


class MegatronRecording:
    """What a context routed: `.microbatches` (one (N, L, K) tensor each), `.layers`, `.stats`.

    Under `record()` the routers' own choices; under `replay()` the routes actually used (forced
    ids, and the live choice on -1 rows). Rows are in router order (S * B of the local shard).
    """

    def __init__(self, schedule: Schedule, layers: tuple[int, ...], num_experts: int, stats: ReplayStats) -> None:
        self._schedule, self.layers, self.num_experts, self._stats = schedule, layers, num_experts, stats

    @property
    def stats(self) -> ReplayStats:
        """The replayer's counters (cumulative; `.reset()` them between passes)."""
        return self._stats

    @property
    def microbatches(self) -> list[torch.Tensor]:
        used = self._schedule.used
        counts = {layer: len(used[layer]) for layer in self.layers}
        if len(set(counts.values())) > 1:
            raise MicroBatchCountError(f"routers routed different numbers of micro-batches: {_layer_counts(counts)}")
        total = counts[self.layers[0]] if self.layers else 0
        return [torch.stack([used[layer][n] for layer in self.layers], dim=1) for n in range(total)]

    @property
    def routes(self) -> torch.Tensor:
        """The (N, L, K) routes of the context's only micro-batch."""
        batches = self.microbatches
        if len(batches) != 1:
            raise ReplayStateError(f"the context routed {len(batches)} micro-batches; read .microbatches")
        return batches[0]


def _layer_counts(counts: dict[int, int]) -> str:
    return ", ".join(f"layer {layer}: {n}" for layer, n in sorted(counts.items()))


__all__ = ["MegatronRecording", "Schedule"]
