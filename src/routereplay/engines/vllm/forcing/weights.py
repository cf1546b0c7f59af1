"""The combine weights vLLM's routers returned, kept per request and position until the engine takes them.

A request asks with `extra_args[WEIGHTS_KEY] = True` (`forced_routes.asks_weights`), forced or not. In
each engine step the worker (`forcing.worker`) has every wrapped router keep the (weights, ids) it
returned after forcing (`LayerForcing.route`: what `_select_experts` hands to vLLM's routed-experts capture
and to the experts), and stores, for each asking request, its rows of the step: their positions, the ids
and the weights, all MoE layers side by side (`WeightsStore.keep`). The ids are kept beside the weights so
the engine can check them against vLLM's own capture of the same rows (`RequestWeights.rows`).

Keyed by (request, position), like the forcing itself: chunked prefill, batches mixing asking and other
requests, and preemption followed by recompute (the recomputed rows overwrite the earlier ones) each find
their rows. Requests that left the runner (finished or aborted) move to a finished store of at most
`capacity` requests (oldest dropped first), from which `take` pops them: the in-process engine takes its
requests right after each `generate` call and raises `capacity` to its call's size first; a server whose
clients cannot take them keeps at most `capacity` requests' weights.

Legend: n = rows of one step for one request, T = rows of a request, L = MoE layers (`moe_layers` order),
K = top-k.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import numpy as np

DEFAULT_CAPACITY = 1024  # finished requests whose weights wait to be taken


@dataclass(slots=True)
class RequestWeights:
    """One request's kept rows, chunk by chunk as its steps ran (a later chunk wins on a repeated position)."""

    positions: list[np.ndarray] = field(default_factory=list)  # (n,) int64 each
    ids: list[np.ndarray] = field(default_factory=list)  # (n, L, K) int32 each
    weights: list[np.ndarray] = field(default_factory=list)  # (n, L, K) float32 each

    def add(self, positions_n: np.ndarray, ids_nLK: np.ndarray, weights_nLK: np.ndarray) -> None:
        self.positions.append(np.asarray(positions_n, dtype=np.int64))
        self.ids.append(np.asarray(ids_nLK, dtype=np.int32))
        self.weights.append(np.asarray(weights_nLK, dtype=np.float32))

    def rows(self, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows 0..num_rows-1 by position: (have_T bool, ids_TLK int32 (-1 where none), weights_TLK float32 (0))."""
        if not self.positions:
            return np.zeros(num_rows, dtype=bool), np.empty((num_rows, 0, 0), np.int32), np.empty((num_rows, 0, 0))
        shape = (num_rows, *self.ids[0].shape[1:])
        have_T = np.zeros(num_rows, dtype=bool)
        ids_TLK = np.full(shape, -1, dtype=np.int32)
        weights_TLK = np.zeros(shape, dtype=np.float32)
        for positions_n, ids_nLK, weights_nLK in zip(self.positions, self.ids, self.weights, strict=True):
            inside_n = (positions_n >= 0) & (positions_n < num_rows)
            at = positions_n[inside_n]
            have_T[at] = True
            ids_TLK[at] = ids_nLK[inside_n]
            weights_TLK[at] = weights_nLK[inside_n]
        return have_T, ids_TLK, weights_TLK

    @property
    def num_kept(self) -> int:
        return sum(len(p) for p in self.positions)


class WeightsStore:
    """Kept combine weights of the requests that asked, live and finished (module docstring)."""

    __slots__ = ("capacity", "finished", "live")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = int(capacity)
        self.live: dict[str, RequestWeights] = {}
        self.finished: OrderedDict[str, RequestWeights] = OrderedDict()

    def keep(self, request_id: str, positions_n: np.ndarray, ids_nLK: np.ndarray, weights_nLK: np.ndarray) -> None:
        """Add one step's rows of a request."""
        kept = self.live.get(request_id)
        if kept is None:
            kept = self.finished.pop(request_id, None) or RequestWeights()  # a request seen again (resumed)
            self.live[request_id] = kept
        kept.add(positions_n, ids_nLK, weights_nLK)

    def retire(self, present: Container[str]) -> None:
        """Move the requests no longer `present` in the runner to the finished store (oldest dropped past
        `capacity`)."""
        for request_id in [r for r in self.live if r not in present]:
            self.finished[request_id] = self.live.pop(request_id)
        while len(self.finished) > self.capacity:
            self.finished.popitem(last=False)

    def take(self, request_ids: Iterable[str]) -> dict[str, RequestWeights]:
        """Pop the kept weights of these requests, live or finished, by the id vLLM's runner uses or by the id
        given to vLLM (the runner's id is that id plus "-" and 8 random characters); absent ids are left out."""
        wanted = {str(r) for r in request_ids}
        taken: dict[str, RequestWeights] = {}
        for store in (self.live, self.finished):
            for request_id in list(store):
                external = request_id.rsplit("-", 1)[0]
                name = request_id if request_id in wanted else external if external in wanted else None
                if name is not None:
                    taken[name] = store.pop(request_id)
        return taken

    def __len__(self) -> int:
        return len(self.live) + len(self.finished)


__all__ = ["DEFAULT_CAPACITY", "RequestWeights", "WeightsStore"]
