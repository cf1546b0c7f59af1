"""Forcing inside one vLLM MoE layer's router: forced rows dispatched to the forced experts, weighted live.

Every MoE layer of vLLM 0.30 routes through `BaseRouter._select_experts`, which calls the router's own
`_compute_routing(hidden_states, router_logits, ...) -> (topk_weights, topk_ids)`, then hands the ids
to vLLM's routed-experts capture, then to the experts. `LayerForcing.install` wraps that
`_compute_routing` on the router instance: the live routing runs for every row, then the rows the step
forces for this layer get the forced ids and gate weights computed by this router's own routing
function from the live logits over the forced set. So the experts run on the forced set, the capture
reports exactly what was dispatched, and rows without forced routes keep their live result untouched.

Gate weights of a forced row, by the router's routing method (vLLM's `CPURouter`, the router of every
MoE layer on CPU; the same arithmetic as its `_softmax_topk` / `_grouped_topk`):
- softmax top-k, renormalised: softmax over the forced logits (in the logits' dtype, as vLLM);
- softmax top-k, not renormalised: exp(logit - logsumexp(all logits));
- grouped top-k (DeepSeek-V3: sigmoid or softmax scores, correction bias, expert groups): the
  unbiased scores at the forced ids, renormalised when the router renormalises, times
  `routed_scaling_factor`. Bias and group limits only choose experts; the forced set is the choice.
Other routing methods (DeepSeek-V4's sqrtsoftplus and hash routing, custom routing functions, GPU
routers) are not forced: `unsupported` names why, the worker counts their rows and routes them live,
and the engine's client sees the capture differ from what it asked (`ForcingNotAppliedError`).

Legend: N = rows of this step forced in this layer, E = experts, K = top-k.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from routereplay.enums import StrEnum

LOG = logging.getLogger("routereplay.vllm.forcing")
ComputeRouting = Callable[..., tuple[torch.Tensor, torch.Tensor]]
WRAPPED_MARK = "_routereplay_forcing"  # set on a wrapped `_compute_routing`, so a router is wrapped once


class RoutingMethod(StrEnum):
    """How a router turns logits into top-k weights (the forced weights follow the same method)."""

    SOFTMAX_TOPK = "softmax_topk"
    GROUPED_TOPK = "grouped_topk"


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """A router's routing method and the settings its weights depend on."""

    method: RoutingMethod
    renormalize: bool
    scoring: str = "softmax"  # grouped top-k: "softmax" or "sigmoid"
    routed_scaling_factor: float = 1.0

    def weights(self, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """The gate weights (float32, N x K) of rows routed to `experts_NK` (any integer dtype: the worker keeps
        forced ids in the trace's int16), from the live logits."""
        experts_NK = experts_NK.long()  # gather's index dtype; a no-op for int64 ids
        if self.method is RoutingMethod.SOFTMAX_TOPK:
            chosen_NK = logits_NE.gather(1, experts_NK)
            if self.renormalize:
                return torch.softmax(chosen_NK, dim=-1).to(torch.float32)
            log_z_N1 = torch.logsumexp(logits_NE, dim=-1, keepdim=True)
            return (chosen_NK - log_z_N1).exp().to(torch.float32)
        logits_NE = logits_NE.float()
        scores_NE = torch.softmax(logits_NE, dim=-1) if self.scoring == "softmax" else logits_NE.sigmoid()
        weights_NK = scores_NE.gather(1, experts_NK)
        if self.renormalize:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights_NK = weights_NK * self.routed_scaling_factor
        return weights_NK


def rule_of(router: Any) -> tuple[RoutingRule | None, str]:
    """The rule a vLLM router routes by, or None and the reason it cannot be forced."""
    kind = type(router).__name__
    if kind != "CPURouter":
        return None, f"router {kind} is not vLLM's CPURouter (only the CPU routing methods are forced)"
    if getattr(router, "eplb_state", None) is not None:
        return None, "expert-parallel load balancing maps logical to physical experts after routing"
    scoring = str(getattr(router, "scoring_func", "softmax"))
    renormalize = bool(getattr(router, "renormalize", True))
    if getattr(router, "use_grouped_topk", False):
        if scoring not in ("softmax", "sigmoid"):
            return None, f"grouped top-k with scoring {scoring!r}"
        scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
        return RoutingRule(RoutingMethod.GROUPED_TOPK, renormalize, scoring, scale), ""
    if scoring == "sqrtsoftplus":
        return None, "DeepSeek-V4 sqrtsoftplus / hash routing"
    if getattr(router, "custom_routing_function", None) is not None:
        return None, "a custom routing function"
    if scoring != "softmax":
        return None, f"scoring {scoring!r}"
    return RoutingRule(RoutingMethod.SOFTMAX_TOPK, renormalize), ""


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
    forced_rows: int = 0  # rows dispatched to forced experts so far
    live_fallback_rows: int = 0  # rows asked to be forced but routed live (unsupported router)
    original: ComputeRouting | None = field(default=None, repr=False)

    @classmethod
    def of(cls, layer: int, router: Any) -> LayerForcing:
        rule, reason = rule_of(router)
        return cls(layer, router, rule, reason)

    def install(self) -> None:
        """Wrap the router's `_compute_routing` (once; a router wrapped before keeps its first wrapper)."""
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
