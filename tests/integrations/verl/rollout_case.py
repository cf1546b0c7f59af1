"""Rollouts of a tiny dense-first Qwen3-MoE as verl 0.9.1's agent loop sees them, and verl's own padding.

The "engine" is the HF model itself, recorded: each engine call returns what vLLM >= 0.22 returns in
process (`CompletionOutput.routed_experts`): uint8 `(num_tokens - 1, num_hidden_layers, K)`, the dense
layer 0 zero-filled. Three trajectories cover verl's cases:
- `single`: one call (prompt + response);
- `tool`: two assistant turns with a tool response between them and one after the last call (verl's
  tool agent loop keeps only the last call's array: the trailing tool tokens get no rows);
- `resumed`: a partial rollout aborted after 3 tokens, resumed under updated weights (policy v2);
  verl's `llm_server.py` l.308-313 appends `routed_experts[-len(token_ids):]` of the resumed call.

`verl_worker()` is verl's real `AgentLoopWorker`, built with `__new__` the way verl's CPU tests build
workers, so `_agent_loop_postprocess` / `_postprocess` run verl's own padding into a real `DataProto`.

Legend: N tokens of a sample, T = N - 1 rows, A = all hidden layers (3), L = MoE layers (2), K = top-k.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

import routereplay
from routereplay.integrations.verl import RolloutRoutes, RouteGeometry, put_output_routes
from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer
from tests.runtime.models import perturbed_routers

FAMILY = "qwen3_moe_dense_first"
PROMPT_LENGTH, RESPONSE_LENGTH = 8, 12  # verl's rollout.prompt_length / response_length


def tiny_model(seed: int = 0) -> nn.Module:
    return tiny_vllm_model(FAMILY, seed=seed)


def updated(model: nn.Module, noise: float = 0.5, seed: int = 7) -> nn.Module:
    """The policy after a weight update: routers perturbed enough to route differently."""
    return perturbed_routers(model, noise=noise, seed=seed)


def engine_routes(model: nn.Module, token_ids: list[int]) -> np.ndarray:
    """vLLM's in-process routes of one call over `token_ids` (prompt + output): uint8 (N - 1, A, K), dense 0."""
    replayer = routereplay.attach(model)
    try:
        with torch.no_grad(), replayer.record() as recording:
            model(torch.tensor([token_ids]))
        moe_1NLK = recording.routes
    finally:
        replayer.detach()
    layers = model.config.num_hidden_layers
    out_TAK = np.zeros((len(token_ids) - 1, layers, moe_1NLK.shape[-1]), dtype=np.uint8)
    out_TAK[:, list(replayer.layers)] = moe_1NLK[0, :-1].numpy()
    return out_TAK


@dataclass(slots=True)
class Trajectory:
    """One agent-loop sample: its prompt, response (with tool tokens), mask, and both bookkeepings."""

    name: str
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    verl_routes: np.ndarray | None = None  # what verl's agent loop holds as output.routed_experts

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def words(generator: np.random.Generator, n: int) -> list[int]:
    return generator.integers(4, 1000, size=n).tolist()


def rollouts(model: nn.Module, new_model: nn.Module, routes: RolloutRoutes, seed: int = 0) -> list[Trajectory]:
    """The three trajectories, their routes added to `routes` call by call (ids = names)."""
    rng = np.random.default_rng(seed)
    single = Trajectory("single", words(rng, 5))
    single.response, single.response_mask = words(rng, 4), [1] * 4
    single.verl_routes = engine_routes(model, single.tokens)
    routes.add_call("single", single.tokens, single.verl_routes, policy_version=1)

    tool = Trajectory("tool", words(rng, 4))
    turn = words(rng, 3)
    tool.response, tool.response_mask = turn, [1] * 3
    routes.add_call("tool", tool.tokens, engine_routes(model, tool.tokens), policy_version=1)
    observation = words(rng, 3)
    tool.response, tool.response_mask = tool.response + observation, tool.response_mask + [0] * 3
    routes.add_tokens("tool", tool.tokens)
    turn = words(rng, 2)
    tool.response, tool.response_mask = tool.response + turn, tool.response_mask + [1] * 2
    tool.verl_routes = engine_routes(model, tool.tokens)  # verl keeps the last call's array (l.286)
    routes.add_call("tool", tool.tokens, tool.verl_routes, policy_version=1)
    observation = words(rng, 2)  # the loop ends on a tool response (max turns): no call routes it
    tool.response, tool.response_mask = tool.response + observation, tool.response_mask + [0] * 2
    routes.add_tokens("tool", tool.tokens)

    resumed = Trajectory("resumed", words(rng, 5))
    resumed.response, resumed.response_mask = words(rng, 3), [1] * 3
    first = engine_routes(model, resumed.tokens)  # aborted here: weights update
    routes.add_call("resumed", resumed.tokens, first, policy_version=1)
    more = words(rng, 3)
    resumed.response, resumed.response_mask = resumed.response + more, resumed.response_mask + [1] * 3
    second = engine_routes(new_model, resumed.tokens)  # the resumed call re-prefills everything under v2
    routes.add_call("resumed", resumed.tokens, second, policy_version=2)
    resumed.verl_routes = np.concatenate([first, second[-len(more) :]])  # llm_server.py l.308-313
    return [single, tool, resumed]


def geometry(model: nn.Module) -> RouteGeometry:
    return RouteGeometry.from_hf_config(model.config)


def verl_worker() -> Any:
    """verl's real AgentLoopWorker via `__new__`, with what `_agent_loop_postprocess` / `_postprocess` read."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.tokenizer = word_tokenizer()
    worker.processor = None
    worker.mm_processor_kwargs = None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    return worker


def verl_batch(trajectories: list[Trajectory], routes: RolloutRoutes | None = None) -> Any:
    """The `DataProto` verl's agent loop builds: verl's zero-padded `routed_experts` when `routes` is None,
    else routereplay's compact blobs through `extra_fields` (and no `routed_experts`)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    worker = verl_worker()
    padded = []
    for trajectory in trajectories:
        output = AgentLoopOutput(
            prompt_ids=trajectory.prompt,
            response_ids=trajectory.response,
            response_mask=trajectory.response_mask,
            routed_experts=trajectory.verl_routes,
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={},
        )
        if routes is not None:
            put_output_routes(output, routes.trace(trajectory.name))
        padded.append(asyncio.run(worker._agent_loop_postprocess(output, validate=False, raw_prompt=[])))
    return worker._postprocess(padded, validate=False)
