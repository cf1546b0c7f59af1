"""Parallel shards of the token axis: Ulysses SP, TP sequence parallel, CP zigzag and contiguous
splits, and Megatron's sequence-first token order. Each shard has its inverse.

- Ulysses sequence parallelism (DeepSpeed-Ulysses, verl, SkyRL): pad the sequence to a multiple of
  the world size and give rank r the r-th contiguous chunk. Padding rows are -1.
- Megatron TP sequence parallelism scatters the sequence-first hidden states [S, B, H] along S in
  tp equal chunks; Megatron requires S to divide, so a remainder is an error here too.
- Context parallelism splits every sequence into 2 x cp chunks and gives rank r chunks r and
  2cp - 1 - r (load-balanced causal attention). On a padded batch it splits the S axis; on a packed
  THD row it splits each sequence separately (each padded to a multiple of 2 x cp by `pack`).
- The router sees tokens in sequence-first order: token (b, s) is row s * B + b.

Legend: B = batch rows, S = positions, N = tokens along the split axis, C = tokens per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from routereplay.errors import BatchShapeError, ConfigError, DivisibilityError
from routereplay.layout.array import Array, as_tensor, check_dim, like, put, select, take
from routereplay.layout.packing import Packed
from routereplay.layout.ragged import token_starts


def _check_rank(world_size: int, rank: int, what: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"{what}: rank {rank} is not in 0..{world_size - 1} (world size {world_size})")


def _cat(shards: Sequence[Any], dim: int, what: str) -> torch.Tensor:
    if not shards:
        raise ConfigError(f"{what} needs at least one shard")
    tensors = [as_tensor(s) for s in shards]
    sizes = {t.shape[dim] for t in tensors}
    if len(sizes) != 1:
        raise BatchShapeError(
            f"{what}: shards differ in length along dim {dim}: {sorted(sizes)}; pass every rank's shard"
        )
    return torch.cat(tensors, dim)


def ulysses_shard(x: Array, world_size: int, rank: int, *, dim: int = 0, fill: int = -1) -> Array:
    """Rank `rank`'s contiguous chunk of `x` along `dim`, after padding it with `fill` to a multiple of
    `world_size` (the padding lands on the last ranks). A chunk without padding is a view of `x`."""
    _check_rank(world_size, rank, "ulysses_shard")
    t = as_tensor(x)
    dim = check_dim(t, dim, "ulysses_shard")
    chunk = -(-t.shape[dim] // world_size)
    if (rank + 1) * chunk <= t.shape[dim]:
        return like(t.narrow(dim, rank * chunk, chunk), x)  # no padding in this chunk: a view
    index_C = torch.arange(rank * chunk, (rank + 1) * chunk)
    index_C[index_C >= t.shape[dim]] = -1
    return like(take(t, index_C, dim=dim, fill=fill), x)


def ulysses_unshard(shards: Sequence[Array], length: int, *, dim: int = 0) -> Array:
    """The inverse of `ulysses_shard`: all ranks' chunks joined, padding beyond `length` dropped."""
    full = _cat(shards, dim, "ulysses_unshard")
    if length > full.shape[dim]:
        raise BatchShapeError(f"ulysses_unshard: length {length} exceeds the {full.shape[dim]} rows of the shards")
    return like(full.narrow(dim, 0, length), shards[0])


def contiguous_shard(x: Array, world_size: int, rank: int, *, dim: int = 0) -> Array:
    """Rank `rank`'s contiguous 1/world_size of `x` along `dim`; the length must divide (a view)."""
    _check_rank(world_size, rank, "contiguous_shard")
    t = as_tensor(x)
    dim = check_dim(t, dim, "contiguous_shard")
    if t.shape[dim] % world_size:
        raise DivisibilityError(
            f"contiguous split: length {t.shape[dim]} along dim {dim} does not divide by {world_size}; pad the "
            f"sequence to a multiple of {world_size} first (pad(..., multiple={world_size}))"
        )
    chunk = t.shape[dim] // world_size
    return like(t.narrow(dim, rank * chunk, chunk), x)


def contiguous_unshard(shards: Sequence[Array], *, dim: int = 0) -> Array:
    """The inverse of `contiguous_shard` (and of `sequence_parallel_scatter`)."""
    return like(_cat(shards, dim, "contiguous_unshard"), shards[0])


def sequence_parallel_scatter(x_SB: Array, tp_size: int, rank: int) -> Array:
    """Megatron TP sequence parallelism: rank's chunk of the sequence-first axis 0 (S must divide)."""
    return contiguous_shard(x_SB, tp_size, rank, dim=0)


def _zigzag_index(chunk: int, cp_size: int, rank: int) -> torch.Tensor:
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp_size - 1 - rank) * chunk, (2 * cp_size - rank) * chunk),
        ]
    )


