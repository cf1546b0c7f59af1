"""Intercepting the one selection `torch.topk` of a router while its forward runs.

While a bound router's scope runs under record or replay, a `TorchFunctionMode` watches torch
calls. The selection top-k is the call with `k == top_k` over a dimension of `num_choices` entries
(group-level top-k calls have other sizes and pass through). Record keeps its indices. Replay
returns `(input.gather(dim, forced), forced)` instead: every step after it (gathering unbiased
scores, renormalising, scaling, dispatch) is the model's own code. So the weights are exactly what
the router computes for the forced experts, and gradients reach the gate. Rows of -1 take the live
choice for that token only. PhiMoE's sparsemixer (two `max` picks) and Doge's product keys (a top-k
over a sorted key grid) have interceptors of their own, on the same principle
(`runtime/family_interceptors.py`).

Top-k order. The order of a row's K ids is the order of the weight renormalisation's sum and of the
experts' combine, so it changes bf16 (even fp32) results. `RouterSlot.keep_order` picks it:
- `replay(order="engine")` (`keep_order=True`): the forced ids in their given order, as stored by an
  ordered codec from an engine's own top-k.
- `replay(order="set")` (the default): the row's SET is forced, in the order the live router gives
  it. The live top-k runs (no autograd, the op's own arguments, `sorted=False` included); a row whose
  forced set is the live set takes the live ids exactly, so a natural set replays bit-exact to the
  natural run even from a set codec (ids sorted ascending); any other row takes its forced ids by
  live score descending (a stable sort: ties keep the given order). `runtime/set_order.py` has the
  rule and its fast path: on CPU, when no row's forced scores tie, the same order comes from one
  gather of K scores per row (and a K-wide sort unless the rows are already in live order), with no
  live top-k.
A record's recompute forces its forward's own choice, in its order.

No host sync per router call. Whether a layer's routes hold -1 rows is decided on the host once,
when the context takes its routes (`RouterSlot.fallback`): a layer without them uses the forced ids
as they are; a layer with them runs the live top-k and `torch.where`s it in, unconditionally (set order
`torch.where`s the live order in the same way). No
`.item()`, `.tolist()` or branch on a tensor's value runs here off the CPU, so on GPU the router never
waits for the device, and under `torch.compile` the interception traces into the graph without a break
(dynamo traces a `TorchFunctionMode` entered inside the compiled region). The one branch on a value,
set order's fast path, runs only on CPU tensors outside dynamo, where reading a flag waits for nothing,
and never in a sync-free context (`RouterSlot.host_reads` False: `Replayer(sync_free=...)`), so the
device path can be checked on CPU (`tests/runtime/test_transfer.py`).

Compiled models. Compile the decoder or MoE blocks, not the model: its forward pre-hook starts the
steps on the host, and the context folds the choices compiled routers leave in their slots (see
`runtime/session.py`). One graph per fallback variant serves every layer. Checkpoint outside the
compiled block: dynamo refuses the router's side effects inside a checkpoint it traces ("HOP: Unsafe
side effect") and runs that block eagerly. `in_backward` is False while dynamo traces (the autograd
engine's state is no guard), so a compiled router cannot tell a recompute from a forward: replay
recomputes the same routes (forced rows; -1 rows re-decided live from the same scores, as in eager),
but `stats.recompute_calls` stays 0, and record recomputes the live top-k instead of reusing its choice.

Legend: T = tokens in this router call, K = top-k, C = choices (experts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.set_order import in_live_order, untied_live_order, untied_order_applies
from routereplay.runtime.threshold import thresholded

TOPK_FUNCTIONS = frozenset({torch.topk, torch.Tensor.topk})


@dataclass(slots=True)
class RouterSlot:
    """One bound router's exchange with the open context: its forced routes in, its choice out.

    The context fills `forced_TK` and `fallback` on entry and empties the slot on exit; a router call
    leaves its choice in `chosen_TK`, which the context folds into its steps and counters on the host.
    A compiled router reads and writes only these attributes, so one graph serves every layer."""

    forced_TK: torch.Tensor | None = None  # replay: this layer's routes, long, on the router's device
    fallback: bool = False  # forced_TK has -1 rows (decided on the host when the routes were set)
    keep_order: bool = False  # replay(order="engine"): force forced_TK's order, not the live order of its set
    chosen_TK: torch.Tensor | None = None  # the last call's choice, not yet folded into the context
    rows_T: torch.Tensor | None = None  # modality routers: the block's tokens this call sees (None: all)
    counts: tuple[int, int] = (0, 0)  # modality routers: (replayed, fallback) rows of this call
    threshold: float | None = None  # replay(threshold=margin): see `runtime/threshold.py`
    replaced_T: torch.Tensor | None = None  # the last call's rows a threshold gave back to the live router
    host_reads: bool = True  # set order may branch on a value (CPU only); False in a sync-free context
    count_disagreement: bool = False  # replay(count_disagreement=True): see `runtime/disagreement.py`
    live_TK: torch.Tensor | None = None  # the last forward call's live top-k ids (counting on), not yet folded

    def clear(self) -> None:
        self.forced_TK, self.fallback, self.keep_order, self.chosen_TK = None, False, False, None
        self.rows_T, self.counts, self.host_reads = None, (0, 0), True
        self.threshold, self.replaced_T = None, None
        self.count_disagreement, self.live_TK = False, None


# (site, slot, rows T) -> (forced ids (T, K) long, whether they hold -1 rows), or None for the live top-k
ForcedLookup = Callable[[RouterSite, RouterSlot, int], "tuple[torch.Tensor, bool] | None"]


@dataclass(frozen=True, slots=True)
class TopKCall:
    """A selection top-k call the interceptor took: the function, its arguments, and its input, k and dimension."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    scores: torch.Tensor
    k: int
    dim: int

    def live(self) -> Any:
        """The call as the router made it: the live top-k's (values, positions)."""
        return self.func(*self.args, **self.kwargs)

    def rows_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """A top-k output (values or positions) of this call as (T, K)."""
        return _rows_last(tensor, self.dim, self.k)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where checkpoint recomputes happen).

    False while dynamo traces (it cannot guard on it): compiled code takes the forward path."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


