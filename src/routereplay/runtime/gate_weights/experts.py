"""Where a bound router's combine weights reach its experts: the experts module and its call arguments.

In transformers 5.x most MoE families (66 of them in 5.23: Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3,
GLM-4-MoE, OLMoE, Qwen3-Next, ...) hand their experts module the router's choice and its weights as
arguments, `experts(hidden_states, top_k_index, top_k_weights)` (GPT-OSS: `router_indices,
routing_weights`). That call is where weights replay puts the engine's weights and where record
reads the weights the experts received: a forward pre-hook on the experts module, so the family's
own code runs unchanged around it. An `ExpertsSite` is that module, found as the child of the
router's MoE block whose `forward` takes (hidden states, indices, weights).

Families without such a call cannot have their weights replayed, and are refused by name
(`WeightsUnsupportedError`): routers whose block combines inside one forward (Llama-4, JetMoE,
Doge's product keys, PhiMoE's sparsemixer), modality routers (Ernie-4.5-VL: the experts see one
modality's tokens) and layers with several routers.

Legend: T = tokens in one experts call, K = top-k.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from routereplay.errors import WeightsUnsupportedError
from routereplay.runtime.discovery import RouterSite, Selection

INDEX_NAMES = ("top_k_index", "router_indices", "topk_indices", "top_k_indices", "selected_experts")
WEIGHT_NAMES = ("top_k_weights", "routing_weights", "topk_weights")


@dataclass(slots=True)
class ExpertsSite:
    """The experts module of one bound router, and where its call takes the indices and the weights."""

    site: RouterSite
    experts: nn.Module
    index_name: str  # the forward parameter holding the (T, K) expert ids
    weight_name: str  # the forward parameter holding the (T, K) combine weights
    index_position: int  # its position among the call's positional arguments (0 = hidden states)
    weight_position: int

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (indices, weights) of one call, positional or keyword; `WeightsUnsupportedError` if not (T, K)."""
        index = args[self.index_position] if len(args) > self.index_position else kwargs.get(self.index_name)
        weights = args[self.weight_position] if len(args) > self.weight_position else kwargs.get(self.weight_name)
        if (
            not isinstance(index, torch.Tensor)
            or not isinstance(weights, torch.Tensor)
            or index.dim() != 2
            or weights.shape != index.shape
            or index.shape[1] != self.site.top_k
        ):
            raise WeightsUnsupportedError(
                f"layer {self.site.layer} ({self.site.family}): {type(self.experts).__name__} was called without "
                f"(T, {self.site.top_k}) {self.index_name} / {self.weight_name}: its combine weights cannot be read "
                "or replaced; replay without weights= / record without weights=True"
            )
        return index, weights

    def with_weights(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], weights: torch.Tensor
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with its weights replaced."""
        if len(args) > self.weight_position:
            args = (*args[: self.weight_position], weights, *args[self.weight_position + 1 :])
        else:
            kwargs = {**kwargs, self.weight_name: weights}
        return args, kwargs


def experts_sites(sites: Sequence[RouterSite], what: str = "weights replay") -> list[ExpertsSite]:
    """The experts module of every bound router, or `WeightsUnsupportedError` naming the routers without one."""
    found: list[ExpertsSite] = []
    refused: list[str] = []
    layers = [s.layer for s in sites]
    for site in sites:
        reason = _refusal(site, layers.count(site.layer))
        experts = None if reason else _experts_of(site)
        if experts is None:
            refused.append(f"layer {site.layer} ({site.family}): {reason or 'no experts module takes its weights'}")
            continue
        found.append(experts)
    if refused:
        raise WeightsUnsupportedError(
            f"{what} needs the combine weights the experts receive, which these routers do not hand to an experts "
            f"module: {'; '.join(refused[:4])}. Replay ids only for this model (no weights= / threshold=)"
        )
    return found


def _refusal(site: RouterSite, routers_in_layer: int) -> str:
    if site.selection is not Selection.TOPK:
        return f"{site.selection} selection combines inside its block"
    if site.modality is not None:
        return "a modality router (its experts see one modality's tokens)"
    if routers_in_layer > 1:
        return "a layer with several routers"
    return ""


def _experts_of(site: RouterSite) -> ExpertsSite | None:
    block = site.block
    if block is None:
        return None
    for child in block.children():
        if child is site.router:
            continue
        names = _parameters(type(child))
        index = next((n for n in names if n in INDEX_NAMES), None)
        weight = next((n for n in names if n in WEIGHT_NAMES), None)
        if index is not None and weight is not None:
            return ExpertsSite(site, child, index, weight, names.index(index), names.index(weight))
    return None


def _parameters(cls: type) -> list[str]:
    """Names of `cls.forward`'s parameters after `self`."""
    try:
        signature = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return []
    return [name for name in signature.parameters if name != "self"]


__all__ = ["ExpertsSite", "experts_sites"]
