"""The combine weights vLLM's routers returned, kept per request and position until the engine takes them.

A request asks with `extra_args[WEIGHTS_KEY] = True` (`forced_routes.asks_weights`), forced or not. In
each engine step the worker (`forcing.worker`) has every wrapped router keep the (weights, ids) it
returned after forcing (`LayerForcing.route`: what `_select_experts` hands to vLLM's routed-experts capture
and to the experts), and stores, for each asking request, its rows of the step: their positions, the ids
and the weights, all MoE layers side by side (`WeightsStore.keep`). The ids are kept beside the weights so
the engine can check them against vLLM's own capture of the same rows (`RequestWeights.rows`).

Keyed by (request, position), like the forcing itself: chunked prefill, batches mixing asking and other
requests, and preemption followed by recompute (the recomputed rows overwrite the earlier ones) each find
their rows.

Bounded twice, so weights nobody takes cannot pile up in a server (issue 38 item 7):
- by count: a request that left the runner (finished or aborted) is moved to a finished store of at most
  `capacity` requests (oldest dropped first), from which `take` pops it. `capacity` is 0 unless an engine
  that takes weights reserved room (`reserve`): the in-process `VLLMEngine` reserves its call's request
  count before the call and takes them right after it. Behind `vllm serve` nothing takes them (vLLM's HTTP
  API has no route to the worker's store), so a request's weights are dropped once it has left the runner
  (seen at the worker's next step), counted in `evicted`.
- by bytes: every kept row costs `row_bytes(L, K)` (its position, K int32 ids and K float32 weights per
  layer); the rows kept, live and finished, never pass `max_bytes` (`MAX_BYTES_ENV`, default
  `DEFAULT_MAX_BYTES`). `keep` checks a step's rows against it before it copies them: finished requests are
  evicted first (oldest first, counted in `evicted`); if the rows still do not fit, the asking request's
  weights are dropped whole and it keeps nothing more (`over_limit`), and `take` hands it back marked
  `dropped` with the reason, which the engine raises by name (`WeightsCaptureError`). The front end refuses
  a request whose own rows (prompt + max_tokens) could not fit at all before it is queued (`plugin`).

Legend: n = rows of one step for one request, T = rows of a request, L = MoE layers (`moe_layers` order),
K = top-k.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import numpy as np

from routereplay.errors import ConfigError

DEFAULT_CAPACITY = 0  # finished requests whose weights wait to be taken, until an engine that takes them reserves
DEFAULT_MAX_BYTES = 1 << 30  # bytes of kept rows (live and finished) one worker holds at most
MAX_BYTES_ENV = "ROUTEREPLAY_WEIGHTS_MAX_BYTES"  # overrides DEFAULT_MAX_BYTES in every vLLM process (front end, worker)
DROPPED_NAMES = 4096  # requests whose dropped weights are remembered by name (so `take` can say why)
LOG = logging.getLogger("routereplay.vllm.forcing")


def row_bytes(num_layers: int, top_k: int) -> int:
    """Bytes one kept row costs: its int64 position, and per MoE layer K int32 ids and K float32 weights."""
    return 8 + num_layers * top_k * (4 + 4)


def max_bytes_from_env(environ: dict[str, str] | None = None) -> int:
    """The byte limit of kept weights: `MAX_BYTES_ENV` when set (a whole number of bytes, >= 0), else
    `DEFAULT_MAX_BYTES`; `ConfigError` naming the variable for anything else."""
    text = (os.environ if environ is None else environ).get(MAX_BYTES_ENV)
    if text is None or not text.strip():
        return DEFAULT_MAX_BYTES
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"{MAX_BYTES_ENV}={text!r}: the byte limit of the combine weights a vLLM worker keeps must be a whole "
            f"number of bytes >= 0 (default {DEFAULT_MAX_BYTES}); set it in the environment vLLM starts in"
        )
    return value


@dataclass(slots=True)
class RequestWeights:
    """One request's kept rows, chunk by chunk as its steps ran (a later chunk wins on a repeated position).
    `dropped` says why a request's weights were dropped (none are kept then); None while they are kept."""

    positions: list[np.ndarray] = field(default_factory=list)  # (n,) int64 each
    ids: list[np.ndarray] = field(default_factory=list)  # (n, L, K) int32 each
    weights: list[np.ndarray] = field(default_factory=list)  # (n, L, K) float32 each
    dropped: str | None = None

    def add(self, positions_n: np.ndarray, ids_nLK: np.ndarray, weights_nLK: np.ndarray) -> None:
        """Keep copies of one step's rows (the caller's arrays may be views of a step's buffers)."""
        self.positions.append(np.array(positions_n, dtype=np.int64))
        self.ids.append(np.array(ids_nLK, dtype=np.int32))
        self.weights.append(np.array(weights_nLK, dtype=np.float32))

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

    @property
    def nbytes(self) -> int:
        """Bytes of the kept rows."""
        return sum(a.nbytes for a in (*self.positions, *self.ids, *self.weights))


