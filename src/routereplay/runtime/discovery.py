"""Finding the routers of an HF transformers MoE model, by module, and what to intercept in each.

A router is found by its module, never by config fields: a module whose class name ends in Router,
Gate, Gating or TopkRouter, with a resolvable top-k and number of selectable experts. Its global
layer number comes from its path (`model.layers.7.mlp.gate` -> 7). The *scope* is the module whose
forward holds the selection `torch.topk`: the router itself for almost every family, the parent
block for DBRX (top-k in `DbrxFFN.route_tokens_to_experts`). Routers whose selection is not a top-k
(Switch/NLLB argmax with capacity) are refused with the reason; DeepSeek-V4 hash routers stay
natural (`NATURAL_BY_CONSTRUCTION`).

A layer may hold several routers (JetMoE: attention experts and MLP experts; Ernie-4.5-VL: a text
and a vision router). Each is a *slot* of its layer, named by its module path inside the layer
("self_attention.experts.router", "mlp.router"), in module order; a layer with one router has the
slot "". Routers that split tokens by modality (Ernie-4.5-VL) carry their `Modality` and their
splitting block (`runtime/modality.py`).

MTP (multi-token prediction) layers stay natural, as in `attach_megatron`: a router under an MTP
module (transformers' `MtpLayer` / `MtpModel`, the draft layers `generate(use_mtp=True)` builds for
DeepSeek-V3, GLM-4.5 MoE, Bailing-hybrid, Step-3.7, Inkling and Mellum configs with `num_mtp_layers`;
or a path through `mtp` / `mtp_layers` / `nextn`), or numbered past the decoder's `num_hidden_layers`.
`MtpModel` restarts its layer numbers at 0, so such a router would silently take decoder layer k's
routes (NeMo-RL #3903), and engines report decoder layers only. It is listed, with that reason, in
`Replayer.describe()` (`Refusal.natural_ok`); a model whose only routers are MTP routers is refused.

Looped layers are refused by name. Inkling2-Loop (transformers 5.24) runs decoder layers
`loop_layer_index_start .. loop_layer_index_end - 1` `loop_num_passes` times in one forward, the same
modules each pass, so each of their routers routes every token once per pass, with other hidden
states. A trace holds one row per (token, layer): recording would keep the last pass only and replay
would force it on every pass. Their routers are refused (`strict=False` binds the other layers and
leaves these natural); the loops' message gates (`*MessageGate`, forget / message gating of the
previous pass) are not routers.

Two families select by another rule, each intercepted by its own `Selection`
(`runtime/family_interceptors.py`):
- PhiMoE's sparsemixer (`PhimoeTopKRouter`, scope: the router) picks expert 1 by a `max` over the
  logits, then expert 2 by a `max` over the logits with expert 1 masked; each weight is a softmax
  over the experts within a relative threshold of that max. In training the two picks are Gumbel
  samples (`max` of noisy masked logits). Always two experts (`top_k` must be 2).
- Doge's product keys (`DogeCDMoE`, a block with no router class; router = its `router_gate`, scope:
  the block) sort each half of the gate logits (keys x and y, a `topk` over all `keys` entries), then
  take the top-k of the `keys**2` sums x_i + y_j: positions in that sorted grid, not expert ids
  (expert = i * keys + j). Experts beyond `keys**2` (a non-square count) are unreachable.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from routereplay.enums import StrEnum
from routereplay.runtime.modality import MODALITY_BLOCKS, Modality

ROUTER_CLASS = re.compile(r"(Router|Gate|Gating|TopkRouter|TopKRouter)$")
NOT_ROUTER_CLASS = re.compile(r"(GateUp|Gated|MLPGate|GateProj|ForgetGate|OutputGate|InputGate|MessageGate)")
LAYER_PATH = re.compile(r"(?:^|\.)(?:layers|blocks|h|layer|decoder_layers)\.(\d+)(?:\.|$)")
TOP_K_ATTRS = ("top_k", "moe_topk", "num_experts_per_tok", "moe_top_k", "num_selected_experts")
CONFIG_TOP_K_ATTRS = ("top_k_experts", "num_experts_per_tok", "moe_topk", "moe_top_k")
CHOICE_ATTRS = ("num_router_classes", "n_routed_experts", "num_experts", "moe_num_experts", "num_local_experts")
# families whose selection is not a top-k over learned scores: refused with the reason
NON_TOPK_REASONS = {
    "SwitchTransformersTop1Router": "Switch routes by argmax with expert capacity (tokens can be dropped)",
    "NllbMoeTop2Router": "NLLB-MoE routes top-2 by argmax with capacity and random second-expert dropping",
}


class Selection(StrEnum):
    """How a router picks its experts, and so which interceptor forces them."""

    TOPK = "topk"  # one torch.topk over the experts (almost every family)
    SPARSEMIXER = "sparsemixer"  # PhiMoE: two maxes (Gumbel maxes in training), threshold-masked softmax weights
    PRODUCT_KEYS = "product_keys"  # Doge: a topk over the keys x keys grid of summed half-logits


# routers selecting by a rule of their own (the scope is the router itself), and what it needs
SELECTION_RULES = {"PhimoeTopKRouter": Selection.SPARSEMIXER}
SPARSEMIXER_TOP_K = 2  # sparsemixer picks two experts whatever `top_k` says
# MoE blocks routing by product keys, and the child linear that makes their key logits
PRODUCT_KEY_BLOCKS = {"DogeCDMoE": "router_gate"}
# routers whose choice is a pure function of the token ids: engines and trainers cannot disagree,
# so they stay natural and are left out of traces (like dense layers), without refusing the model
NATURAL_BY_CONSTRUCTION = {
    "DeepseekV4HashRouter": "DeepSeek-V4 hash layer: experts = tid2eid[token id], identical in every engine",
}
# MTP (draft) layers: an ancestor of one of these classes, or a path component of these names
MTP_CLASS = re.compile(r"^(Mtp|MTP|MultiTokenPrediction|NextN|Nextn)")
MTP_PATH = re.compile(r"(?:^|\.)(?:mtp|mtp_layers|mtp_block|nextn|nextn_layers)(?:\.|$)")
# decoder configs that run a range of layers several times per forward (Inkling2-Loop): (start, end, passes) fields
LOOP_FIELDS = ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")
# per-family attribute values applied while replaying (restored after each call)
REPLAY_OVERRIDES = {
    # group-limited greedy takes top-k VALUES from group-masked scores: forced experts outside the live
    # groups would get weight 0. Greedy selection gathers the unmasked scores; group choice is replaced anyway.
    "DeepseekV2TopkRouter": {"topk_method": "greedy"},
}


@dataclass(slots=True)
class RouterSite:
    """One bound router: where it is, what it selects, and where its top-k runs."""

    name: str  # module path, e.g. "model.layers.3.mlp.gate"
    router: nn.Module
    scope: nn.Module  # module whose forward holds the selection top-k (router or its parent)
    layer: int  # global decoder-layer number
    top_k: int
    num_choices: int  # size of the dimension top-k selects from (experts, + skip / zero experts)
    family: str  # router class name
    block: nn.Module | None = None  # the MoE block holding the router (where Mixtral applies jitter)
    replay_overrides: dict[str, Any] = field(default_factory=dict)
    selection: Selection = Selection.TOPK  # which interceptor forces it (runtime/family_interceptors.py)
    slot: str = ""  # router slot within its layer: its path inside the layer when the layer has several
    modality: Modality | None = None  # the tokens it runs for, when its block splits them by modality
    splitter: nn.Module | None = None  # that block (its forward pre-hook picks each router's tokens)
    column: int = -1  # its column in the Replayer's routes (set by the Replayer; discovery order)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A router left unbound. `natural_ok`: its choice cannot differ between engines (token-id hash)."""

    name: str
    family: str
    reason: str
    natural_ok: bool = False


