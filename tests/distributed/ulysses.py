"""Ulysses sequence-parallel attention for an HF transformers model, through its AttentionInterface.

Each rank holds a contiguous shard of every sequence's positions. Attention needs all positions, so
the function registered here trades the sequence split for a head split and back:

    q/k/v  (B, H, s, D) seq-sharded  --all-to-all-->  (B, h, S, D) head-sharded
    causal SDPA over the full sequence on the local heads
    out    (B, h, S, D) head-sharded --all-to-all-->  (B, H, s, D) seq-sharded

The all-to-all is `torch.distributed.nn.functional.all_to_all` (list form), which has an autograd
rule (its backward is the reverse all-to-all) and runs on gloo, so gradients of queries, keys and
values flow back to the ranks that own those positions. Heads are split in contiguous blocks, so
with grouped-query attention each rank keeps the kv heads of its own query heads (H and G must
both be multiples of P). By default no mask is built or used: HF builds none for an attention name
it has no mask function for, and the only padding allowed is at the end of the sequence, which a
causal attention never lets a real position see. A caller whose rows are packed passes `mask_of`,
which builds the full-sequence mask from the attention call's keyword arguments (verl's packed rows:
tests/integrations/verl/fsdp_ulysses.py). The caller passes global `position_ids` for RoPE.

Legend: B = batch rows, S = global positions (padded to a multiple of P), s = S / P positions of a
shard, H = query heads, G = kv heads, h = H / P and g = G / P heads of a rank, D = head dim,
P = ranks in the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

ATTENTION_NAME = "routereplay_test_ulysses"

AttentionFn = Callable[..., tuple[torch.Tensor, None]]
MaskFn = Callable[[dict[str, Any]], torch.Tensor]  # attention kwargs -> (B, 1, S, S) bool mask


def _all_to_all(chunks: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Send chunks[j] to rank j; element i of the result came from rank i (differentiable)."""
    inputs = [chunk.contiguous() for chunk in chunks]  # gloo copies raw memory: dense row-major buffers
    outputs = [torch.empty_like(chunk) for chunk in inputs]
    return list(dist_fn.all_to_all(outputs, inputs, group=group))


def seq_to_heads(x_BHsD: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, H, s, D) sequence shard of all heads -> (B, H/P, S, D) all positions of this rank's heads."""
    world = dist.get_world_size(group)
    if x_BHsD.shape[1] % world:
        raise ValueError(f"{x_BHsD.shape[1]} heads cannot be split over {world} ranks; use a multiple of {world}")
    received = _all_to_all(list(x_BHsD.chunk(world, dim=1)), group)  # [i]: rank i's positions, my heads
    return torch.cat(received, dim=2)


def heads_to_seq(x_BhSD: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, H/P, S, D) all positions of this rank's heads -> (B, H, s, D) this rank's positions, all heads."""
    world = dist.get_world_size(group)
    received = _all_to_all(list(x_BhSD.chunk(world, dim=2)), group)  # [i]: my positions, rank i's heads
    return torch.cat(received, dim=1)


def ulysses_attention(group: dist.ProcessGroup | None = None, mask_of: MaskFn | None = None) -> AttentionFn:
    """An HF attention function (AttentionInterface signature) doing Ulysses SP over `group`: causal, or
    masked by `mask_of(kwargs)` over the full sequence."""

    def attention(
        module: nn.Module,
        query_BHsD: torch.Tensor,
        key_BGsD: torch.Tensor,
        value_BGsD: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError("Ulysses attention here is causal over the full sequence; pass no attention_mask")
        if dropout:
            raise ValueError(f"attention dropout {dropout} would differ per rank; set attention_dropout=0")
        if kwargs.get("sliding_window") is not None:
            raise ValueError("sliding-window attention is not supported by this Ulysses attention")
        mask = None if mask_of is None else mask_of(kwargs)
        query_BhSD = seq_to_heads(query_BHsD, group)
        key_BgSD, value_BgSD = seq_to_heads(key_BGsD, group), seq_to_heads(value_BGsD, group)
        out_BhSD = nn.functional.scaled_dot_product_attention(
            query_BhSD,
            key_BgSD,
            value_BgSD,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=query_BhSD.shape[1] != key_BgSD.shape[1],
        )
        out_BHsD = heads_to_seq(out_BhSD, group)
        return out_BHsD.transpose(1, 2).contiguous(), None  # HF expects (B, s, H, D)

    return attention


def use_ulysses(
    model: nn.Module, group: dist.ProcessGroup | None = None, name: str = ATTENTION_NAME, mask_of: MaskFn | None = None
) -> None:
    """Register the Ulysses attention under `name` (this process only) and switch `model` to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, ulysses_attention(group, mask_of))
    model.set_attn_implementation(name)  # type: ignore[operator]
