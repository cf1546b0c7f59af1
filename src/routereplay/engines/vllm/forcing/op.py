"""The forcing op: a router's live top-k with the masked rows replaced by forced ids and their weights.

`force_topk` is what a wrapped router runs after its live routing when it reads `ForcingBuffers`. It is
tensor ops only (`where`, `clamp`, `gather`, the rule's softmax / sigmoid), with no host sync, no Python
branch on tensor values and no shape that depends on them: every row is computed and the mask picks.
So the same code is right eagerly, traced by `torch.compile` (the buffers' contents change between calls
without a recompile), and replayed from a CUDA graph captured once (the buffers' addresses are fixed).

A forced row whose forced set is the router's own live choice (in any order) keeps the router's own
weights, reordered to the forced order: bit-identical to the unforced router, whose kernel (CUDA, or
Inductor-compiled) may round its softmax an ulp away from the rule's eager formula. Other forced rows get
`rule.weights`: the method's weights for those ids, to float rounding of the router's own kernel.

The gather index is the dispatched id (forced where masked, live elsewhere) clamped into [0, E): a live
row may carry -1 (vLLM's padding rows under `VLLM_MOE_SKIP_PADDING`), and a CUDA gather out of range
is a device-side assert; the weights of unforced rows are discarded by the mask anyway. The forced ids
themselves are checked against the model before they reach the buffers (`ForcedRoutes.check`).

Importing this module does not import vLLM (the CUDA-graph test runs it on a device without vLLM). The SGLang
plugin forces with the same op (`engines/sglang/forcing/hooks.py`, inside SGLang's `_post_process_topk_ids`,
before routed-experts capture and the EPLB remap), its `TopKRule` standing for `RoutingRule`: any `WeightsRule`.

Legend: N = token rows of the step, E = experts, K = top-k.
"""

from __future__ import annotations

from typing import Protocol

import torch


class WeightsRule(Protocol):
    """A layer's routing method as the op needs it: the gate weights it gives chosen ids (vLLM's `RoutingRule`,
    SGLang's `TopKRule`)."""

    def weights(self, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor: ...


def force_topk(
    weights_NK: torch.Tensor,
    ids_NK: torch.Tensor,
    logits_NE: torch.Tensor,
    forced_NK: torch.Tensor,
    mask_N: torch.Tensor,
    rule: WeightsRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights_NK, ids_NK)` with each row where `mask_N` is True replaced by `forced_NK` and the weights `rule`
    gives those ids from `logits_NE`; other rows come back bit-identical. Dtypes and shapes are the live ones."""
    mask_N1 = mask_N[:, None]
    forced_NK = forced_NK.to(ids_NK.dtype)
    # where the forced set is the live one (in any order), the live weights, reordered: bit-identical to the router
    same_NKK = forced_NK[:, :, None] == ids_NK[:, None, :]
    live_NK = weights_NK.gather(1, same_NKK.to(torch.int8).argmax(dim=-1))
    own_N1 = same_NKK.any(dim=-1).all(dim=-1, keepdim=True)
    new_ids_NK = torch.where(mask_N1, forced_NK, ids_NK)
    index_NK = new_ids_NK.clamp(0, logits_NE.shape[-1] - 1)
    forced_weights_NK = torch.where(own_N1, live_NK, rule.weights(logits_NE, index_NK).to(weights_NK.dtype))
    return torch.where(mask_N1, forced_weights_NK, weights_NK), new_ids_NK


__all__ = ["WeightsRule", "force_topk"]
