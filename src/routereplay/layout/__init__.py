"""Training layouts: routes moved into the token and layer order a trainer uses, and back.

Every transform is vectorised (one gather or scatter, no Python loop per token), takes numpy or
torch and returns the same type, and has an inverse:

- ragged <-> padded (left, right, attention mask): `unpad`, `pad`
- ragged <-> packed THD row in the trainer's order: `pack`, `unpack`
- Ulysses SP, TP-SP scatter, CP zigzag (padded and packed), contiguous splits, sequence-first order
- PP / VPP stage slicing by global layer number, all-layer vs MoE-only payloads: `LayerMap`,
  `PipelineLayout`
- plans (`layout.plan`): run a chain on `token_index(B, S)`, then move the routes once with `gather`
"""

from routereplay.layout import plan
from routereplay.layout.packing import Packed, pack, unpack
from routereplay.layout.padding import Side, attention_mask_of, pad, unpad
from routereplay.layout.parallel import (
    contiguous_shard,
    contiguous_unshard,
    from_router_order,
    from_sequence_first,
    packed_zigzag_index,
    packed_zigzag_shard,
    packed_zigzag_unshard,
    sequence_parallel_scatter,
    to_router_order,
    to_sequence_first,
    ulysses_shard,
    ulysses_unshard,
    zigzag_shard,
    zigzag_unshard,
)
from routereplay.layout.pipeline import LayerKind, LayerMap, PipelineLayout
from routereplay.layout.plan import gather, token_index
from routereplay.layout.ragged import Ragged, cu_seqlens_of, from_traces, to_traces

__all__ = [
    "LayerKind",
    "LayerMap",
    "Packed",
    "PipelineLayout",
    "Ragged",
    "Side",
    "attention_mask_of",
    "contiguous_shard",
    "contiguous_unshard",
    "cu_seqlens_of",
    "from_router_order",
    "from_sequence_first",
    "from_traces",
    "gather",
    "pack",
    "packed_zigzag_index",
    "packed_zigzag_shard",
    "packed_zigzag_unshard",
    "pad",
    "plan",
    "sequence_parallel_scatter",
    "to_router_order",
    "to_sequence_first",
    "to_traces",
    "token_index",
    "ulysses_shard",
    "ulysses_unshard",
    "unpack",
    "unpad",
    "zigzag_shard",
    "zigzag_unshard",
]
