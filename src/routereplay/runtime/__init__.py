"""The replay runtime: bind an HF MoE model's routers, record and replay their top-k choice."""

from routereplay.runtime.discovery import Refusal, RouterSite
from routereplay.runtime.replayer import AuxLossRouting, Binding, JitterPolicy, Recording, Replayer, ReplayStats, attach

__all__ = [
    "AuxLossRouting",
    "Binding",
    "JitterPolicy",
    "Recording",
    "Refusal",
    "ReplayStats",
    "Replayer",
    "RouterSite",
    "attach",
]
