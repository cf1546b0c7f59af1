"""Small helpers for runtime tests: a tiny Qwen3-MoE, a copy with other routers and its record, inputs, and a
hook on the experts' input."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import torch
from torch import nn

import routereplay
from routereplay.runtime import Recording
from routereplay.runtime.discovery import LAYER_PATH

K = TypeVar("K")
V = TypeVar("V")


def tiny_qwen3(layers: int = 3, experts: int = 8, top_k: int = 2, seed: int = 0) -> nn.Module:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def perturbed_routers(model: nn.Module, *, noise: float, seed: int) -> nn.Module:
    """An eval copy whose router weights (`*gate.weight`) carry seeded Gaussian noise of std `noise`."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith("gate.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * noise)
    return other.eval()


def engine_record(
    engine: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, *, weights: bool = False
) -> Recording:
    """Another policy's (the "engine"'s) own record of `ids`, without autograd: its routes, and its combine
    weights with `weights`. Its replayer stays attached (the recording reads its routers)."""
    with torch.no_grad(), routereplay.attach(engine).record(weights=weights) as rec:
        engine(input_ids=ids, attention_mask=mask)
    return rec


def random_routes(batch: int, positions: int, layers: int, top_k: int, experts: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch * positions * layers, experts, generator=generator)
    return keys.argsort(dim=1)[:, :top_k].reshape(batch, positions, layers, top_k)


@contextmanager
def _experts_capture(
    model: nn.Module, key_of: Callable[[str], K | None], read: Callable[[list[torch.Tensor]], V | None]
) -> Iterator[dict[K, list[V]]]:
    """What `read` takes from each experts module's call (its tensor arguments), under `key_of(its path)`.

    An experts module is a `*Experts` class, or the `down_embed` table of a product-key block (Doge's
    experts are embedding rows, looked up by expert id); modules whose key is None are skipped, and calls
    where `read` finds nothing."""
    seen: dict[K, list[V]] = {}
    handles = []
    for name, module in model.named_modules():
        key = key_of(name)
        if key is None or not (type(module).__name__.endswith("Experts") or name.endswith(".down_embed")):
            continue

        def hook(module: nn.Module, args: tuple, kwargs: dict, key: K = key) -> None:
            found = read([v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)])
            if found is not None:
                seen.setdefault(key, []).append(found)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _layer_of(name: str) -> int | None:
    found = LAYER_PATH.findall(name)
    return int(found[-1]) if found else None


def _ids(values: list[torch.Tensor]) -> torch.Tensor | None:
    """The expert ids of an experts call: its first 2-D int tensor."""
    ids = next((v for v in values if not v.is_floating_point() and v.dim() == 2), None)
    return None if ids is None else ids.detach().clone()


def _ids_and_weights(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(expert ids, gate weights) of an experts call: the ids, then its first float tensor of their shape."""
    ids = _ids(values)
    weights = next((v for v in values if ids is not None and v.is_floating_point() and v.shape == ids.shape), None)
    if ids is None or weights is None:  # shared experts (no routing) take neither
        return None
    return ids, weights.detach().clone()


def experts_inputs_by_name(model: nn.Module) -> AbstractContextManager[dict[str, list[torch.Tensor]]]:
    """Expert ids each experts module receives, keyed by its path (a layer may hold several experts modules)."""
    return _experts_capture(model, lambda name: name, _ids)


def experts_inputs(model: nn.Module) -> AbstractContextManager[dict[int, list[torch.Tensor]]]:
    """Expert ids each experts module receives, keyed by its global layer number."""
    return _experts_capture(model, _layer_of, _ids)


def gate_weights_probe(model: nn.Module) -> AbstractContextManager[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """(expert ids, gate weights) each `*Experts` module receives, by global layer: read from the call's
    arguments (the first 2-D int tensor, then the first float tensor of the same shape), so the truth is
    what the model's experts compute with. Open it inside the replay context: forward pre-hooks run in the
    order they were registered, and the replay's own hooks must have run first."""
    return _experts_capture(model, _layer_of, _ids_and_weights)