def on_thread(owner: int) -> bool:
    """True when the running code belongs to thread `owner`: it runs on that thread, or it is a backward
    running on an autograd engine thread (not a Python thread: CUDA backward runs there, for its caller)."""
    if threading.get_ident() == owner:
        return True
    return in_backward() and isinstance(threading.current_thread(), threading._DummyThread)


class TopKInterceptor(TorchFunctionMode):
    """Active for one call of one router scope; keeps the choice of the selection top-k it saw.

    The selection top-k picks *positions* along its dimension. For a plain router a position is an
    expert id; a family whose positions are not ids (Doge's product keys) overrides `ids_of` and
    `positions_of` (see `runtime/family_interceptors.py`)."""

    def __init__(self, site: RouterSite, slot: RouterSlot, forced: ForcedLookup) -> None:
        super().__init__()
        self.site, self.slot, self.forced = site, slot, forced
        self.hits = 0
        self.last: torch.Tensor | None = None  # ids (T, K) chosen by the last matching call

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in TOPK_FUNCTIONS:
            return func(*args, **kwargs)
        scores, k, dim = topk_arguments(args, kwargs)
        if k != self.site.top_k or scores.shape[dim] != self.site.num_choices:
            return func(*args, **kwargs)
        return self.select(func, args, kwargs, scores, k, dim)

    def ids_of(self, positions_TK: torch.Tensor) -> torch.Tensor:
        """Expert ids of positions chosen along the selection dimension (the same for a plain router)."""
        return positions_TK

    def positions_of(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """Positions along the selection dimension that hold these expert ids (the same for a plain router)."""
        return ids_TK

    def keeps_order(self) -> bool:
        """Force the ids in their given order: `replay(order="engine")`, or a record's recompute (whose slot
        holds no routes: its forced ids are its forward's own choice, in that choice's order)."""
        return self.slot.keep_order or self.slot.forced_TK is None

    def select(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], scores: torch.Tensor, k: int, dim: int
    ) -> Any:
        """The selection top-k: the live choice (record), or the forced one with its values gathered."""
        rows = scores.numel() // scores.shape[dim]
        forced = self.forced(self.site, self.slot, rows)
        if forced is None and not torch.is_grad_enabled():
            # record without autograd (rollout engines, old-log-prob passes): nothing is saved for a
            # recompute, so the live top-k is returned as is; its values are the gathered scores
            result = func(*args, **kwargs)
            self.hits += 1
            self.last = self.ids_of(_rows_last(result[1], dim, k))
            return result
        call = TopKCall(func, args, kwargs, scores, k, dim)
        if forced is None:  # record: the live choice
            with torch.no_grad():
                chosen_TK = self.live_ids(call)
        else:
            forced_TK, fallback = forced
            if forced_TK.device != scores.device:  # routes placed on another device than the scores: no wait
                forced_TK = forced_TK.to(scores.device, non_blocking=True)
            chosen_TK = self.forced_choice(call, forced_TK, fallback)
        # one code path for every mode: selection without autograd, values by gather. A checkpoint
        # recompute (which replays) then saves exactly the tensors its forward (maybe a record) saved.
        lead = scores.shape[:dim] + scores.shape[dim + 1 :]
        indices = self.positions_of(chosen_TK).reshape(*lead, k)
        if dim != scores.dim() - 1:
            indices = indices.movedim(-1, dim)
        values = scores.gather(dim, indices)
        self.hits += 1
        self.last = chosen_TK  # when several calls match (a one-group group score), the last selects
        return torch.return_types.topk((values, indices))

    def live_ids(self, call: TopKCall) -> torch.Tensor:
        """The expert ids (T, K) the live top-k chooses (the call run as the router made it)."""
        return self.ids_of(call.rows_last(call.live()[1]))

    def forced_choice(self, call: TopKCall, forced_TK: torch.Tensor, fallback: bool) -> torch.Tensor:
        """The ids (T, K) a replayed call forces, in the order it forces them (see "Top-k order").

        Counting disagreement (`RouterSlot.count_disagreement`, `runtime/disagreement.py`), a forward call
        leaves the live top-k's ids in the slot: run once, shared with threshold and set order."""
        live_TK: torch.Tensor | None = None
        counting = self.slot.count_disagreement and self.slot.forced_TK is not None and not in_backward()
        if self.slot.threshold is not None and self.slot.forced_TK is not None:
            forced_TK, live_TK = self.thresholded(call, forced_TK, self.slot.threshold)
        elif counting:
            with torch.no_grad():
                live_TK = self.live_ids(call)
        if counting:
            self.slot.live_TK = live_TK
        keep_order = self.keeps_order()
        if keep_order and not fallback:
            return forced_TK
        with torch.no_grad():
            values_TK: torch.Tensor | None = None
            if not fallback and self.slot.host_reads and untied_order_applies(call.scores, call.args, call.kwargs):
                values_TK = self.values_at(call, forced_TK)
                ordered_TK = untied_live_order(forced_TK, values_TK)
                if ordered_TK is not None:
                    return ordered_TK
            if live_TK is None:
                live_TK = self.live_ids(call)
            if fallback:  # -1 rows (known on the host): the live router decides for those tokens only
                forced_TK = torch.where(forced_TK[:, :1] < 0, live_TK, forced_TK)
            if keep_order:
                return forced_TK
            if values_TK is None:
                values_TK = self.values_at(call, forced_TK)
            return in_live_order(forced_TK, live_TK, values_TK)

    def thresholded(self, call: TopKCall, forced_TK: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, live ids): forced rows outside `margin` of the live top-k's K-th score take the live choice
        (`runtime/threshold.py`); the live top-k's ids come along (set order and counting reuse them)."""
        with torch.no_grad():
            values, positions = call.live()
            live_TK = self.ids_of(call.rows_last(positions))
            forced_values_TK = self.values_at(call, forced_TK.clamp(min=0))
            ids_TK, replaced_T = thresholded(forced_TK, live_TK, call.rows_last(values), forced_values_TK, margin)
        if not in_backward():
            self.slot.replaced_T = replaced_T
        return ids_TK, live_TK

    def values_at(self, call: TopKCall, ids_TK: torch.Tensor) -> torch.Tensor:
        """The call's input scores (T, K) at expert ids `ids_TK`, rows last."""
        return _rows_last(call.scores, call.dim, call.scores.shape[call.dim]).gather(-1, self.positions_of(ids_TK))


def topk_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, int]:
    """(input, k, non-negative dim) of a `torch.topk` / `Tensor.topk` call."""
    scores = args[0]
    k = args[1] if len(args) > 1 else kwargs.get("k")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return scores, k, dim % scores.dim()


def _rows_last(indices: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """Top-k indices (or a top-k's input, k = its size) as (T, K), whatever dimension they run along."""
    if dim != indices.dim() - 1:
        indices = indices.movedim(dim, -1)
    return indices.reshape(-1, k)


__all__ = [
    "TOPK_FUNCTIONS",
    "RouterSlot",
    "TopKCall",
    "TopKInterceptor",
    "in_backward",
    "in_live_order",
    "on_thread",
    "topk_arguments",
]