class WeightsStore:
    """Kept combine weights of the requests that asked, live and finished, bounded by count and bytes (module
    docstring)."""

    __slots__ = ("capacity", "dropped", "evicted", "finished", "kept_bytes", "live", "max_bytes", "over_limit")

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int | None = None) -> None:
        self.capacity = int(capacity)
        self.max_bytes = max_bytes_from_env() if max_bytes is None else int(max_bytes)
        self.live: dict[str, RequestWeights] = {}
        self.finished: OrderedDict[str, RequestWeights] = OrderedDict()
        self.dropped: OrderedDict[str, str] = OrderedDict()  # request id -> why its weights were dropped
        self.kept_bytes = 0  # bytes of every kept row, live and finished
        self.evicted = 0  # requests whose kept weights were dropped before anyone took them
        self.over_limit = 0  # requests whose rows would have passed max_bytes

    def accepts(self, request_id: str) -> bool:
        """Whether rows of this request are still kept (False once its weights were dropped over the limit)."""
        return request_id not in self.dropped

    def keep(self, request_id: str, positions_n: np.ndarray, ids_nLK: np.ndarray, weights_nLK: np.ndarray) -> bool:
        """Add (copies of) one step's rows of a request, checked against `max_bytes` before they are copied;
        False when the request's weights were dropped instead (`over_limit`)."""
        if not self.accepts(request_id):
            return False
        need = int(np.asarray(positions_n).size) * 8 + 4 * int(np.asarray(ids_nLK).size + np.asarray(weights_nLK).size)
        while self.kept_bytes + need > self.max_bytes and self.finished:
            name, oldest = self.finished.popitem(last=False)
            self._drop(name, oldest, f"evicted, untaken, to make room under {MAX_BYTES_ENV}={self.max_bytes}")
        kept = self.live.get(request_id)
        if kept is None:
            kept = self.finished.pop(request_id, None) or RequestWeights()  # a request seen again (resumed)
            self.live[request_id] = kept
        if self.kept_bytes + need > self.max_bytes:
            del self.live[request_id]
            self.kept_bytes -= kept.nbytes
            self.over_limit += 1
            self._name(
                request_id,
                f"its rows would pass the {self.max_bytes} bytes of combine weights one vLLM worker keeps "
                f"({self.kept_bytes} kept for other requests, {kept.nbytes + need} for this one); set "
                f"{MAX_BYTES_ENV} higher in vLLM's environment, or ask for fewer rows at once",
            )
            LOG.warning("routereplay: combine weights of request %r dropped: %s", request_id, self.dropped[request_id])
            return False
        kept.add(positions_n, ids_nLK, weights_nLK)
        self.kept_bytes += need
        return True

    def retire(self, present: Container[str]) -> None:
        """Move the requests no longer `present` in the runner to the finished store; past `capacity` the oldest
        are dropped, counted in `evicted`. A dropped request no longer present is forgotten by `accepts`."""
        for request_id in [r for r in self.live if r not in present]:
            self.finished[request_id] = self.live.pop(request_id)
        while len(self.finished) > self.capacity:
            name, oldest = self.finished.popitem(last=False)
            self._drop(name, oldest, f"the request finished and no engine took them (room for {self.capacity})")

    def take(self, request_ids: Iterable[str]) -> dict[str, RequestWeights]:
        """Pop the kept weights of these requests, live or finished, by the id vLLM's runner uses or by the id
        given to vLLM (the runner's id is that id plus "-" and 8 random characters); a request whose weights were
        dropped comes back empty with `dropped` set; absent ids are left out."""
        wanted = {str(r) for r in request_ids}
        taken: dict[str, RequestWeights] = {}
        for store in (self.live, self.finished, self.dropped):
            for request_id in list(store):
                external = request_id.rsplit("-", 1)[0]
                name = request_id if request_id in wanted else external if external in wanted else None
                if name is None or name in taken:
                    continue
                value = store.pop(request_id)
                if isinstance(value, str):
                    taken[name] = RequestWeights(dropped=value)
                else:
                    self.kept_bytes -= value.nbytes
                    taken[name] = value
        return taken

    def _drop(self, request_id: str, kept: RequestWeights, why: str) -> None:
        self.kept_bytes -= kept.nbytes
        self.evicted += 1
        self._name(request_id, why)

    def _name(self, request_id: str, why: str) -> None:
        self.dropped[request_id] = why
        self.dropped.move_to_end(request_id)
        while len(self.dropped) > DROPPED_NAMES:
            self.dropped.popitem(last=False)

    def __len__(self) -> int:
        return len(self.live) + len(self.finished)


__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_BYTES",
    "DROPPED_NAMES",
    "MAX_BYTES_ENV",
    "RequestWeights",
    "WeightsStore",
    "max_bytes_from_env",
    "row_bytes",
]
