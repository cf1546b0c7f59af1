"""DeepSeek Sparse Attention (DSA) indexers: finding them, and their choices in one canonical form.

A DSA indexer (transformers' `DeepseekV32Indexer`, `GlmMoeDsaIndexer`) scores every key for every
query and returns the int32 positions `[B, S, topk]` of its `index_scores.topk(...)`, where
`topk = min(index_topk, keys)`; the attention scatters them into its mask, so each query attends the
picked keys intersected with its causal / padding mask. `discover_indexers(model)` finds them by
class: a module with an int `index_topk` whose class source holds a `.topk(`, named by the global
layer number of its module path. GLM-MoE-DSA layers whose `indexer_types` entry is `"shared"` have
no indexer (`indexer=None`) and reuse the previous layer's positions: they are not found, and
replaying the owning layer forces them too.

Canonical form (the contract with the indexer trace store): an int32 tensor `indices_BSLI` of shape
(B, S, L, I) with I = `index_topk` and L the indexer layers in model order. Row (b, s, l) holds the
keys that query s of batch row b attends in layer l, each once, sorted ascending, then -1 up to I.
Positions the query cannot attend (future keys, masked padding keys: the live top-k picks them
only when fewer than I keys are valid, and the attention masks them anyway) are dropped, so a query
that sees at most I keys records all of them. A row of only -1 is "unknown": replay lets the live
indexer decide that query (and a query that attends nothing, e.g. a left-padding row, records one).

Legend: B = batch rows, S = query positions, T = key positions, L = indexer layers, I = index_topk,
k = the live top-k width min(I, T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from routereplay.errors import (
    BatchShapeError,
    DtypeError,
    IndexerRouteError,
    LayerCountError,
    TopKMismatchError,
    UnsupportedRouterError,
)
from routereplay.runtime.discovery import _has_topk, _layer_number
from routereplay.runtime.routes import mask_array
from routereplay.runtime.tensor_forms import refuse_unreadable

_DROPPED = 1 << 62  # sorts after every position


@dataclass(frozen=True, slots=True)
class IndexerSite:
    """One bound DSA indexer: its module path, module and global layer number."""

    name: str
    module: nn.Module
    layer: int
    index_topk: int


# indexers that do not pick token positions: left live, named by `unbound_indexers` (and `Replayer.describe`)
OTHER_INDEXERS = {
    "DeepseekV4Indexer": (
        "DeepSeek-V4 compressed sparse attention: its indexer picks compressed KV blocks (one per "
        "compress_rate tokens), not token positions; left live"
    ),
    "Glm5NextTextIndexer": (
        "GLM-5-Next pooled indexer: it scores pools of index_kpool tokens under a (B, S) padding mask and "
        "may append a visible tail past index_topk; not replayed yet, left live"
    ),
}


def discover_indexers(model: nn.Module) -> list[IndexerSite]:
    """Every DSA indexer of `model`, in layer order (empty for a model without one).

    A DSA indexer picks token positions under the attention mask it is given (DeepSeek-V3.2, GLM-5:
    `forward(hidden_states, q_resid, position_embeddings, attention_mask, ...)`). Indexers of another
    kind (`OTHER_INDEXERS`) are left live: `unbound_indexers` names them."""
    sites: dict[int, IndexerSite] = {}
    for name, module in model.named_modules():
        topk = getattr(module, "index_topk", None)
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1 or not _has_topk(type(module)):
            continue
        if type(module).__name__ in OTHER_INDEXERS:
            continue
        layer = _layer_number(name)
        if layer is None:
            raise UnsupportedRouterError(f"DSA indexer {name!r} has no layer number in its module path")
        if layer in sites:
            raise UnsupportedRouterError(f"layer {layer} holds 2 DSA indexers: {sites[layer].name!r} and {name!r}")
        sites[layer] = IndexerSite(name, module, layer, topk)
    return [sites[layer] for layer in sorted(sites)]


def unbound_indexers(model: nn.Module) -> list[tuple[str, str]]:
    """(module path, reason) of the indexers `discover_indexers` leaves live (`OTHER_INDEXERS`)."""
    return [
        (n, OTHER_INDEXERS[type(m).__name__]) for n, m in model.named_modules() if type(m).__name__ in OTHER_INDEXERS
    ]


def attendable_BST(attention_mask: torch.Tensor | None, batch: int, positions: int, keys: int) -> torch.Tensor | None:
    """Which keys each query may attend, as bool (B, S, T), from the mask an indexer receives (bool, or
    additive float with the dtype's minimum / -inf at masked keys); None when there is no mask."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min
    return allowed.expand(batch, positions, keys)


def canonical_indices(chosen_BSk: torch.Tensor, allowed_BST: torch.Tensor | None, index_topk: int) -> torch.Tensor:
    """A live top-k `[B, S, k]` in canonical form `[B, S, I]` (module docstring); device ops only, no sync."""
    positions = chosen_BSk.long()
    if allowed_BST is not None:
        positions = torch.where(allowed_BST.gather(-1, positions), positions, _DROPPED)
    ordered = positions.sort(dim=-1).values
    canonical = torch.where(ordered == _DROPPED, -1, ordered).to(torch.int32)
    width = canonical.shape[-1]
    if width < index_topk:
        canonical = torch.nn.functional.pad(canonical, (0, index_topk - width), value=-1)
    return canonical


@dataclass(frozen=True, slots=True)
class ForcedIndices:
    """Validated replay choices on the host, in the shapes the indexers' forwards return.

    `filled_LBSI` is the canonical rows with every -1 slot holding the row's first position (so the
    model's scatter unmasks nothing extra; rows of only -1 hold 0, and take the live choice instead);
    `unknown_LBS1` marks those rows; the counts are rows per call of each layer (attended queries
    only when the replay got an attention mask)."""

    filled_LBSI: torch.Tensor
    unknown_LBS1: torch.Tensor
    has_unknown_L: tuple[bool, ...]
    replayed_L: tuple[int, ...]
    fallback_L: tuple[int, ...]
    batch_shape: tuple[int, int]


def prepare_forced(
    indices_BSLI: torch.Tensor,
    layers: tuple[int, ...],
    index_topk: int,
    attention_mask_BS: torch.Tensor | None = None,
) -> ForcedIndices:
    """Validate replay choices once, on the host, and lay them out per layer (raises named errors)."""
    if not isinstance(indices_BSLI, torch.Tensor):
        raise DtypeError(f"indexer choices must be an int torch.Tensor (B, S, L, I), got {type(indices_BSLI).__name__}")
    refuse_unreadable(indices_BSLI, "indexer choices")
    if indices_BSLI.dtype == torch.bool or indices_BSLI.is_floating_point() or indices_BSLI.is_complex():
        raise DtypeError(f"indexer choices must be integers (int32 positions, -1 = unknown), got {indices_BSLI.dtype}")
    if indices_BSLI.dim() != 4:
        raise BatchShapeError(
            f"indexer choices must be (B, S, L, I) = (batch, positions, {len(layers)} layers, {index_topk}), "
            f"got shape {tuple(indices_BSLI.shape)}"
        )
    batch, positions, num_layers, width = indices_BSLI.shape
    if num_layers != len(layers):
        raise LayerCountError(
            f"indexer choices hold {num_layers} layers but the model has {len(layers)} DSA indexers (layers "
            f"{list(layers)}); give one column per indexer layer, in layer order"
        )
    if width != index_topk:
        raise TopKMismatchError(f"indexer choices are {width} wide but index_topk is {index_topk}; pad rows with -1")
    raw = indices_BSLI.detach().cpu()  # the context's one device -> host copy
    if raw.dtype == torch.uint64 and raw.numel() and int(raw.numpy().max()) >= positions:
        raise IndexerRouteError(  # a cast to int64 would wrap 2**64 - 1 to -1, a silent "unknown"
            f"indexer choices hold uint64 key {int(raw.numpy().max())}, out of range: keys are positions "
            f"0..{positions - 1} (-1 = unknown, which needs a signed dtype)"
        )
    host = raw.to(torch.int64)
    query = torch.arange(positions).view(1, positions, 1, 1)
    _refuse(host < -1, host, layers, "is below -1 (the only negative value is -1 = unknown)")
    _refuse(host >= positions, host, layers, f"is out of range: keys are positions 0..{positions - 1}")
    _refuse(host > query, host, layers, "is a future key of its query (causal attention cannot attend it)")
    attended_BS: torch.Tensor | None = None
    if attention_mask_BS is not None:
        mask = torch.from_numpy(mask_array(attention_mask_BS))  # checked: 0/1 values, plain, on the host
        if tuple(mask.shape) != (batch, positions):
            raise BatchShapeError(
                f"attention_mask is {tuple(mask.shape)} but indexer choices are for {(batch, positions)}"
            )
        attended_BS = mask != 0
        key_ok = attended_BS.gather(1, host.clamp(min=0).reshape(batch, -1)).reshape(host.shape)
        _refuse((host >= 0) & ~key_ok, host, layers, "is a padding key (attention_mask 0): its query cannot attend it")
    keys = positions
    ordered = torch.where(host < 0, keys, host).sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] < keys)
    _refuse(torch.nn.functional.pad(repeated, (1, 0)), ordered, layers, "appears twice in its row")
    canonical = torch.where(ordered >= keys, -1, ordered)
    unknown_BSL = canonical[..., 0] < 0
    first = torch.where(unknown_BSL, 0, canonical[..., 0]).unsqueeze(-1)
    filled = torch.where(canonical < 0, first, canonical)
    counted = unknown_BSL if attended_BS is None else unknown_BSL & attended_BS.unsqueeze(-1)
    known = ~unknown_BSL if attended_BS is None else ~unknown_BSL & attended_BS.unsqueeze(-1)
    return ForcedIndices(
        filled_LBSI=filled.permute(2, 0, 1, 3).to(torch.int32).contiguous(),
        unknown_LBS1=unknown_BSL.permute(2, 0, 1).unsqueeze(-1).contiguous(),
        has_unknown_L=tuple(bool(x) for x in unknown_BSL.any(dim=0).any(dim=0).tolist()),
        replayed_L=tuple(int(x) for x in known.sum(dim=(0, 1)).tolist()),
        fallback_L=tuple(int(x) for x in counted.sum(dim=(0, 1)).tolist()),
        batch_shape=(batch, positions),
    )


def _refuse(bad_BSLI: torch.Tensor, values_BSLI: torch.Tensor, layers: tuple[int, ...], why: str) -> None:
    """Raise `IndexerRouteError` at the first (batch, position, layer) where `bad_BSLI` holds."""
    if not bool(bad_BSLI.any()):
        return
    b, s, l, i = (int(x) for x in bad_BSLI.nonzero()[0].tolist())
    raise IndexerRouteError(
        f"indexer choice {int(values_BSLI[b, s, l, i])} at batch row {b}, position {s}, layer {layers[l]} "
        f"{why}; a row lists keys its query attends, each once, padded with -1"
    )


__all__ = [
    "OTHER_INDEXERS",
    "ForcedIndices",
    "IndexerSite",
    "attendable_BST",
    "canonical_indices",
    "discover_indexers",
    "prepare_forced",
    "unbound_indexers",
]