def discover(model: nn.Module) -> tuple[list[RouterSite], list[Refusal]]:
    """Every router of `model` that can be bound, and every one that cannot (with why)."""
    modules = dict(model.named_modules())
    sites: list[RouterSite] = []
    refused: list[Refusal] = []
    decoder_layers = _decoder_layers(model)
    looped = _looped_layers(model)
    for name, module in modules.items():
        family = type(module).__name__
        if family in PRODUCT_KEY_BLOCKS:
            found = _product_key_site(name, module, PRODUCT_KEY_BLOCKS[family])
            if isinstance(found, RouterSite):
                sites.append(found)
            else:
                refused.append(found)
            continue
        if not ROUTER_CLASS.search(family) or NOT_ROUTER_CLASS.search(family):
            continue
        if family in NON_TOPK_REASONS:
            refused.append(Refusal(name, family, NON_TOPK_REASONS[family]))
            continue
        if family in NATURAL_BY_CONSTRUCTION:
            refused.append(Refusal(name, family, NATURAL_BY_CONSTRUCTION[family], natural_ok=True))
            continue
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        top_k, num_choices = _top_k(module, parent), _num_choices(module, parent)
        layer = _layer_number(name)
        if top_k is None or num_choices is None or layer is None:
            if _looks_like_router(module):
                refused.append(
                    Refusal(name, family, f"cannot resolve top_k={top_k}, experts={num_choices}, layer={layer}")
                )
            continue
        mtp = _mtp_reason(name, layer, modules, decoder_layers)
        if mtp is not None:
            refused.append(Refusal(name, family, mtp, natural_ok=True))
            continue
        if looped is not None and layer in looped[0]:
            loop, passes = looped
            refused.append(
                Refusal(
                    name,
                    family,
                    f"looped layer: layers {loop.start}-{loop.stop - 1} run {passes} times per forward "
                    f"(loop_num_passes={passes}), so this router routes each token {passes} times, and a trace holds "
                    "one row per (token, layer); refused rather than force one pass's routes on every pass",
                )
            )
            continue
        selection = SELECTION_RULES.get(family, Selection.TOPK)
        if selection is Selection.SPARSEMIXER and top_k != SPARSEMIXER_TOP_K:
            refused.append(Refusal(name, family, f"sparsemixer always picks 2 experts, but top_k={top_k}"))
            continue
        if selection is not Selection.TOPK or _has_topk(type(module)):
            scope = module
        elif parent is not None and _has_topk(type(parent)):
            scope = parent
        else:
            refused.append(Refusal(name, family, "no torch.topk in the router or its block: not a top-k router"))
            continue
        overrides = dict(REPLAY_OVERRIDES.get(family, {}))
        site = RouterSite(name, module, scope, layer, top_k, num_choices, family, parent, overrides, selection)
        _split_by_modality(site, modules)
        sites.append(site)
    by_layer: dict[int, list[RouterSite]] = {}
    for site in sites:
        by_layer.setdefault(site.layer, []).append(site)
    kept: list[RouterSite] = []
    for _, group in sorted(by_layer.items()):
        if len(group) > 1:  # one slot per router, named by its path inside the layer, in module order
            for site in group:
                site.slot = site.name[_layer_path_end(site.name) :]
        kept.extend(group)
    return kept, refused


