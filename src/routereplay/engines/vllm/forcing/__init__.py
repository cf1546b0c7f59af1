"""Route forcing inside vLLM: forced rows dispatched to the forced experts, weighted by the router's own method.

Files:
- `router.py`  one MoE layer's router: `_compute_routing` wrapped; forced rows get the forced ids and the
               weights the router's own method gives them from the live logits (per-step `StepRows`, or
               graph-safe from `ForcingBuffers`)
- `rule.py`    `rule_of`: which vLLM routers are forced and by which `RoutingRule` their weights follow, which
               are refused and why
- `op.py`      `force_topk`: the graph-safe forcing op (where / gather / the rule's weights), vLLM-free
- `buffers.py` `ForcingBuffers`: fixed-address forced ids and per-token mask, filled before each step
- `worker.py`  the vLLM 0.30 (V1 runner) worker side: which rows of each step are forced, by request and position
- `weights.py` `WeightsStore`: the combine weights the routers returned for requests that ask, by request and position

Importing this package does not import vLLM.
"""

from routereplay.engines.vllm.forcing.buffers import ForcingBuffers
from routereplay.engines.vllm.forcing.op import force_topk
from routereplay.engines.vllm.forcing.router import LayerForcing, StepRows
from routereplay.engines.vllm.forcing.rule import RoutingMethod, RoutingRule, rule_of
from routereplay.engines.vllm.forcing.worker import RUNNER_ATTR, ForcingWorker

__all__ = [
    "RUNNER_ATTR",
    "ForcingBuffers",
    "ForcingWorker",
    "LayerForcing",
    "RoutingMethod",
    "RoutingRule",
    "StepRows",
    "force_topk",
    "rule_of",
]
