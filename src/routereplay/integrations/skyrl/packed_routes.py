"""SkyRL's packed `rollout_expert_indices` read back, checked: `routes_of_packed`.

SkyRL 0.4.0 collates every trajectory's route array into one `PackedTensor` (`utils/packed_tensor.py`;
`train/dataset/preprocess.py` `_collate_rollout_expert_indices`): `values` `[sum(seq_len_i), L, K]` over each
trajectory's real (attended) tokens in batch order, the uncaptured tail filled with dummy routes (experts
0..K-1), `cu_seqlens` int32 `[B + 1]`, and a batch-major `router_padding_mask` `[B, S]` (True = left padding or
no captured route). The batch is left-padded (`attention_mask`), so a trajectory's real tokens are contiguous.

`routes_of_packed` turns that into the padded `(B, S, M, K)` routes routereplay's replayer takes (MoE layers
only, -1 wherever there is no captured route: padding, the dummy tail, never expert 0). Everything is checked
before the output is allocated, each fault refused by name: a field that is not a dense tensor with data (a
sparse or meta tensor: `BatchFieldError`), a `values` shape that is not `[rows, L, K]` of the model
(`BatchGeometryError`), `cu_seqlens` that do not run 0..rows or disagree with the attention mask's lengths
(`RowCountError`), a dtype that is not one of SkyRL's integer types or cannot hold every id below E
(`DtypeError`; SkyRL picks uint8 when a batch's largest id is below 256, so a uint8 batch of a model with E > 256
may have lost ids to a cast, SkyRL #1912), ids >= E or repeated in a row (`ExpertIdRangeError`,
`DuplicateExpertError`), and, with the digest column (`digest.py`: written by routereplay's trainer from the
generator's output, or `route_digests` of the merged traces), a trajectory whose rows were shifted, cut or
swapped against its tokens (`TokenMismatchError`).

Legend: B trajectories, S padded positions, N tokens of one trajectory, C captured rows, R packed rows,
L every hidden layer, M MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    RowCountError,
    TokenMismatchError,
)
from routereplay.integrations.skyrl.digest import checked_digests, sample_digest
from routereplay.integrations.verl import RouteGeometry

if TYPE_CHECKING:
    import torch

# what SkyRL's collate writes (ROUTED_EXPERT_DTYPES: uint8, int16, int32), and int64, a plain widening of them
ROUTE_DTYPES = ("uint8", "int16", "int32", "int64")


def _tensor(value: Any, name: str) -> torch.Tensor:
    """`value` as a dense tensor that holds data: nested, sparse and meta tensors are refused by name."""
    import torch

    if not isinstance(value, torch.Tensor) or value.is_nested:
        raise BatchFieldError(f"{name} must be a (non-nested) torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_meta:
        where = "the meta device (no data)" if value.is_meta else f"layout {value.layout}"
        raise BatchFieldError(
            f"{name} is a tensor on {where}; SkyRL's batch fields are dense tensors with data (call .to_dense() or "
            "load the batch SkyRL built)"
        )
    return value


def checked_lengths(values: torch.Tensor, cu_seqlens: torch.Tensor, mask_BS: torch.Tensor) -> list[int]:
    """Each trajectory's packed row count, `cu_seqlens` checked against the rows and the attention mask."""
    import torch

    batch = int(mask_BS.shape[0])
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise BatchFieldError(
            f"rollout_expert_indices.cu_seqlens is {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}; SkyRL "
            "writes int32 [batch + 1] offsets"
        )
    if cu_seqlens.numel() != batch + 1:
        raise RowCountError(
            f"rollout_expert_indices.cu_seqlens holds {cu_seqlens.numel()} offsets for a batch of {batch} "
            f"trajectories (needs {batch + 1}); the routes and the batch were split or gathered apart"
        )
    offsets = cu_seqlens.to("cpu", torch.int64).tolist()
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or offsets[-1] != int(values.shape[0]) or min(lengths, default=0) < 0:
        raise RowCountError(
            f"rollout_expert_indices.cu_seqlens runs {offsets[0]}..{offsets[-1]} (min length {min(lengths)}) over "
            f"{int(values.shape[0])} packed rows; offsets must rise from 0 to the row count"
        )
    real = mask_BS.sum(1).tolist()
    for b, (length, tokens) in enumerate(zip(lengths, real, strict=True)):
        if length != int(tokens):
            raise RowCountError(
                f"trajectory {b}: cu_seqlens gives it {length} route rows but attention_mask {int(tokens)} tokens; "
                "SkyRL packs one row per real token (its dummy tail included): the routes belong to another "
                "batch or were shifted between trajectories"
            )
    return lengths


