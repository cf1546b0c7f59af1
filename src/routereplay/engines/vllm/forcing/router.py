"""Forcing inside one vLLM MoE layer's router: forced rows dispatched to the forced experts, weighted live.

Every MoE layer of vLLM 0.30-0.33 routes through `BaseRouter._select_experts`, which calls the router's own
`_compute_routing(hidden_states, router_logits, indices_type, input_ids=...) -> (topk_weights, topk_ids)`,
then hands the ids to vLLM's routed-experts capture (`capture_fn`), then to the EPLB logical-to-physical
map, then to the experts. `LayerForcing.install` wraps that `_compute_routing` on the router instance: the
live routing runs for every row, then the rows the step forces for this layer get the forced ids and the
gate weights this router's own method gives them from the live logits (`rule.RoutingRule`). So the
experts run on the forced set, the capture reports exactly what was dispatched, EPLB maps forced ids like
live ones, and rows without forced routes keep their live result untouched.

Two ways to say which rows a step forces:
- `ForcingBuffers` (`install(buffers)`, vLLM 0.31-0.33, Model Runner V2, CUDA graphs): the wrapper reads
  the fixed-address `ids_TLK[:n, column]` / `mask_TL[:n, column]` and applies `op.force_topk` (where /
  gather, no host sync, no branch on tensor values), so it is right eagerly, under `torch.compile` and
  replayed from a CUDA graph. A router `rule_of` refuses (`unsupported` says why) passes through live:
  the caller must refuse such a model at start-up by name (`LayerForcing.unsupported`), because nothing
  can be counted per step without a host sync. With `capture_weights` buffers, the combine weights
  returned (after forcing) are also written in place into `buffers.weights_TLK`.
- `StepRows` (`layer.step`, vLLM 0.30's V1 worker, eager): the step's rows and ids, indexed in place;
  rows asked of a router that cannot be forced route live, are counted and logged, and the engine's
  client sees the capture differ from what it asked (`ForcingNotAppliedError`). With `keep` set for the
  step (some request asks for its combine weights, `forcing.weights`), the (weights, ids) returned after
  forcing are kept in `kept` for the worker to read once the forward has run.

Legend: N = rows of this step forced in this layer (StepRows) or all rows of the step (buffers), E = experts,
K = top-k, T = token rows of the largest step, L = MoE layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from routereplay.engines.vllm.forcing.buffers import ForcingBuffers
from routereplay.engines.vllm.forcing.op import force_topk
from routereplay.engines.vllm.forcing.rule import RoutingMethod, RoutingRule, rule_of
from routereplay.errors import ForcedRoutesError

LOG = logging.getLogger("routereplay.vllm.forcing")
ComputeRouting = Callable[..., tuple[torch.Tensor, torch.Tensor]]
WRAPPED_MARK = "_routereplay_forcing"  # set on a wrapped `_compute_routing`, so a router is wrapped once


@dataclass(slots=True)
class StepRows:
    """One layer's forced rows in the current step: batch row indices (N) and their experts (N x K, in the
    forced trace's own dtype, int16 for E <= 32767; widened only where the routing step needs it)."""

    rows_N: torch.Tensor
    experts_NK: torch.Tensor


