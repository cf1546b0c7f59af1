"""What a model call hands the Replayer: its batch shape and ids, and the attributes a replayed router call sets.

`call_shape` / `call_ids` read a causal-LM call's arguments (positional or keyword); `attributes`
sets per-family values on a router for one call and restores them; `refuse_kernels` refuses a model
whose hub kernels would run its routers outside Python, where replay cannot reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from routereplay.errors import KernelBypassError


@contextmanager
def attributes(module: nn.Module, values: dict[str, Any]) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in values if hasattr(module, name)}
    for name, value in values.items():
        if name in saved:
            setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def call_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
        return value
    return None


def call_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    for key in ("input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0]), int(args[0].shape[1])
    return None


def refuse_kernels(model: nn.Module) -> None:
    if not getattr(model, "use_kernels", False):
        return
    kernelized = sorted({type(m).__name__ for m in model.modules() if getattr(type(m), "kernel_layer_name", None)})
    raise KernelBypassError(
        f"model.use_kernels is on ({', '.join(kernelized[:4]) or 'hub kernels'}): hub kernels run routers outside "
        "Python where replay cannot reach; load the model with use_kernels=False"
    )


__all__ = ["attributes", "call_ids", "call_shape", "refuse_kernels"]