def _checked_ids(experts_RMK: torch.Tensor, keep_R: torch.Tensor, starts: list[int], moe: tuple[int, ...],
                 num_experts: int) -> None:  # fmt: skip
    """`ExpertIdRangeError` / `DuplicateExpertError` naming trajectory, token and layer of the first bad row."""
    import torch

    rows = experts_RMK[keep_R]
    where_R = torch.nonzero(keep_R).flatten()
    bad_RM = ((rows < 0) | (rows >= num_experts)).any(-1)
    kind = "range"
    if not bool(bad_RM.any()):
        ordered = rows.sort(-1).values
        bad_RM = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        kind = "duplicate"
        if not bool(bad_RM.any()):
            return
    first = int(torch.nonzero(bad_RM.flatten())[0])
    r, m = divmod(first, int(bad_RM.shape[1]))
    packed_row = int(where_R[r])
    b = int(np.searchsorted(np.asarray(starts), packed_row, side="right")) - 1
    at = f"trajectory {b}, token {packed_row - starts[b]} (of its real tokens), layer {moe[m]}"
    ids = rows[r, m].tolist()
    if kind == "range":
        raise ExpertIdRangeError(
            f"{at}: expert ids {ids} outside [0, {num_experts}); the routes come from another model, or the rows were "
            "cut from a wider dtype"
        )
    raise DuplicateExpertError(f"{at}: expert ids {ids} repeat an expert; a route is K distinct experts")


