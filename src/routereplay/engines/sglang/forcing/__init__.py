"""Route forcing inside SGLang 0.5.23: forced rows dispatched to the forced experts, weighted by the layer's own method.

Files:
- `requests.py` where forced routes travel (`sampling_params.custom_params[CUSTOM_KEY]`, the vLLM plugin's codec
                blob), the served geometry, the shared `ForcedRoutes` checks under SGLang's names, the cache salt
- `row_map.py`  each token row of a forward as (request, position) from `ScheduleBatch` host fields; the
                forward's forced ids + mask per MoE layer (`ForcedBatch`)
- `rule.py`     `rule_of(TopKConfig)`: the weights a layer's routing method gives forced ids, or why it is refused
- `hooks.py`    `SGLangForcing` (the process's state; its methods are the hooks) and `install(registry)`; the
                substitution is the vLLM plugin's `force_topk` (`engines/vllm/forcing/op.py`, tensor ops only,
                unforced rows bit-identical)

`install(registry)` registers the hooks on SGLang's `HookRegistry`; importing this package does not import SGLang.
"""

from routereplay.engines.sglang.forcing.hooks import ForcingStats, SGLangForcing, install
from routereplay.engines.sglang.forcing.requests import CUSTOM_KEY, served_routing
from routereplay.engines.sglang.forcing.row_map import ForcedBatch, StepRows, step_rows
from routereplay.engines.sglang.forcing.rule import TopKRule, rule_of

__all__ = [
    "CUSTOM_KEY",
    "ForcedBatch",
    "ForcingStats",
    "SGLangForcing",
    "StepRows",
    "TopKRule",
    "install",
    "rule_of",
    "served_routing",
    "step_rows",
]
