"""`attach_megatron(model) -> MegatronReplayer`: record and replay the routing of a Megatron-core MoE model.

How it hooks in. In megatron-core 0.16 to 0.19 `TopKRouter.routing` passes `self.router_replay` to
`topk_routing_with_score_function`, which, when that attribute is not None, delegates the top-k
selection to `router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default)` and
then computes everything else itself (softmax after or before the top-k, sigmoid or 0.19's
sqrtsoftplus with or without expert bias, normalisation, scaling factor, the dense probs and the
routing map). The replayer puts its own small object into that slot of each bound router instance
(`router.router_replay`, an instance attribute), so the forced experts go through Megatron's own
weight math and gradients reach the logits. It does not use Megatron's `RouterReplay` actions or its
class-level registry (positional and ever-growing, verl #7340), and it does not need
`moe_enable_routing_replay=True`. When that flag is on, the native instance stays reachable: calls
made outside a routereplay context go to it (so Megatron's own RECORD, e.g. 0.19's inference routing
metadata with its CUDA-graph static buffers, keeps working while attached), a context refuses to run
while it has an action set, and `detach()` puts it back. 0.19's `set_layer_number` writes
`router_replay.layer_number`; the slot object passes it on, and a router renumbered after attach is
refused inside a context. Our object also serves what `RouterReplay` cannot: -1 rows fall back to
the live top-k for those tokens only (counted), rows/top-k/ids/duplicates are checked instead of
silently accepted, and recompute reuses routes by per-router cursor, scoped to one context. The
live top-k runs in the caller's grad mode, as Megatron's own call does (0.19 sorts it only with
grad enabled), so a record is bit-identical to Megatron's RECORD, order included.

Token order. Megatron is sequence-first: the router flattens hidden [S, B, H] to S * B tokens, and
after sequence/context parallelism and packing it sees only its local shard. `replay()` takes, per
micro-batch, routes already in that router order, (N, L, K) or (S, B, L, K) (flattened to S * B);
producing them from traces is `routereplay.layout`'s job. The L axis is described by
`payload_layers` (0-based global decoder layers; see `resolve_payload_layers`): an all-layer
payload (dense rows ignored) or a MoE-only one; each router takes its own layer's rows, so one
payload serves every pipeline stage and virtual chunk.

Micro-batches and recompute. One context is one schedule (one `forward_backward_func` call, or one
forward-only pass): the n-th forward call of each router takes micro-batch n's routes (Megatron runs
each model chunk's micro-batches in order, under 1F1B and interleaving alike), and the n-th call of
that router during backward (an activation-checkpoint recompute) reuses verbatim the routes its
n-th forward used, including the live choice of -1 rows. State lives on the context and is
dropped when it closes. Leaving it cleanly checks that every router consumed every micro-batch
exactly once, and was recomputed for all of its forwards or none; a router called past the end, a
recompute with nothing to reuse, or a recompute after the context closed raises.

Not replayed (by design, as in Megatron): the aux loss computes its own live top-k; z-loss and the
expert-bias token counter see the logits / the map actually dispatched. Group-limited routing
limits only live (-1) rows.

Legend: N = tokens a router sees in one micro-batch (router order), S = sequence, B = batch,
L = layers of a payload, K = top-k, E = experts, M = micro-batches of a schedule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from routereplay.enums import ReplayMode
from routereplay.errors import (
    AlreadyAttachedError,
    BatchShapeError,
    ConfigError,
    DtypeError,
    KernelBypassError,
    LayerRenumberedError,
    NativeReplayConflictError,
    NoRoutersError,
    ReplayStateError,
    TopKMismatchError,
    UnsupportedRouterError,
)
from routereplay.runtime.interception import in_backward
from routereplay.runtime.megatron.binding import (
    MegatronSite,
    check_config,
    find_routers,
    moe_layers_of,
    resolve_payload_layers,
)
from routereplay.runtime.megatron.schedule import MegatronRecording, Schedule
from routereplay.runtime.replayer import Binding, ReplayStats
from routereplay.runtime.routes import routes_tensor
from routereplay.runtime.tensor_forms import refuse_unreadable
from routereplay.trace.route_trace import RouteTrace

# Megatron's default top-k: (scores (N, E), k, num_groups=, group_topk=) -> (values (N, K), ids (N, K))
DefaultTopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]
RoutesInput = torch.Tensor | np.ndarray


class _RouterHook:
    """Sits in `router.router_replay` while attached; `topk_routing_with_score_function` calls it.

    `original` is what the slot held: None, or Megatron's own `RouterReplay` (with
    `moe_enable_routing_replay=True`), which still serves every call made outside a context.
    """

    __slots__ = ("_layer_number", "original", "replayer", "site")

    def __init__(self, replayer: MegatronReplayer, site: MegatronSite, original: Any) -> None:
        self.replayer, self.site, self.original = replayer, site, original
        self._layer_number: int | None = site.router.layer_number

    @property
    def layer_number(self) -> int | None:
        return self._layer_number

    @layer_number.setter
    def layer_number(self, value: int | None) -> None:
        # 0.19's Router.set_layer_number writes `router.router_replay.layer_number`: pass it on to the
        # native instance it stands in for; `_select` refuses to replay a renumbered router
        self._layer_number = value
        if self.original is not None and hasattr(self.original, "layer_number"):
            self.original.layer_number = value

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: DefaultTopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None, "Megatron always passes its default top-k"
        return self.replayer._select(
            self.site, scores, topk, num_groups, group_topk, default_compute_topk, self.original
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.original, memo)  # a copy of an attached model is not attached

    def __reduce__(self) -> tuple[Any, ...]:
        return (copy.copy, (self.original,))  # a pickled model holds the original slot, not the replayer


class MegatronReplayer:
    """Record / replay controller bound to one Megatron model's TopKRouters (see the module docstring)."""

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, strict: bool = True) -> None:
        chunks = (model,) if isinstance(model, nn.Module) else tuple(model)
        sites, refused = find_routers(chunks)
        blocking = [r for r in refused if not r.natural_ok]
        if not sites and not blocking:
            raise NoRoutersError(
                f"no TopKRouter with a decoder layer number in {len(chunks)} model chunk(s)"
                + (f" (left natural: {', '.join(r.name for r in refused)})" if refused else "")
                + "; is it an MoE model, and does this pipeline stage hold MoE layers?"
            )
        if blocking and (strict or not sites):
            details = "; ".join(f"{r.name}: {r.reason}" for r in blocking[:4])
            raise UnsupportedRouterError(
                f"{len(blocking)} router(s) cannot be replayed: {details}"
                + ("; pass strict=False to bind the others and leave these natural" if sites else "")
            )
        for site in sites:
            if isinstance(site.router.router_replay, _RouterHook):
                raise AlreadyAttachedError(f"{site.name} is already bound by a MegatronReplayer; detach() it first")
            check_config(site.router.config, site.name)
        shapes = {(s.top_k, s.num_experts) for s in sites}
        if len(shapes) > 1:
            raise UnsupportedRouterError(f"routers differ in (top-k, experts) {sorted(shapes)}; a trace has one K")
        self.chunks, self.sites, self.refused = chunks, sites, tuple(refused)
        self.layers: tuple[int, ...] = tuple(s.layer for s in sites)
        self.bindings = tuple(Binding(s.layer, s.name, type(s.router).__name__, s.top_k, s.num_experts) for s in sites)
        (self.top_k, self.num_experts), config = shapes.pop(), sites[0].router.config
        self.num_layers = int(config.num_layers)
        self.moe_layers = moe_layers_of(config)
        self.stats = ReplayStats()
        self.mode = ReplayMode.OFF
        self._schedule: Schedule | None = None
        self._pending = False  # a context closed; a backward recompute now would route naturally
        self._hooks: list[_RouterHook] = []
        for site in sites:
            hook = _RouterHook(self, site, site.router.router_replay)
            site.router.router_replay = hook  # instance attribute; the class and other instances untouched
            self._hooks.append(hook)

    # -- contexts ----------------------------------------------------------------------------------
    @contextmanager
    def record(self) -> Iterator[MegatronRecording]:
        """Routers run naturally; each forward's choice is kept (and reused by its recompute)."""
        with self._session(Schedule(ReplayMode.RECORD, self.layers, None)) as recording:
            yield recording

    @contextmanager
    def replay(
        self,
        microbatches: RoutesInput | Sequence[RoutesInput],
        *,
        payload_layers: Sequence[int] | None = None,
    ) -> Iterator[MegatronRecording]:
        """Force routes: one (N, L, K) or (S, B, L, K) int tensor per micro-batch, in router order.

        -1 rows fall back to the live router for that token only (`stats.fallback_rows`). Run the
        whole schedule (forwards, and backwards with their recomputes) inside the context.
        """
        items = [microbatches] if isinstance(microbatches, (torch.Tensor, np.ndarray)) else list(microbatches)
        if not items:
            raise ConfigError("replay() got no micro-batches; pass one routes tensor per micro-batch")
        routes = [self._prepare(i, item, payload_layers) for i, item in enumerate(items)]
        with self._session(Schedule(ReplayMode.REPLAY, self.layers, routes)) as recording:
            yield recording

    def detach(self) -> None:
        """Put every router's original `router_replay` back: the model is as before attach."""
        if self._schedule is not None:
            raise ReplayStateError("detach() inside a record/replay context; leave the context first")
        for hook in self._hooks:
            if hook.site.router.router_replay is hook:
                hook.site.router.router_replay = hook.original
        self._hooks.clear()

    def describe(self) -> str:
        chunks = sorted({s.chunk for s in self.sites})
        lines = [
            f"{len(self.sites)} TopKRouters bound (top-{self.top_k} of {self.num_experts}) in chunk(s) {chunks}, "
            f"0-based global layers {list(self.layers)} of {self.num_layers}"
        ]
        lines += [f"left natural: {r.name}: {r.reason}" for r in self.refused]
        return "\n".join(lines)

    # -- internals ---------------------------------------------------------------------------------
    @contextmanager
    def _session(self, schedule: Schedule) -> Iterator[MegatronRecording]:
        if not self._hooks:
            raise ReplayStateError("this MegatronReplayer is detached; attach_megatron(model) again")
        if self._schedule is not None:
            raise ReplayStateError(f"a {self.mode} context is already open; contexts do not nest")
        self._schedule, self.mode = schedule, schedule.mode
        clean = False
        try:
            yield MegatronRecording(schedule, self.layers, self.num_experts, self.stats)
            clean = True
        finally:
            self._schedule, self.mode = None, ReplayMode.OFF
            self._pending = self._pending or schedule.forwards > 0
        if clean:
            schedule.check_complete()

    def _prepare(
        self, index: int, item: RoutesInput, payload_layers: Sequence[int] | None
    ) -> dict[int, tuple[torch.Tensor, int]]:
        """One micro-batch's routes, checked, as {layer: (routes (N, K) long, count of -1 rows)}."""
        routes = routes_tensor(item, f"micro-batch {index}: routes array") if isinstance(item, np.ndarray) else item
        if not isinstance(routes, torch.Tensor):
            raise ConfigError(f"micro-batch {index}: routes must be an int tensor, got {type(item).__name__}")
        refuse_unreadable(routes, f"micro-batch {index} routes")
        if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
            raise DtypeError(f"micro-batch {index}: routes have dtype {routes.dtype}; expert ids are integers")
        if routes.dim() == 4:  # (S, B, L, K) sequence-first, as the router flattens hidden states
            routes = routes.reshape(routes.shape[0] * routes.shape[1], *routes.shape[2:])
        if routes.dim() != 3:
            raise BatchShapeError(
                f"micro-batch {index}: routes must be (N, L, K) in router order or (S, B, L, K), got "
                f"{tuple(routes.shape)}"
            )
        layers = resolve_payload_layers(
            routes.shape[1], payload_layers, bound=self.layers, num_layers=self.num_layers, moe_layers=self.moe_layers
        )
        if routes.shape[2] != self.top_k:
            raise TopKMismatchError(
                f"micro-batch {index}: routes have top-k {routes.shape[2]}, the routers use top-{self.top_k}"
            )
        selected = routes[:, [layers.index(layer) for layer in self.layers]].detach()
        host_NLK = selected.cpu().numpy()  # its own dtype: a uint64 id beyond int64 is refused, not wrapped to -1
        RouteTrace(host_NLK, self.num_experts, self.layers).validate(f"micro-batch {index} (router-order rows)")
        selected_NLK = selected.to(torch.long)
        fallbacks_L = (host_NLK[:, :, 0] < 0).sum(axis=0)
        return {layer: (selected_NLK[:, j].contiguous(), int(fallbacks_L[j])) for j, layer in enumerate(self.layers)}

    def _select(
        self,
        site: MegatronSite,
        scores_NE: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default: DefaultTopK,
        native: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        schedule, backward = self._schedule, in_backward()
        if schedule is None:
            if backward and self._pending:
                raise ReplayStateError(
                    f"layer {site.layer} ({site.name}) is recomputed during a backward that runs after its "
                    "record/replay context closed; it would route naturally. Run backward inside the context"
                )
            if not backward:
                self._pending = False  # a natural forward starts a natural pass
            if native is not None:  # Megatron's own RouterReplay keeps its actions (0.19 inference recording)
                return native.get_replay_topk(scores_NE, topk, num_groups, group_topk, default)
            return default(scores_NE, topk, num_groups=num_groups, group_topk=group_topk)
        self._check_slot(site, native)
        if scores_NE.is_cuda and torch.cuda.is_current_stream_capturing():
            raise KernelBypassError(
                f"layer {site.layer} ({site.name}) is being captured into a CUDA graph inside a {schedule.mode} "
                "context (0.19: inference_cuda_graph_scope, or cuda_graph_impl='local'); each replay of the graph "
                "would reuse this call's routes. Capture graphs with no routereplay context open, or set "
                "inference_cuda_graph_scope='none' / cuda_graph_impl='none'"
            )
        stats, rows = self.stats, scores_NE.shape[0]
        stats.router_calls += 1
        if backward:
            chosen_NK = schedule.recompute(site, rows)
            stats.recompute_calls += 1
        else:
            if schedule.mode is ReplayMode.RECORD:
                chosen_NK = self._live(scores_NE, topk, num_groups, group_topk, default)
                stats.recorded_rows += rows
            else:
                forced_NK, fallbacks = schedule.forced(site, rows)
                chosen_NK = forced_NK.to(scores_NE.device, non_blocking=True)
                if fallbacks:  # -1 rows: the live router decides for those tokens only
                    live_NK = self._live(scores_NE, topk, num_groups, group_topk, default)
                    chosen_NK = torch.where(chosen_NK[:, :1] < 0, live_NK, chosen_NK)
                    stats.fallback_rows += fallbacks
                    stats.fallback_rows_by_layer[site.layer] = (
                        stats.fallback_rows_by_layer.get(site.layer, 0) + fallbacks
                    )
                stats.replayed_rows += rows - fallbacks
            schedule.used[site.layer].append(chosen_NK)
            if len(schedule.used[site.layer]) > schedule.forwards:
                schedule.forwards += 1
                stats.forwards += 1
        # one path for every mode: ids without autograd, values by gather, so gradients reach the
        # scores and a recompute saves exactly the tensors its forward saved
        return scores_NE.gather(1, chosen_NK), chosen_NK

    @staticmethod
    def _check_slot(site: MegatronSite, native: Any) -> None:
        """Inside a context: the router still has its bound layer, and Megatron's own replay is idle."""
        number = site.router.layer_number
        if number != site.layer + 1:
            raise LayerRenumberedError(
                f"{site.name} was bound as 0-based layer {site.layer} but its layer_number is now {number!r} "
                "(set_layer_number after attach); it would replay another layer's routes. detach() and "
                "attach_megatron(model) again after renumbering"
            )
        action = getattr(native, "router_replay_action", None)
        if action is not None:
            raise NativeReplayConflictError(
                f"{site.name}: Megatron's own RouterReplay action is {getattr(action, 'name', action)} while a "
                "routereplay context drives this router; clear it (RouterReplay.clear_global_router_replay_action())"
                " or run Megatron's replay outside the context"
            )

    @staticmethod
    def _live(
        scores_NE: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None, default: DefaultTopK
    ) -> torch.Tensor:
        # detached scores (nothing saved for autograd, so a checkpoint recompute saves what its forward
        # saved) but the caller's grad mode, as Megatron's own call: 0.19 sorts the top-k only with grad on
        return default(scores_NE.detach(), topk, num_groups=num_groups, group_topk=group_topk)[1].to(torch.long)


def attach_megatron(model: nn.Module | Sequence[nn.Module], *, strict: bool = True) -> MegatronReplayer:
    """Bind every TopKRouter of a Megatron-core model (or its list of virtual-pipeline chunks).

    `strict=False` binds the routers it can and leaves the others natural (listed in `.refused`).
    """
    return MegatronReplayer(model, strict=strict)


__all__ = ["MegatronReplayer", "attach_megatron"]
