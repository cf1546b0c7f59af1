"""The forcing op: one layer's live top-k with the masked rows replaced by forced ids and their weights.

`force_rows` runs inside SGLang's `_post_process_topk_ids` (before routed-experts capture and the EPLB
logical-to-physical remap). Tensor ops only (`where`, `clamp`, `gather`, the rule's softmax / sigmoid): no host
sync, no Python branch on tensor values, no per-row Python; every row is computed and the mask picks, so rows
outside the mask come back bit-identical (same dtype, same values).

As in the vLLM plugin (`engines/vllm/forcing/op.py`): a forced row whose forced set is the router's own live
choice (in any order) keeps the router's own weights, reordered to the forced order, so forcing a row to what it
would have routed changes nothing; other forced rows get `rule.weights` (forcing/rule.py). The gather index is
clamped into [0, E): a live padded row may carry -1; those rows' weights are discarded by the mask.

Legend: N = token rows of the step, E = experts, K = top-k.
"""

from __future__ import annotations

import torch

from routereplay.engines.sglang.forcing.rule import TopKRule


def force_rows(
    weights_NK: torch.Tensor,
    ids_NK: torch.Tensor,
    logits_NE: torch.Tensor,
    forced_NK: torch.Tensor,
    mask_N: torch.Tensor,
    rule: TopKRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights_NK, ids_NK)` with each row where `mask_N` is True replaced by `forced_NK` and the weights `rule`
    gives those ids from `logits_NE`; other rows bit-identical. Dtypes and shapes are the live ones."""
    mask_N1 = mask_N[:, None]
    forced_NK = forced_NK.to(ids_NK.dtype)
    same_NKK = forced_NK[:, :, None] == ids_NK[:, None, :]
    live_NK = weights_NK.gather(1, same_NKK.to(torch.int8).argmax(dim=-1))
    own_N1 = same_NKK.any(dim=-1).all(dim=-1, keepdim=True)
    new_ids_NK = torch.where(mask_N1, forced_NK, ids_NK)
    index_NK = new_ids_NK.clamp(0, logits_NE.shape[-1] - 1)
    forced_weights_NK = torch.where(own_N1, live_NK, rule.weights(logits_NE, index_NK).to(weights_NK.dtype))
    return torch.where(mask_N1, forced_weights_NK, weights_NK), new_ids_NK


__all__ = ["force_rows"]
