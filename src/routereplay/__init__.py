"""routereplay: router replay (R2/R3) for Mixture-of-Experts reinforcement learning.

capture -> decode -> validate -> store -> align -> replay -> measure. This package root re-exports
the stable public names; everything else is reached through its folder (README.md has the file map).
"""

from routereplay.codec.blob import decode, encode
from routereplay.enums import CodecMode, ReplayMode, ReplayOrder, Source
from routereplay.errors import RouteReplayError
from routereplay.indexer import IndexerTrace
from routereplay.runtime import Recording, Replayer, ReplayStats, attach, attach_megatron
from routereplay.store.route_store import RouteStore
from routereplay.trace.provenance import MergePolicy, Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire import decode_megatron, decode_sglang, decode_sglang_indexer, decode_vllm

__version__ = "0.1.0"

__all__ = [
    "CodecMode",
    "IndexerTrace",
    "MergePolicy",
    "Recording",
    "ReplayMode",
    "ReplayOrder",
    "ReplayStats",
    "Replayer",
    "RouteReplayError",
    "RouteStore",
    "RouteTrace",
    "Segment",
    "Source",
    "__version__",
    "attach",
    "attach_megatron",
    "decode",
    "decode_megatron",
    "decode_sglang",
    "decode_sglang_indexer",
    "decode_vllm",
    "encode",
]
