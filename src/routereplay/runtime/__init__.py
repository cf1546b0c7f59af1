"""The replay runtime: bind an HF MoE model's (or a Megatron-core model's) routers, record and replay
their top-k choice. Importing it never imports megatron."""

from routereplay.runtime.discovery import Refusal, RouterSite
from routereplay.runtime.indexer_replayer import IndexerRecording, IndexerReplayer, IndexerStats
from routereplay.runtime.megatron import MegatronRecording, MegatronReplayer, attach_megatron
from routereplay.runtime.replayer import AuxLossRouting, Binding, JitterPolicy, Recording, Replayer, ReplayStats, attach

__all__ = [
    "AuxLossRouting",
    "Binding",
    "IndexerRecording",
    "IndexerReplayer",
    "IndexerStats",
    "JitterPolicy",
    "MegatronRecording",
    "MegatronReplayer",
    "Recording",
    "Refusal",
    "ReplayStats",
    "Replayer",
    "RouterSite",
    "attach",
    "attach_megatron",
]
