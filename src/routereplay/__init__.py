"""routereplay: router replay (R2/R3) for Mixture-of-Experts reinforcement learning.

capture -> decode -> validate -> store -> align -> replay -> measure. This package root re-exports
the stable public names; everything else is reached through its folder (README.md has the file map).

The replay runtime (`attach`, `Replayer`, ...) needs torch, so its names are imported on first use
(`__getattr__` below): `import routereplay` and the CLI's start-up (`routereplay --help`) stay light.
"""

from typing import TYPE_CHECKING, Any

from routereplay.codec.blob import decode, encode
from routereplay.enums import CodecMode, ReplayMode, ReplayOrder, Source
from routereplay.errors import RouteReplayError
from routereplay.indexer import IndexerTrace
from routereplay.store.route_store import RouteStore
from routereplay.trace.provenance import MergePolicy, Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire import decode_megatron, decode_sglang, decode_sglang_indexer, decode_vllm

if TYPE_CHECKING:
    from routereplay.runtime import Recording, Replayer, ReplayStats, attach, attach_megatron

__version__ = "0.1.0"
_RUNTIME_NAMES = frozenset({"Recording", "Replayer", "ReplayStats", "attach", "attach_megatron"})


def __getattr__(name: str) -> Any:
    """The runtime's names, imported (with torch) the first time one is asked for."""
    if name in _RUNTIME_NAMES:
        from routereplay import runtime

        value = getattr(runtime, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'routereplay' has no attribute {name!r}")


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