def routes_of_packed(
    packed: Any,
    attention_mask: torch.Tensor,
    *,
    geometry: RouteGeometry,
    router_padding_mask: torch.Tensor | None,
    sequences: torch.Tensor | None = None,
    digests: Sequence[bytes] | torch.Tensor | None = None,
) -> torch.Tensor:
    """SkyRL's `rollout_expert_indices` (a `PackedTensor`) as padded `(B, S, M, K)` routes of the MoE layers,
    -1 where `router_padding_mask` says no captured route (required: SkyRL's dummy rows hide behind it).
    `digests` (the batch's `DIGEST_KEY` column, or `route_digests` of the merged traces), with the batch's
    `sequences`, tie each trajectory's rows to its tokens."""
    import torch

    if not isinstance(geometry, RouteGeometry):
        raise BatchFieldError(f"geometry must be a RouteGeometry, got {type(geometry).__name__}")
    values = _tensor(getattr(packed, "values", None), "rollout_expert_indices.values (a SkyRL PackedTensor)")
    cu_seqlens = _tensor(getattr(packed, "cu_seqlens", None), "rollout_expert_indices.cu_seqlens")
    mask_BS = _tensor(attention_mask, "attention_mask")
    if mask_BS.ndim != 2 or bool(((mask_BS != 0) & (mask_BS != 1)).any()):
        raise BatchFieldError(f"attention_mask must be a 0/1 [batch, seq_len] tensor, got {tuple(mask_BS.shape)}")
    keep_BS = mask_BS.to("cpu", torch.bool)
    g = geometry
    if values.ndim != 3 or tuple(values.shape[1:]) != (g.num_layers, g.top_k):
        raise BatchGeometryError(
            f"rollout_expert_indices.values has shape {tuple(values.shape)}; SkyRL packs [rows, layers, top_k] with "
            f"every hidden layer vLLM reports: expected [rows, {g.num_layers}, {g.top_k}] for this model"
        )
    dtype_name = str(values.dtype).removeprefix("torch.")
    if dtype_name not in ROUTE_DTYPES:
        raise DtypeError(
            f"rollout_expert_indices.values is {values.dtype}; SkyRL packs expert ids as one of "
            f"{', '.join(ROUTE_DTYPES[:3])} (its ROUTED_EXPERT_DTYPES; int64 is read too): the field was cast or "
            "built by something other than SkyRL's collate"
        )
    if torch.iinfo(values.dtype).max < g.num_experts - 1:
        raise DtypeError(
            f"rollout_expert_indices.values is {values.dtype}, too narrow for {g.num_experts} experts (ids up to "
            f"{g.num_experts - 1}): ids >= {torch.iinfo(values.dtype).max + 1} may have been cut by a cast (SkyRL "
            "#1912). Build the routes with routereplay's generator_routes (one dtype from E), or carry the compact "
            "column"
        )
    lengths = checked_lengths(values, cu_seqlens, keep_BS)
    if router_padding_mask is None:
        raise BatchFieldError(
            "router_padding_mask is None: SkyRL fills every uncaptured row of rollout_expert_indices with dummy "
            "experts 0..K-1 and marks them only there, so without it they would be forced as routes; pass the "
            "batch's router_padding_mask (SkyRL builds it with rollout_expert_indices)"
        )
    no_route_BS = _tensor(router_padding_mask, "router_padding_mask").to("cpu", torch.bool)
    if tuple(no_route_BS.shape) != tuple(keep_BS.shape) or bool((~keep_BS & ~no_route_BS).any()):
        raise BatchFieldError(
            f"router_padding_mask of shape {tuple(no_route_BS.shape)} for attention_mask "
            f"{tuple(keep_BS.shape)}: it must have the same shape and be True wherever attention_mask is 0"
        )
    expected = None
    ids_BS = None
    if digests is not None:
        expected = checked_digests(digests, int(keep_BS.shape[0]))
        if sequences is None:
            raise BatchFieldError(
                "digests need the batch's sequences: pass sequences= (the [batch, seq_len] token ids)"
            )
        ids_BS = _tensor(sequences, "sequences")
        if tuple(ids_BS.shape) != tuple(keep_BS.shape) or ids_BS.dtype.is_floating_point:
            raise BatchFieldError(
                f"sequences of shape {tuple(ids_BS.shape)} ({ids_BS.dtype}) for attention_mask {tuple(keep_BS.shape)}: "
                "the batch's integer token ids, shaped like the mask"
            )
    keep_R = ~no_route_BS[keep_BS]  # SkyRL's rows follow the real tokens in batch order (left padding)
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    moe = g.moe_layers
    values_RLK = values.to("cpu")
    experts_RMK = values_RLK.index_select(1, torch.as_tensor(moe, dtype=torch.long))  # its own dtype
    _checked_ids(experts_RMK, keep_R, starts, moe, g.num_experts)
    if expected is not None and ids_BS is not None:
        _check_digests(expected, ids_BS.to("cpu", torch.int64), keep_BS, keep_R, values_RLK, starts)
    out_dtype = torch.int16 if g.num_experts <= (1 << 15) - 1 else torch.int32
    rows_RMK = experts_RMK.to(out_dtype)
    rows_RMK[~keep_R] = -1  # SkyRL's dummy tail (experts 0..K-1) is no route: the replayer routes it live
    routes_BSMK = torch.full((*keep_BS.shape, len(moe), g.top_k), -1, dtype=out_dtype)
    routes_BSMK[keep_BS] = rows_RMK
    return routes_BSMK


def _check_digests(
    digests: list[bytes],
    ids_BS: torch.Tensor,
    keep_BS: torch.Tensor,
    keep_R: torch.Tensor,
    values_RLK: torch.Tensor,
    starts: list[int],
) -> None:
    """`TokenMismatchError` naming the first trajectory whose captured rows and tokens are not the digested pair;
    a trajectory without a captured row (SkyRL's batch padding) replays nothing and is skipped."""
    import torch

    for b in range(int(keep_BS.shape[0])):
        captured_N = keep_R[starts[b] : starts[b + 1]]
        if not bool(captured_N.any()):
            continue
        ids_N = ids_BS[b][keep_BS[b]]
        rows_CLK = values_RLK[starts[b] : starts[b + 1]][captured_N].to(torch.int32).numpy()
        if sample_digest(ids_N[captured_N].numpy(), rows_CLK) != digests[b]:
            raise TokenMismatchError(
                f"trajectory {b}: its packed route rows and its tokens ({int(captured_N.sum())} captured of "
                f"{ids_N.numel()}) are not the pair the generator returned (digest differs): the rows were shifted, "
                "cut or reordered apart from the tokens, or trajectories swapped places; rebuild the batch from the "
                "generator output and move rollout_expert_indices, sequences and the digest column together"
            )


__all__ = ["ROUTE_DTYPES", "routes_of_packed"]
