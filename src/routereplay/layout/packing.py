"""Packing: sequences concatenated into one THD row in the order the trainer packs them.

Megatron-core and flash-attention varlen take a packed micro-batch as one row of tokens plus
`cu_seqlens`; with context parallelism every sequence is padded to a multiple of 2 x cp
(`cu_seqlens_padded`). `pack` builds that row from ragged routes in any order (the trainer's
balanced micro-batch order, a subset of the batch), `unpack` undoes it. Both are one gather.

Legend: B = packed sequences, N = their tokens, P = packed rows including per-sequence padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic

import numpy as np
import torch

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout.array import Array, as_tensor, like, select, take
from routereplay.layout.ragged import Ragged, check_order, cu_seqlens_of, token_starts


@dataclass(frozen=True, slots=True)
class Packed(Generic[Array]):
    """One packed row: sequence `order[i]` of the source batch sits at rows
    `cu_seqlens_padded[i] : cu_seqlens_padded[i] + lengths[i]`, padding after it is -1."""

    values: Array
    cu_seqlens_padded: torch.Tensor
    lengths: torch.Tensor
    order: torch.Tensor
    num_source_sequences: int

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Offsets of the unpadded lengths (flash-attention's `cu_seqlens_q` without CP padding)."""
        return cu_seqlens_of(self.lengths)

    @property
    def num_rows(self) -> int:
        return int(self.cu_seqlens_padded[-1])


def pack_index(
    cu_seqlens: torch.Tensor, order_B: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P,) ragged row of every packed row (-1 for padding), the padded offsets and the lengths."""
    if multiple < 1:
        raise ConfigError(f"multiple must be >= 1, got {multiple}")
    lengths_B = (cu_seqlens[1:] - cu_seqlens[:-1])[order_B]
    padded_B = -(-lengths_B // multiple) * multiple
    cu_padded = cu_seqlens_of(padded_B)
    # each padded sequence reads its own rows, then `padded - length` holes
    source_P = token_starts(cu_seqlens[:-1][order_B], padded_B)
    inside_P = token_starts(torch.zeros_like(padded_B), padded_B) < torch.repeat_interleave(lengths_B, padded_B)
    return torch.where(inside_P, source_P, torch.full_like(source_P, -1)), cu_padded, lengths_B


def pack(
    ragged: Ragged[Array],
    *,
    order: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    multiple: int = 1,
    fill: int = -1,
) -> Packed[Array]:
    """Sequences `order` (default: all, in batch order) packed into one row, each padded to `multiple`.

    In batch order with `multiple=1` the ragged rows already are the packed row: `values` is shared,
    not copied."""
    order_B = (
        torch.arange(ragged.num_sequences)
        if order is None
        else check_order(order, ragged.num_sequences, allow_subset=True)
    )
    if multiple == 1 and bool(torch.equal(order_B, torch.arange(ragged.num_sequences))):
        # the ragged rows already are the packed row: no copy
        return Packed(ragged.values, ragged.cu_seqlens, ragged.lengths, order_B, ragged.num_sequences)
    index_P, cu_padded, lengths_B = pack_index(ragged.cu_seqlens, order_B, multiple)
    values = like(take(as_tensor(ragged.values), index_P, fill=fill), ragged.values)
    return Packed(values, cu_padded, lengths_B, order_B, ragged.num_sequences)


def unpack(packed: Packed[Array]) -> Ragged[Array]:
    """The packed sequences back as ragged routes, in source-batch order (padding dropped).

    When the pack held only a subset of the batch, the result holds that subset, ascending."""
    x = as_tensor(packed.values)
    if x.shape[0] != packed.num_rows:
        raise BatchShapeError(f"packed values have {x.shape[0]} rows but cu_seqlens_padded ends at {packed.num_rows}")
    by_source = torch.argsort(packed.order)
    lengths_B = packed.lengths[by_source]
    index_N = token_starts(packed.cu_seqlens_padded[:-1][by_source], lengths_B)
    return Ragged(like(select(x, index_N), packed.values), cu_seqlens_of(lengths_B))
