"""verl's Megatron router-replay helper path with routereplay's `attach_megatron` in place of its patch.

verl 0.9.1's `MegatronEngineWithLMHead.forward_step` (engine/megatron/transformer_impl.py l.1301-1320)
aligns the micro-batch's jagged `routed_experts` (`align_r3_router_replay_data`), builds the R3
replay mask (`build_r3_replay_mask`: every row but each sequence's final one) and hands both to
`set_router_replay_data`, which packs them like the model input (`preprocess_thd_engine`), scatters
them over TP-SP ranks and calls `router.router_replay.set_target_indices(idx_NK, mask_N)` on each
router of the forwarded model. Here that last call lands on a `TargetCapture` per router (the
object in the slot verl writes to), and the captured targets become one (N, L, K) router-order
micro-batch for `attach_megatron(block).replay(...)`: masked rows -1, which routereplay serves live.
The block is docs/megatron.md's dense-first Megatron `TransformerBlock` on a one-rank gloo world.

Legend: B = sequences, j = their lengths (jagged), N = packed tokens a router sees, P = payload
layers (all 4 decoder layers), L = MoE layers (3), K = top-k, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.runtime.megatron_models import MOE_LAYERS as MOE_LAYERS  # the test reads it here
from tests.runtime.megatron_models import E, H, K, build_block, make_config

NUM_LAYERS, EXPERTS, TOP_K, HIDDEN = 4, E, K, H  # tests/runtime/megatron_models.py's block (layer 0 dense)


@dataclass(slots=True)
class TargetCapture:
    """Stands in the `router.router_replay` slot verl's `set_router_replay_data` writes to."""

    targets: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def set_target_indices(self, topk_indices: torch.Tensor, replay_mask: torch.Tensor | None = None) -> None:
        self.targets.append((topk_indices, replay_mask))


def megatron_block() -> tuple[nn.Module, Any]:
    """The dense-first block of the Megatron adapter's tests, and its config."""
    config = make_config()
    return build_block(config), config


def routers(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if type(m).__name__ == "TopKRouter"]


def verl_targets(
    block: nn.Module, config: Any, routed_BjPK: torch.Tensor, input_ids_Bj: torch.Tensor, response_mask_BR: torch.Tensor
) -> torch.Tensor:
    """(N, L, K): what verl's R3 helper path sets on each router, masked rows as -1."""
    import verl.utils.megatron.router_replay_utils as rr_utils

    aligned = rr_utils.align_r3_router_replay_data(routed_BjPK, input_ids_Bj)
    mask = rr_utils.build_r3_replay_mask(input_ids_Bj, response_mask_BR)
    slots = {}
    for router in routers(block):
        slots[router] = router.router_replay
        router.router_replay = TargetCapture()
    try:
        rr_utils.set_router_replay_data(aligned, None, config, 0, replay_mask=mask, model=block)
        columns = []
        for router in routers(block):
            ((idx_NK, mask_N),) = router.router_replay.targets
            columns.append(torch.where(mask_N.bool().unsqueeze(-1), idx_NK, torch.full_like(idx_NK, -1)))
    finally:
        for router, slot in slots.items():
            router.router_replay = slot
    return torch.stack(columns, dim=1)
