"""What `attach` binds (`Binding`: one router per column of the routes) and the policies it binds them under.

`AuxLossRouting` says which routing the model's load-balancing loss sees; `JitterPolicy` whether
training-time router jitter stays on inside record and replay contexts (`JITTER_ATTRS` are the
attributes it switches off).
"""

from __future__ import annotations

from dataclasses import dataclass

from routereplay.enums import StrEnum

# PhiMoE's `router_jitter_noise` is not noise but sparsemixer's threshold width: it is kept
JITTER_ATTRS = ("jitter_noise", "moe_jitter_eps", "input_jitter_noise")


class AuxLossRouting(StrEnum):
    """Which routing the model's auxiliary load-balancing loss sees."""

    NATURAL = "natural"  # HF recomputes top-k from router logits outside the router: natural experts


class JitterPolicy(StrEnum):
    """Training-time router jitter (Mixtral, DBRX, PhiMoE input jitter) while recording or replaying."""

    MODEL = "model"  # keep the model's own behaviour: jitter perturbs the recomputed gate weights
    OFF = "off"  # jitter switched off inside record/replay contexts (restored when the context exits)


@dataclass(frozen=True, slots=True)
class Binding:
    """What `attach` bound: one router per column of the routes (a layer may hold several, by slot)."""

    layer: int
    name: str
    family: str
    top_k: int
    num_experts: int
    slot: str = ""  # the router's slot in its layer ("" when the layer has one router)
    modality: str = ""  # the tokens it runs for, when its block splits them by modality ("text", "vision")


__all__ = ["JITTER_ATTRS", "AuxLossRouting", "Binding", "JitterPolicy"]
