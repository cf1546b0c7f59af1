"""How an SGLang MoE layer weighs its top-k, so a forced row gets the weights the layer's own method gives those ids.

`rule_of(topk_config)` reads one layer's `sglang.srt.layers.moe.topk.TopKConfig` and returns the `TopKRule` its
weights follow, or None and the reason it cannot be forced. Read from the SGLang 0.5.23 wheel
(`layers/moe/topk.py`, `select_experts` and the functions it dispatches to); every path that reaches
`_post_process_topk_ids` with a standard output computes the routed weights the same way:

    scores = softmax(logits) | sigmoid(logits)        (all experts; a correction bias steers selection only)
    w      = scores.gather(ids)
    w      = w / (w.sum(float32) + 1e-20)             if renormalize
    w      = w * routed_scaling_factor                if apply_routed_scaling_factor_on_output
    float32

- `fused_topk_torch_native` (`TopKConfig(torch_native=True)`, CPU without AMX): softmax / sigmoid top-k, with or
  without `correction_bias`; the scale is folded after routing when applied on the output.
- `grouped_topk_gpu` (`use_grouped_topk`, no bias; DeepSeek-V2): the group limit steers selection only.
- `biased_grouped_topk_gpu` / `biased_grouped_topk_impl` (`use_grouped_topk` + `correction_bias`, DeepSeek-V3):
  sigmoid scores, the bias and the group limit steer selection only.
- `fused_topk` (CUDA Triton gate, `topk_softmax` / `topk_sigmoid`): the same formula in float32.
The rule computes in float32 (the CUDA gates do; the CPU torch-native path does for unbiased softmax): with
float32 logits it is the router's arithmetic, with bf16 logits it matches to the router's own rounding.

Refused, by name: `custom_routing_function` (a model's own routing, weights not reproduced here); scoring other
than softmax / sigmoid (DeepSeek-V4 `sqrtsoftplus`); fused shared experts (`num_shared_topk_slots` > 0: extra id
columns after the top-k, and Waterfill appends them after `select_experts`); `fused_gate_packed_ids` (FlashInfer
packed ids computed before the hook, so the kernel would read the live ids); the BYPASSED and TRITON_KERNEL output
formats (FlashInfer TRT-LLM / mxfp4 and triton_kernels route inside the kernel and never reach
`_post_process_topk_ids`); FlashInfer TRT-LLM "routed" raw-logit softmax; ROCm AITER (`SGLANG_USE_AITER`: shared
columns and folded scales inside the gate).

Legend: N = token rows, E = experts, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

RENORMALIZE_EPSILON = 1e-20  # SGLang 0.5.23 `topk._RENORMALIZE_SUM_EPSILON`
SCORINGS = ("softmax", "sigmoid")
KERNEL_FORMATS = ("BYPASSED", "TRITON_KERNEL")  # TopKOutputFormat names that route inside the MoE kernel


@dataclass(frozen=True, slots=True)
class TopKRule:
    """One layer's routing method: scoring, renormalisation and the scale applied on the output."""

    scoring: str
    renormalize: bool
    scale: float = 1.0  # routed_scaling_factor when applied on the output, else 1.0

    def weights(self, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """The float32 gate weights (N x K) of rows routed to `experts_NK` (any integer dtype), from the live
        logits. Tensor ops only, no branch on tensor values."""
        logits_NE = logits_NE.float()
        scores_NE = torch.softmax(logits_NE, dim=-1) if self.scoring == "softmax" else logits_NE.sigmoid()
        weights_NK = scores_NE.gather(1, experts_NK.long())
        if self.renormalize:
            total_N1 = weights_NK.sum(dim=-1, keepdim=True, dtype=torch.float32)
            weights_NK = weights_NK / (total_N1 + RENORMALIZE_EPSILON)
        if self.scale != 1.0:
            weights_NK = weights_NK * self.scale
        return weights_NK.to(torch.float32)


def rule_of(topk_config: Any, *, use_aiter: bool = False) -> tuple[TopKRule | None, str]:
    """The rule a layer's `TopKConfig` routes by, or None and the reason it cannot be forced (module docstring)."""
    try:
        scoring = str(topk_config.scoring_func)
        renormalize = bool(topk_config.renormalize)
        custom = topk_config.custom_routing_function
        shared = int(topk_config.num_shared_topk_slots)
        packed = bool(topk_config.fused_gate_packed_ids)
        output_format = topk_config.output_format
        scale_on_output = bool(topk_config.apply_routed_scaling_factor_on_output)
        factor = topk_config.routed_scaling_factor
        backend = topk_config.runner_backend
        grouped, native, bias = topk_config.use_grouped_topk, topk_config.torch_native, topk_config.correction_bias
    except AttributeError as error:
        return None, f"TopKConfig lacks the setting {error.name!r} its weights depend on (another SGLang than 0.5.23?)"
    name = getattr(output_format, "name", None)
    if name in KERNEL_FORMATS:
        return (
            None,
            f"top-k output format {name}: the MoE kernel routes itself (FlashInfer TRT-LLM / mxfp4, triton_kernels)",
        )
    if use_aiter:
        return None, "ROCm AITER routing (SGLANG_USE_AITER) folds shared columns and scales inside the gate"
    if custom is not None:
        where = f"{getattr(custom, '__module__', '?')}.{getattr(custom, '__qualname__', repr(custom))}"
        return None, f"the custom routing function {where} (its weights are not reproduced)"
    if scoring not in SCORINGS:
        return None, f"scoring {scoring!r} (only softmax and sigmoid are reproduced)"
    if shared:
        return None, f"{shared} fused shared-expert column(s) after the top-k"
    if packed:
        return None, "fused_gate_packed_ids: the FlashInfer packed ids are computed before the hook"
    trtllm_routed = getattr(backend, "is_flashinfer_trtllm_routed", None)
    if (
        callable(trtllm_routed)
        and trtllm_routed()
        and not (grouped or native)
        and scoring == "softmax"
        and bias is None
    ):
        return None, "FlashInfer TRT-LLM routed raw-logit softmax"
    scale = float(factor) if scale_on_output and factor is not None else 1.0
    return TopKRule(scoring, renormalize, scale), ""


__all__ = ["RENORMALIZE_EPSILON", "TopKRule", "rule_of"]
