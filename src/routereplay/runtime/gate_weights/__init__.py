"""Weights replay and capture: the combine weights the experts of an HF MoE block receive.

Files:
- `checks.py`   What combine weights given to `replay(weights=...)` may hold, checked before anything is
                allocated
- `experts.py`  Where a bound router's combine weights reach its experts: the experts module and its call
                arguments
- `forcing.py`  Putting given combine weights into the experts' call (replay), and reading the ones they
                receive (record)
"""

from routereplay.runtime.gate_weights.checks import SUM_RTOL, checked_weights, replay_weights, traces_to_weights
from routereplay.runtime.gate_weights.experts import ExpertsSite, experts_sites
from routereplay.runtime.gate_weights.forcing import (
    WeightsCapture,
    WeightsGrad,
    WeightsReplay,
    mapped_weights,
    weights_grad,
)

__all__ = [
    "SUM_RTOL",
    "ExpertsSite",
    "WeightsCapture",
    "WeightsGrad",
    "WeightsReplay",
    "checked_weights",
    "experts_sites",
    "mapped_weights",
    "replay_weights",
    "traces_to_weights",
    "weights_grad",
]
