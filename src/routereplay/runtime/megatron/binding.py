"""Finding the TopKRouters of Megatron-core model chunks, and what a replay payload's layers mean.

Routers are found by walking the given model chunks (one per virtual pipeline stage) and keeping
each `TopKRouter` instance once, by identity. Nothing is taken from Megatron's class-level
`RouterReplay.global_router_replay_instances`: that list is positional and grows with every router
ever built, so a rebuilt decoder leaves orphans that silently swallow replay data (verl #7340).

Layer numbers. Megatron's `TransformerLayer` numbers layers from 1 and adds the pipeline offset
(`layer_number + get_transformer_layer_offset(...)`), then `MoELayer.set_layer_number` copies it to
`router.layer_number`. routereplay names layers by the 0-based global decoder layer everywhere, so
a bound router's layer is `router.layer_number - 1`. MTP layers (DeepSeek-V3 style) are left
natural; megatron-core 0.16 numbers their inner layer `num_layers + k` (k = 1..mtp_num_layers),
0.19 numbers it 1, 2, ... again (colliding with the decoder's) and flags the router
`is_mtp_layer=True`. Either is detected: the flag, an ancestor `MultiTokenPredictionLayer`, or a
number past the decoder.

Config paths where Megatron selects experts without consulting `router.router_replay`, or weights
them with logits replay cannot vouch for, are refused at attach time: `moe_router_fusion` (the TE
fused kernel returns before it), sinkhorn and quantile balancing (0.19: `precomputed_indices`),
forced random or biased logits, capacity dropping after the selection, CUDA graphs that capture the
router in training (0.16 `cuda_graph_scope`, 0.19 `cuda_graph_modules`, `cuda_graph_impl=
"full_iteration"`), and partial activation checkpointing (recompute then differs per micro-batch, so
a recompute cannot be matched to its forward). Version differences are feature-detected (which
config fields and router attributes exist), never read from a version string.

Legend: L = layers of a payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from routereplay.errors import (
    ConfigError,
    KernelBypassError,
    LayerCountError,
    MissingLayerError,
    UnsupportedRouterError,
)
from routereplay.runtime.discovery import Refusal

# capture regions that include TopKRouter.routing (0.16 CudaGraphScope, 0.19 CudaGraphModule names)
ROUTER_CAPTURING_GRAPH_SCOPES = frozenset(
    {"full", "full_iteration", "full_iteration_inference", "moe", "moe_router", "moe_preprocess"}
)
# Megatron's routing types whose expert choice never goes through router_replay
BYPASSING_ROUTING_TYPES = frozenset({"sinkhorn", "quantile_balancing"})


@dataclass(slots=True)
class MegatronSite:
    """One bound TopKRouter: where it is and what it selects."""

    name: str  # "chunk 0: decoder.layers.2.mlp.router"
    router: Any  # a megatron TopKRouter (megatron is optional, so typed loosely)
    layer: int  # 0-based global decoder layer number (router.layer_number - 1)
    chunk: int  # index of the model chunk (virtual pipeline stage) holding it
    top_k: int
    num_experts: int


def find_routers(chunks: Sequence[nn.Module]) -> tuple[list[MegatronSite], list[Refusal]]:
    """Every TopKRouter of `chunks` that can be bound, and every router left alone (with why)."""
    from megatron.core.transformer.moe.router import Router, TopKRouter
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    sites: list[MegatronSite] = []
    refused: list[Refusal] = []
    seen: set[int] = set()
    for chunk_index, chunk in enumerate(chunks):
        modules = list(chunk.named_modules())
        mtp_prefixes = [name for name, m in modules if isinstance(m, MultiTokenPredictionLayer)]
        for path, module in modules:
            if not isinstance(module, Router) or id(module) in seen:
                continue
            seen.add(id(module))
            family = type(module).__name__
            name = f"chunk {chunk_index}: {path or family}"
            if not isinstance(module, TopKRouter):
                refused.append(Refusal(name, family, "not a TopKRouter: its selection never consults router_replay"))
                continue
            overridden = [m for m in ("routing", "forward") if getattr(type(module), m) is not getattr(TopKRouter, m)]
            if overridden:  # e.g. 0.19's InferenceTopKRouter: a torch.compile'd, CUDA-graphed routing path
                refused.append(
                    Refusal(
                        name,
                        family,
                        f"overrides TopKRouter.{'() and .'.join(overridden)}(), a routing path replay cannot vouch "
                        "for; build the model with TopKRouter for record/replay",
                    )
                )
                continue
            number = module.layer_number
            if not isinstance(number, int) or number < 1:
                refused.append(
                    Refusal(
                        name,
                        family,
                        f"layer_number={number!r}: built outside a TransformerLayer? call "
                        "router.set_layer_number(n) with the 1-based global layer number, as MoELayer does",
                    )
                )
                continue
            layer = number - 1
            num_layers = int(module.config.num_layers)
            in_mtp = any(path.startswith(f"{prefix}.") for prefix in mtp_prefixes)
            if getattr(module, "is_mtp_layer", False) or in_mtp or layer >= num_layers:
                refused.append(
                    Refusal(
                        name,
                        family,
                        f"MTP layer (Megatron layer_number {number}, is_mtp_layer="
                        f"{getattr(module, 'is_mtp_layer', None)}, num_layers {num_layers}): its router serves "
                        "the draft head and stays natural; traces cover decoder layers only",
                        natural_ok=True,
                    )
                )
                continue
            sites.append(
                MegatronSite(name, module, layer, chunk_index, int(module.topk), int(module.config.num_moe_experts))
            )
    by_layer: dict[int, list[MegatronSite]] = {}
    for site in sites:
        by_layer.setdefault(site.layer, []).append(site)
    kept: list[MegatronSite] = []
    for layer, group in sorted(by_layer.items()):
        if len(group) > 1:
            names = ", ".join(s.name for s in group)
            refused.extend(
                Refusal(s.name, "TopKRouter", f"layer {layer} is claimed by {len(group)} routers ({names})")
                for s in group
            )
            continue
        kept.append(group[0])
    return kept, refused


def check_config(config: Any, where: str) -> None:
    """Raise if this router config makes Megatron select experts where replay cannot reach."""
    if getattr(config, "moe_router_fusion", False):
        raise KernelBypassError(
            f"{where}: moe_router_fusion=True routes in Transformer Engine's fused kernel, which returns before "
            "router_replay is consulted; set moe_router_fusion=False for record/replay"
        )
    graph_scope = _router_graph_scope(config)
    if graph_scope is not None:
        raise KernelBypassError(
            f"{where}: CUDA graphs ({graph_scope}) capture the router, so replayed routes would be ignored; exclude "
            "the router (cuda_graph_modules, or cuda_graph_scope before 0.19, = ['attn']) or set cuda_graph_impl='none'"
        )
    balancing = config.moe_router_load_balancing_type
    types = balancing if isinstance(balancing, (list, tuple)) else [balancing]
    bypassing = sorted(BYPASSING_ROUTING_TYPES.intersection(types))
    if bypassing:
        raise UnsupportedRouterError(
            f"{where}: moe_router_load_balancing_type={bypassing[0]!r} selects experts itself, outside "
            "router_replay; use 'none' or an aux-loss type"
        )
    if getattr(config, "moe_router_force_load_balancing", False):
        raise UnsupportedRouterError(
            f"{where}: moe_router_force_load_balancing=True replaces the logits with random numbers (a benchmark "
            "mode); the replayed experts would get meaningless weights"
        )
    if getattr(config, "moe_router_force_biased", None) is not None:
        raise UnsupportedRouterError(
            f"{where}: moe_router_force_biased={config.moe_router_force_biased} adds a random bias to the logits "
            "(a benchmark mode); the replayed experts would get weights from biased logits. Unset it for replay"
        )
    if config.moe_expert_capacity_factor is not None:
        raise UnsupportedRouterError(
            f"{where}: moe_expert_capacity_factor={config.moe_expert_capacity_factor} drops tokens after the "
            "selection, so replayed experts could silently not run; set it to None (dropless) for replay"
        )
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise UnsupportedRouterError(
            f"{where}: num_microbatches_with_partial_activation_checkpoints makes recompute differ per "
            "micro-batch, so a recompute cannot be matched to its forward; unset it for replay"
        )


def _router_graph_scope(config: Any) -> str | None:
    """How training CUDA graphs capture the router, or None. 0.16: `cuda_graph_scope`; 0.19:
    `cuda_graph_modules` (`cuda_graph_scope` is migrated into it and reset to None) and
    `cuda_graph_impl="full_iteration"`. Inference graphs (0.19 `inference_cuda_graph_scope`, always on
    under impl "local") are caught when they capture a router inside a context (see replayer.py)."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "full_iteration":
        return "impl=full_iteration (the whole forward-backward)"
    on = impl != "none" or getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph", False)
    if not on:
        return None
    scope = getattr(config, "cuda_graph_modules", None)
    if scope is None:
        scope = getattr(config, "cuda_graph_scope", None)
    scopes = [] if scope is None else list(scope) if isinstance(scope, (list, tuple)) else [scope]
    names = [str(getattr(s, "name", s)) for s in scopes]
    if not names or any(n in ROUTER_CAPTURING_GRAPH_SCOPES for n in names):
        return f"impl={impl}, modules={names or 'whole layer'}"
    return None