def _text_config(model: nn.Module) -> Any:
    """The decoder's config (the text config of a multimodal model), or None when the model has no config."""
    config: Any = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _decoder_layers(model: nn.Module) -> int | None:
    """The decoder's `num_hidden_layers` (text config of a multimodal model), or None when the model has no config."""
    value = getattr(_text_config(model), "num_hidden_layers", None)
    return value if isinstance(value, int) and value > 0 else None


def _looped_layers(model: nn.Module) -> tuple[range, int] | None:
    """(the decoder layers run more than once per forward, how many times), or None when no layer loops."""
    text = _text_config(model)
    start, end, passes = (getattr(text, name, None) for name in LOOP_FIELDS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, passes)):
        return None
    assert isinstance(start, int) and isinstance(end, int) and isinstance(passes, int)
    return (range(start, end), passes) if passes > 1 and start < end else None


def _mtp_reason(name: str, layer: int, modules: dict[str, nn.Module], decoder_layers: int | None) -> str | None:
    """Why the router at `name` belongs to an MTP (draft) layer, or None when it is a decoder layer's."""
    parts = name.split(".")
    for end in range(len(parts)):
        ancestor = ".".join(parts[:end])
        cls = type(modules[ancestor]).__name__ if ancestor in modules else ""
        if MTP_CLASS.search(cls):
            where = f"under {cls} {ancestor!r}" if ancestor else f"in a {cls}"
            return f"MTP layer ({where}): its draft router numbers layers from 0 again; it stays natural"
    if MTP_PATH.search(name):
        return "MTP layer (an mtp / nextn module path): its draft router stays natural; traces cover decoder layers"
    if decoder_layers is not None and layer >= decoder_layers:
        return (
            f"layer {layer} is past the decoder's num_hidden_layers={decoder_layers} (an MTP / draft layer): "
            "it stays natural; traces cover decoder layers only"
        )
    return None


