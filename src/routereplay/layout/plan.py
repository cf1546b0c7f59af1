"""Plans: run the layout transforms on token numbers, then move the routes once.

Every layout transform only moves rows (and fills holes with -1), so applying a chain of them to
`token_index(B, S)` (the number of each token of the source) yields, for each row of the final
layout, which source row it holds. `gather` then copies exactly the rows one rank needs in a single
vectorised call. For pack + Ulysses shard this copies 1/sp of the routes, where the usual glue
copies every sequence, concatenates all of them, pads, and then slices its rank's share.

    index_P = ulysses_shard(pack(unpad(token_index(B, S), attention_mask=mask)).values, sp, rank)
    routes_PLK = gather(routes_BSLK, index_P, source_dims=2)

Legend: B = batch rows, S = positions, P = rows of the planned layout, L = layers, K = top-k.
"""

from __future__ import annotations

import math

import torch

from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout.array import Array, as_tensor, like, take


def token_index(*shape: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 tensor of `shape` numbering the source tokens 0, 1, ... in row-major order (on `device`,
    e.g. the routes' GPU, so the plan is built where it is applied)."""
    if any(n < 0 for n in shape):
        raise ConfigError(f"token_index needs non-negative sizes, got {shape}")
    return torch.arange(math.prod(shape), dtype=torch.int64, device=device).reshape(shape)


def gather(x: Array, index: Array, *, source_dims: int, fill: int = -1) -> Array:
    """Rows of `x` (its first `source_dims` axes flattened) picked by `index` (-1 = `fill`): the
    result has shape index.shape + x.shape[source_dims:]."""
    t = as_tensor(x)
    index_t = as_tensor(index).to(torch.int64)
    if not 1 <= source_dims <= t.ndim:
        raise ConfigError(f"source_dims must be in 1..{t.ndim} for an array of shape {tuple(t.shape)}")
    rows = math.prod(t.shape[:source_dims])
    if index_t.numel() and int(index_t.max()) >= rows:
        raise BatchShapeError(
            f"the plan refers to token {int(index_t.max())} but the routes hold {rows} tokens "
            f"(shape {tuple(t.shape[:source_dims])}); build the plan from the same batch shape"
        )
    flat = t.reshape(rows, *t.shape[source_dims:])
    out = take(flat, index_t.reshape(-1), fill=fill)
    return like(out.reshape(*index_t.shape, *t.shape[source_dims:]), x)