def moe_layers_of(config: Any) -> tuple[int, ...] | None:
    """0-based global numbers of the MoE decoder layers per `moe_layer_freq`, or None if unknown."""
    freq = getattr(config, "moe_layer_freq", None)
    num_layers = int(config.num_layers)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return tuple(i for i in range(num_layers) if i % freq == 0)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers:
        return tuple(i for i, moe in enumerate(freq) if moe == 1)
    return None


def resolve_payload_layers(
    width: int,
    payload_layers: Sequence[int] | None,
    *,
    bound: Sequence[int],
    num_layers: int,
    moe_layers: Sequence[int] | None,
) -> tuple[int, ...]:
    """The global layer number of each of a payload's `width` layer rows.

    Given `payload_layers` is checked (length, distinct, covers every bound layer). Without it the
    width decides: `num_layers` rows are an all-layer payload (dense rows ignored), as many rows as
    the model's MoE layers (`moe_layer_freq`) a MoE-only payload, as many as the bound routers the
    layers this replayer bound (what its `record()` returns).
    """
    if payload_layers is not None:
        layers = tuple(int(x) for x in payload_layers)
        if len(set(layers)) != len(layers) or any(x < 0 for x in layers):
            raise ConfigError(f"payload_layers={list(layers)} must be distinct 0-based global layer numbers")
        if len(layers) != width:
            raise LayerCountError(
                f"routes have {width} layer rows but payload_layers names {len(layers)} layers {list(layers)}"
            )
    elif width == num_layers:
        layers = tuple(range(num_layers))
    elif moe_layers is not None and width == len(moe_layers) and set(bound) <= set(moe_layers):
        layers = tuple(moe_layers)
    elif width == len(bound):
        layers = tuple(bound)
    else:
        raise LayerCountError(
            f"routes have {width} layer rows: neither all {num_layers} decoder layers, nor the "
            f"{len(moe_layers) if moe_layers is not None else '?'} MoE layers, nor the {len(bound)} bound layers "
            f"{list(bound)}; pass payload_layers= (the 0-based global layer of each row)"
        )
    missing = sorted(set(bound) - set(layers))
    if missing:
        raise MissingLayerError(
            f"the payload covers layers {list(layers)} but routers of this stage route in layers {missing}; "
            "a payload must hold every layer this pipeline stage / virtual chunk owns"
        )
    return layers


__all__ = ["MegatronSite", "check_config", "find_routers", "moe_layers_of", "resolve_payload_layers"]