def _split_by_modality(site: RouterSite, modules: dict[str, nn.Module]) -> None:
    """Mark a router whose grandparent block hands it the tokens of one modality (`MODALITY_BLOCKS`)."""
    moe_name = site.name.rsplit(".", 1)[0] if "." in site.name else ""
    if "." not in moe_name:
        return
    block_name, child = moe_name.rsplit(".", 1)
    block = modules.get(block_name)
    split = MODALITY_BLOCKS.get(type(block).__name__)
    if block is None or split is None:
        return
    for attribute, modality in split.children:
        if attribute == child:
            site.modality, site.splitter = modality, block


def _layer_path_end(name: str) -> int:
    """Where the decoder layer's own path ends in a module path ("model.layers.3." of "model.layers.3.mlp.gate")."""
    matches = list(LAYER_PATH.finditer(name))
    return matches[-1].end() if matches else 0


def _product_key_site(name: str, block: nn.Module, gate_name: str) -> RouterSite | Refusal:
    """The site of a product-key block: its key linear as the router, the block as the scope."""
    family = type(block).__name__
    gate = getattr(block, gate_name, None)
    keys, top_k, layer = getattr(block, "num_keys", None), getattr(block, "top_k", None), _layer_number(name)
    if not isinstance(gate, nn.Linear) or not isinstance(keys, int) or not isinstance(top_k, int) or layer is None:
        return Refusal(name, family, f"product keys: cannot resolve {gate_name}, num_keys={keys}, top_k={top_k}")
    if keys < 2 or not 0 < top_k <= keys * keys:
        return Refusal(name, family, f"product keys: num_keys={keys} (need >= 2) with top_k={top_k}")
    return RouterSite(
        f"{name}.{gate_name}", gate, block, layer, top_k, keys * keys, family, block, selection=Selection.PRODUCT_KEYS
    )


def _top_k(router: nn.Module, parent: nn.Module | None) -> int | None:
    for owner in (router, parent):
        if owner is None:
            continue
        for attr in TOP_K_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        config = getattr(owner, "config", None)
        for attr in CONFIG_TOP_K_ATTRS:
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _num_choices(router: nn.Module, parent: nn.Module | None) -> int | None:
    # order matters: Zaya (num_router_classes = E + skip), LongCat (n_routed_experts = E + zero experts)
    for attr in CHOICE_ATTRS:
        value = getattr(router, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    weight = getattr(router, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() == 2:
        return int(weight.shape[0])
    linears = [m for m in router.modules() if isinstance(m, nn.Linear) and m is not router]
    if linears:  # DbrxRouter.layer, Gemma4 proj, HunYuan wg: the last linear makes the logits
        return int(linears[-1].out_features)
    if parent is not None:
        for attr in CHOICE_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _layer_number(name: str) -> int | None:
    found = LAYER_PATH.findall(name)
    return int(found[-1]) if found else None


def _looks_like_router(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules()) or isinstance(
        getattr(module, "weight", None), nn.Parameter
    )


def _has_topk(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if ".topk(" in source:
            return True
    return False


__all__ = ["Refusal", "RouterSite", "Selection", "discover"]