@dataclass(slots=True)
class LayerForcing:
    """One MoE layer: its router, the rule its weights follow, and the rows the current step forces."""

    layer: int
    router: Any
    rule: RoutingRule | None
    unsupported: str = ""
    step: StepRows | None = None
    buffers: ForcingBuffers | None = field(default=None, repr=False)
    column: int = -1  # this layer's column in `buffers`
    forced_rows: int = 0  # rows dispatched to forced experts so far
    live_fallback_rows: int = 0  # rows asked to be forced but routed live (unsupported router)
    original: ComputeRouting | None = field(default=None, repr=False)
    keep: bool = False  # StepRows path: keep this step's returned (weights, ids) in `kept` (weights capture)
    kept: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, layer: int, router: Any) -> LayerForcing:
        rule, reason = rule_of(router)
        return cls(layer, router, rule, reason)

    def install(self, buffers: ForcingBuffers | None = None) -> None:
        """Wrap the router's `_compute_routing` (once; a router wrapped before keeps its first wrapper). With
        `buffers`, the wrapper forces the rows they mask for this layer (graph-safe); else `step`'s rows."""
        if buffers is not None:
            if self.layer not in buffers.column:
                raise ForcedRoutesError(
                    f"MoE layer {self.layer} has no column in the forcing buffers (layers {buffers.moe_layers}); "
                    "size ForcingBuffers by every MoE layer the model routes"
                )
            top_k = getattr(self.router, "top_k", buffers.top_k)
            if top_k != buffers.top_k:
                raise ForcedRoutesError(
                    f"MoE layer {self.layer} routes top-{top_k} but the forcing buffers hold top-{buffers.top_k} "
                    "ids; size ForcingBuffers by the model's top-k"
                )
            self.buffers, self.column = buffers, buffers.column[self.layer]
        current = self.router._compute_routing
        if getattr(current, WRAPPED_MARK, None) is not None:
            self.original = getattr(current, WRAPPED_MARK)
        else:
            self.original = current
        forcing = self

        def compute_routing(
            hidden_states: torch.Tensor, router_logits: torch.Tensor, indices_type: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return forcing.route(hidden_states, router_logits, indices_type, **kwargs)

        setattr(compute_routing, WRAPPED_MARK, self.original)
        self.router._compute_routing = compute_routing

    def route(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, indices_type: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The live routing, with this step's forced rows replaced (module docstring)."""
        assert self.original is not None
        weights_NK, ids_NK = self.original(hidden_states, router_logits, indices_type, **kwargs)
        buffers = self.buffers
        if buffers is not None:
            if self.rule is None:  # refused at start-up by the caller (`unsupported`); no per-step count here
                return weights_NK, ids_NK
            rows = ids_NK.shape[0]
            if rows > buffers.max_tokens:  # a shape, not a value: fixed at trace and capture time
                raise ForcedRoutesError(
                    f"MoE layer {self.layer} routes {rows} token rows, more than the forcing buffers' "
                    f"{buffers.max_tokens}; size ForcingBuffers by the engine's largest step (max_num_batched_tokens, "
                    "or the largest CUDA-graph size if larger)"
                )
            forced_NK = buffers.ids_TLK[:rows, self.column]
            weights_NK, ids_NK = force_topk(
                weights_NK, ids_NK, router_logits, forced_NK, buffers.mask_TL[:rows, self.column], self.rule
            )
            if buffers.weights_TLK is not None:  # the combine weights dispatched, kept for the worker (in place)
                buffers.weights_TLK[:rows, self.column].copy_(weights_NK)
            return weights_NK, ids_NK
        weights_NK, ids_NK = self._forced_step(weights_NK, ids_NK, router_logits)
        if self.keep:  # what `_select_experts` hands to the capture and the experts, in the router's order
            self.kept = (weights_NK, ids_NK)
        return weights_NK, ids_NK

    def _forced_step(
        self, weights_NK: torch.Tensor, ids_NK: torch.Tensor, router_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The live routing with `step`'s rows forced (vLLM 0.30's V1 worker, eager)."""
        step = self.step
        if step is None or step.rows_N.numel() == 0:
            return weights_NK, ids_NK
        if self.rule is None:
            if self.live_fallback_rows == 0:
                LOG.error(
                    "routereplay: layer %d cannot be forced (%s); its forced rows route live, and the client that "
                    "asked sees the capture differ (ForcingNotAppliedError)",
                    self.layer,
                    self.unsupported,
                )
            self.live_fallback_rows += int(step.rows_N.numel())
            return weights_NK, ids_NK
        rows_N = step.rows_N
        experts_NK = step.experts_NK.to(router_logits.device)
        forced_NK = self.rule.weights(router_logits[rows_N], experts_NK)
        weights_NK = weights_NK.clone()
        ids_NK = ids_NK.clone()
        weights_NK[rows_N] = forced_NK.to(weights_NK.dtype)
        ids_NK[rows_N] = experts_NK.to(ids_NK.dtype)
        self.forced_rows += int(rows_N.numel())
        return weights_NK, ids_NK


__all__ = ["LayerForcing", "RoutingMethod", "RoutingRule", "StepRows", "rule_of"]
