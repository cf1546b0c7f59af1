"""The built-in engine: any HF causal-LM MoE model sampled with a KV cache, routes captured like vLLM's.

Files:
- `engine.py`   `HFEngine`: batched sampling (bf16 by default), route capture, `prefix_routes` to force a
                resumed prefix; `SamplingParams`, `TokenBudget`, `Rollout`
- `process.py`  `HFProcessEngine`: the same engine in a child process, weights synced through shared
                memory (fully-async RL)
- `child.py`    the child process's side of `HFProcessEngine`: the messages, the engine server
"""

from routereplay.engines.hf.engine import (
    HFEngine,
    Rollout,
    SamplingParams,
    TokenBudget,
    check_prompts,
    checked_params,
    left_pad,
    position_ids_for,
    sample_tokens,
)
from routereplay.engines.hf.process import HFProcessEngine

__all__ = [
    "HFEngine",
    "HFProcessEngine",
    "Rollout",
    "SamplingParams",
    "TokenBudget",
    "check_prompts",
    "checked_params",
    "left_pad",
    "position_ids_for",
    "sample_tokens",
]
