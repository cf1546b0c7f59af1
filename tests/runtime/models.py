"""Small helpers for runtime tests: a tiny Qwen3-MoE, inputs, and a hook on the experts' input."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from routereplay.runtime.discovery import LAYER_PATH


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


def random_routes(batch: int, positions: int, layers: int, top_k: int, experts: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch * positions * layers, experts, generator=generator)
    return keys.argsort(dim=1)[:, :top_k].reshape(batch, positions, layers, top_k)


@contextmanager
def experts_inputs_by_name(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Like `experts_inputs`, keyed by the experts module's path (a layer may hold several experts modules)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if not (type(module).__name__.endswith("Experts") or name.endswith(".down_embed")):
            continue

        def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            for value in list(args) + list(kwargs.values()):
                if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 2:
                    seen.setdefault(name, []).append(value.detach().clone())
                    return

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def experts_inputs(model: nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Capture the expert ids each experts module receives, keyed by layer (first int tensor input).

    An experts module is a `*Experts` class, or the `down_embed` table of a product-key block (Doge's
    experts are embedding rows, looked up by expert id)."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        found = LAYER_PATH.findall(name)
        experts = type(module).__name__.endswith("Experts") or name.endswith(".down_embed")
        if not experts or not found:
            continue
        layer = int(found[-1])

        def hook(module: nn.Module, args: tuple, kwargs: dict, layer: int = layer) -> None:
            for value in list(args) + list(kwargs.values()):
                if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 2:
                    seen.setdefault(layer, []).append(value.detach().clone())
                    return

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
