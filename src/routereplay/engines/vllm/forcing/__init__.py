"""Route forcing inside vLLM: forced rows dispatched to the forced experts, weighted by the router's own method.

Files:
- `router.py`  one MoE layer's router: `_compute_routing` wrapped; forced rows get the forced ids and the
               weights the router's own method gives them from the live logits (per-step rows, or
               graph-safe from `ForcingBuffers` with tensor ops only); which routers are forced, which refused
- `buffers.py` `ForcingBuffers`: fixed-address forced ids and per-token mask, filled before each step
- `worker.py`  the vLLM 0.30 (V1 runner) worker side: which rows of each step are forced, by request and position

Importing this package does not import vLLM.
"""

from routereplay.engines.vllm.forcing.buffers import ForcingBuffers
from routereplay.engines.vllm.forcing.router import LayerForcing, RoutingMethod, RoutingRule, StepRows, rule_of
from routereplay.engines.vllm.forcing.worker import RUNNER_ATTR, ForcingWorker

__all__ = [
    "RUNNER_ATTR",
    "ForcingBuffers",
    "ForcingWorker",
    "LayerForcing",
    "RoutingMethod",
    "RoutingRule",
    "StepRows",
    "rule_of",
]
