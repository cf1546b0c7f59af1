"""numpy or torch in, the same type out: every layout transform is written once, on torch.

A numpy input is viewed as a tensor without a copy (`torch.from_numpy`) and the result is viewed
back (`Tensor.numpy()`), so the transforms cost the same on either. Each transform is an index map
over the token axis: `take` gathers rows by an int64 index in which -1 means "fill", and `put`
scatters rows to positions of a filled output. Both are single vectorised calls, never a Python
loop per token or per sequence.

Legend: N = tokens along the axis being moved, M = tokens of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from routereplay.errors import ConfigError

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def as_tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor view of `x` (no copy for numpy arrays that torch can view)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy())  # read-only arrays (np.frombuffer) are copied
    raise ConfigError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


def like(out: torch.Tensor, template: Array) -> Array:
    """`out` as the type of `template`: numpy for numpy input, the tensor itself otherwise."""
    if isinstance(template, np.ndarray):
        return out.numpy()
    return out


def index_tensor(values: Sequence[int] | np.ndarray | torch.Tensor, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor of `values` (lengths, cu_seqlens, orders)."""
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to("cpu")
    else:
        tensor = torch.as_tensor(np.asarray(values))
    if tensor.ndim != 1 or (tensor.numel() and tensor.dtype.is_floating_point) or tensor.dtype == torch.bool:
        raise ConfigError(f"{name} must be a 1-D integer sequence, got shape {tuple(tensor.shape)} {tensor.dtype}")
    return tensor.to(torch.int64)


def select(x_N: torch.Tensor, index_M: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """Rows `index_M` of `x_N` along `dim` (no holes); the index may live on another device."""
    return torch.index_select(x_N, dim, index_M.to(x_N.device))


def take(x_N: torch.Tensor, index_M: torch.Tensor, *, dim: int = 0, fill: int = -1) -> torch.Tensor:
    """Rows `index_M` of `x_N` along `dim`; rows whose index is -1 are `fill`."""
    index_M = index_M.to(x_N.device)
    holes_M = index_M < 0
    out = torch.index_select(x_N, dim, index_M.clamp(min=0))
    if bool(holes_M.any()):
        out.index_fill_(dim, torch.nonzero(holes_M).squeeze(1), fill)
    return out


def put(x_N: torch.Tensor, position_N: torch.Tensor, size: int, *, dim: int = 0, fill: int = -1) -> torch.Tensor:
    """An output of `size` rows along `dim`, `fill` everywhere except row `position_N[i]` = row i of `x_N`."""
    shape = list(x_N.shape)
    shape[dim] = size
    out = torch.full(shape, fill, dtype=x_N.dtype, device=x_N.device)
    return out.index_copy_(dim, position_N.to(x_N.device), x_N)


def check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    """`dim` as a non-negative axis of `x`, or a ConfigError naming the transform."""
    if not -x.ndim <= dim < x.ndim:
        raise ConfigError(f"{name}: dim {dim} is out of range for an array of shape {tuple(x.shape)}")
    return dim % x.ndim