def zigzag_shard(x: Array, cp_size: int, rank: int, *, dim: int = 0) -> Array:
    """Context parallel load balancing: split `dim` into 2 x cp_size chunks, keep chunks rank and
    2 x cp_size - 1 - rank (concatenated in that order)."""
    _check_rank(cp_size, rank, "zigzag_shard")
    t = as_tensor(x)
    dim = check_dim(t, dim, "zigzag_shard")
    if t.shape[dim] % (2 * cp_size):
        raise DivisibilityError(
            f"zigzag split: length {t.shape[dim]} along dim {dim} does not divide by 2 x cp = {2 * cp_size}; "
            f"pad to a multiple of {2 * cp_size} first"
        )
    return like(take(t, _zigzag_index(t.shape[dim] // (2 * cp_size), cp_size, rank), dim=dim), x)


def zigzag_unshard(shards: Sequence[Array], *, dim: int = 0) -> Array:
    """The inverse of `zigzag_shard`: shards in rank order, joined back into the original order."""
    cp_size = len(shards)
    full = _cat(shards, dim, "zigzag_unshard")
    dim = check_dim(full, dim, "zigzag_unshard")
    chunk = full.shape[dim] // (2 * cp_size)
    target_N = torch.cat([_zigzag_index(chunk, cp_size, rank) for rank in range(cp_size)])
    return like(put(full, target_N, full.shape[dim], dim=dim), shards[0])


def packed_zigzag_index(cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """(N / cp,) packed rows that CP rank `rank` holds: chunks rank and 2cp-1-rank of every sequence."""
    _check_rank(cp_size, rank, "packed_zigzag_index")
    padded_B = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    if bool((padded_B % (2 * cp_size)).any()):
        b = int(torch.nonzero(padded_B % (2 * cp_size))[0])
        raise DivisibilityError(
            f"packed sequence {b} has {int(padded_B[b])} rows, not a multiple of 2 x cp = {2 * cp_size}; "
            f"pack with multiple={2 * cp_size}"
        )
    chunk_B = padded_B // (2 * cp_size)
    starts_B2 = torch.stack(
        [cu_seqlens_padded[:-1] + rank * chunk_B, cu_seqlens_padded[:-1] + (2 * cp_size - 1 - rank) * chunk_B], 1
    )
    return token_starts(starts_B2.reshape(-1), chunk_B.repeat_interleave(2))


def packed_zigzag_shard(packed: Packed[Array], cp_size: int, rank: int) -> Array:
    """CP rank `rank`'s rows of a packed THD row (Megatron / Transformer Engine THD partitioning)."""
    index_N = packed_zigzag_index(packed.cu_seqlens_padded, cp_size, rank)
    return like(select(as_tensor(packed.values), index_N), packed.values)


def packed_zigzag_unshard(shards: Sequence[Array], cu_seqlens_padded: torch.Tensor) -> Array:
    """The inverse of `packed_zigzag_shard`: every CP rank's rows back into the packed row."""
    cp_size = len(shards)
    full = _cat(shards, 0, "packed_zigzag_unshard")
    target_N = torch.cat([packed_zigzag_index(cu_seqlens_padded, cp_size, rank) for rank in range(cp_size)])
    if target_N.numel() != full.shape[0]:
        raise BatchShapeError(
            f"the shards hold {full.shape[0]} rows but cu_seqlens_padded describes {target_N.numel()}"
        )
    return like(put(full, target_N, full.shape[0]), shards[0])


def to_sequence_first(x_BS: Array) -> Array:
    """(B, S, ...) -> (S, B, ...) contiguous: Megatron's [S, B] activation order."""
    t = as_tensor(x_BS)
    return like(t.transpose(0, 1).contiguous(), x_BS)


def from_sequence_first(x_SB: Array) -> Array:
    """(S, B, ...) -> (B, S, ...) contiguous."""
    return to_sequence_first(x_SB)


def to_router_order(x_BS: Array) -> Array:
    """(B, S, ...) -> (S * B, ...): the token order of a Megatron router's [S * B, H] input."""
    t = as_tensor(x_BS)
    return like(t.transpose(0, 1).reshape(t.shape[0] * t.shape[1], *t.shape[2:]), x_BS)


def from_router_order(x_N: Array, batch: int) -> Array:
    """(S * B, ...) router order back to (B, S, ...)."""
    t = as_tensor(x_N)
    if batch < 1 or t.shape[0] % batch:
        raise DivisibilityError(f"{t.shape[0]} router rows do not split into batch {batch}")
    return like(t.reshape(t.shape[0] // batch, batch, *t.shape[1:]).transpose(0, 1).contiguous(), x_N)
