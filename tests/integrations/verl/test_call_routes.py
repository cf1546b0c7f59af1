"""`AgentLoopRoutes` / `RecordingServer`: one agent-loop sample's routes, call by call, against what the loop returns.

No verl here (the module reads verl's `TokenOutput` / `AgentLoopOutput` duck-typed; verl's own loops run in
test_agent_loops.py). Each "engine call" returns what vLLM hands verl in process: uint8 (num_tokens - 1,
num_hidden_layers, K) rows of `prompt_ids + token_ids`, the dense layer 0 zero-filled. Two "models" route the
same positions differently, so which call a row came from is visible.

Legend: N tokens of a sample, A all hidden layers (3), L MoE layers (2), K top-k.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from routereplay.errors import ConfigError, DenseLayerRouteError, TokenMismatchError
from routereplay.integrations.verl import ROUTES_KEY, RouteGeometry, traces_of
from routereplay.integrations.verl.call_routes import AgentLoopRoutes, RecordingServer, policy_version_of

E, A, K, MOE = 16, 3, 2, (1, 2)
GEOMETRY = RouteGeometry(num_experts=E, num_layers=A, top_k=K, moe_layers=MOE)
PROMPT, FIRST, TOOL, SECOND = [5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32], [40, 41]


def model_routes(seed: int, n: int = 64) -> np.ndarray:
    """What one "model" routes at positions [0, n): (n, A, K) distinct experts per row, the dense layer 0."""
    rng = np.random.default_rng(seed)
    rows_NAK = np.argsort(rng.random((n, A, E)), -1)[..., :K].astype(np.uint8)
    rows_NAK[:, 0] = 0
    return rows_NAK


def token_output(prompt: list[int], generated: list[int], model: int | None, version: Any = None) -> SimpleNamespace:
    """verl's TokenOutput of one call: the model's rows for every fed token (all but the last), or no routes."""
    routes = None if model is None else model_routes(model)[: len(prompt) + len(generated) - 1]
    extra = {} if version is None else {"global_steps": version}
    return SimpleNamespace(token_ids=list(generated), routed_experts=routes, extra_fields=extra)


def loop_output(tokens: list[int], prompt_length: int = len(PROMPT)) -> SimpleNamespace:
    """verl's AgentLoopOutput as far as the routes go: prompt / response ids, routed_experts, extra_fields."""
    return SimpleNamespace(
        prompt_ids=tokens[:prompt_length], response_ids=tokens[prompt_length:], routed_experts=object(), extra_fields={}
    )


def moe_rows(model: int, begin: int, end: int) -> np.ndarray:
    return np.sort(model_routes(model)[begin:end][:, list(MOE)].astype(np.int16), -1)


def test_each_token_keeps_the_routes_of_the_first_call_that_fed_it() -> None:
    """Two assistant turns with a tool response between them, the second under new weights (version 2). verl keeps
    the last call's array, so every prompt token would carry version-2 routes; here rows [0, 7) are the first
    call's (the routes those tokens were sampled with) and only the tokens the second call fed first are its."""
    routes = AgentLoopRoutes(GEOMETRY)
    call_1 = PROMPT + FIRST
    routes.add_output(PROMPT, token_output(PROMPT, FIRST, model=1, version=1))
    call_2 = call_1 + TOOL
    routes.add_output(call_2, token_output(call_2, SECOND, model=2, version=2))
    trace = routes.trace(call_2 + SECOND)
    assert (trace.start, trace.stop) == (0, len(call_2 + SECOND) - 1)
    assert trace.token_ids.tolist() == (call_2 + SECOND)[:-1]
    got = np.sort(trace.experts, -1)
    assert np.array_equal(got[:7], moe_rows(1, 0, 7)), "rows the first call routed keep its routes"
    assert np.array_equal(got[7:], moe_rows(2, 7, trace.stop)), "the rest are the second call's"
    assert not np.array_equal(moe_rows(1, 0, 7), moe_rows(2, 0, 7)), "the two calls must route differently"
    assert [(s.begin, s.end, s.policy_version) for s in trace.segments] == [(0, 7, 1), (7, 12, 2)]
    assert routes.rewrites == 0


@pytest.mark.parametrize("dropped", [1, 2], ids=["glm-observation", "gemma-separator"])
def test_boundary_tokens_the_loop_drops_before_a_tool_response_restart_the_sample(dropped: int) -> None:
    """verl's GLM builder drops the generated `<|observation|>` (the call's last token, never routed), Gemma's its
    two-token turn separator, before appending the tool response: the second call's prompt is not the first
    call's sequence. Rows before the first changed token stay the first call's; from there the second's."""
    routes = AgentLoopRoutes(GEOMETRY)
    routes.add_output(PROMPT, token_output(PROMPT, FIRST, model=1, version=1))
    kept = PROMPT + FIRST[: len(FIRST) - dropped]
    call_2 = kept + TOOL
    routes.add_output(call_2, token_output(call_2, SECOND, model=2, version=1))
    assert routes.rewrites == 1
    trace = routes.trace(call_2 + SECOND)
    assert trace.token_ids.tolist() == (call_2 + SECOND)[:-1]
    got, first_changed = np.sort(trace.experts, -1), len(kept)
    assert np.array_equal(got[:first_changed], moe_rows(1, 0, first_changed))
    assert np.array_equal(got[first_changed:], moe_rows(2, first_changed, trace.stop))
    assert (trace.experts >= 0).all(), "every fed position keeps a route"


def test_tool_tokens_after_the_last_call_have_no_route_and_a_cut_response_cuts_its_rows() -> None:
    routes = AgentLoopRoutes(GEOMETRY)
    routes.add_output(PROMPT, token_output(PROMPT, FIRST, model=1))
    ended_on_tool = routes.trace(PROMPT + FIRST + TOOL)  # the loop ended on a tool response (max turns)
    assert ended_on_tool.stop == len(PROMPT + FIRST + TOOL) - 1
    assert (ended_on_tool.experts[len(PROMPT + FIRST) - 1 :] == -1).all(), "the last generated token and the tool's"
    assert (ended_on_tool.experts[: len(PROMPT + FIRST) - 1] >= 0).all()

    cut = AgentLoopRoutes(GEOMETRY)  # verl cuts response_ids to response_length: rows stop with the tokens
    cut.add_output(PROMPT, token_output(PROMPT, FIRST, model=1))
    trace = cut.trace(PROMPT + FIRST[:1])
    assert trace.stop == len(PROMPT) and np.array_equal(np.sort(trace.experts, -1), moe_rows(1, 0, len(PROMPT)))


def test_a_returned_sequence_the_last_call_did_not_see_is_refused() -> None:
    """The loop returns a token at a routed position that differs from what the engine saw there (a re-rendered
    response): replaying the call's rows on it would be replaying another token's routes."""
    routes = AgentLoopRoutes(GEOMETRY)
    routes.add_output(PROMPT, token_output(PROMPT, FIRST, model=1))
    rewritten = [*PROMPT, 99, *FIRST[1:]]
    with pytest.raises(TokenMismatchError, match="returned token 99 at position 5 where its last engine call saw 20"):
        routes.trace(rewritten)


def test_recording_server_adds_each_call_and_leaves_a_loop_without_routes_alone() -> None:
    class Server:
        def __init__(self, model: int | None) -> None:
            self.model, self.name = model, "verl's client"

        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> Any:
            return token_output(prompt_ids, FIRST, self.model, version=4)

    made: list[AgentLoopRoutes] = []

    def new_routes() -> AgentLoopRoutes:
        made.append(AgentLoopRoutes(GEOMETRY))
        return made[-1]

    off = RecordingServer(Server(model=None), new_routes)  # R3 off: verl returns no routes
    asyncio.run(off.generate("r", prompt_ids=PROMPT, sampling_params={}))
    output = loop_output(PROMPT + FIRST)
    assert off.put_on(output) is None and made == [] and off.calls_without_routes == 1
    assert output.extra_fields == {} and output.routed_experts is not None, "exactly verl's output"
    assert off.name == "verl's client", "every other attribute is the server's"

    on = RecordingServer(Server(model=1), new_routes)
    asyncio.run(on.generate("r", prompt_ids=PROMPT, sampling_params={}))
    trace = on.put_on(output)
    assert trace is not None and len(made) == 1 and made[0].calls == 1
    assert output.routed_experts is None, "verl builds no zero-filled tensor"
    (read,) = traces_of([output.extra_fields[ROUTES_KEY]])
    assert read.equal_sets(trace) and read.token_ids.tolist() == (PROMPT + FIRST)[:-1]
    assert {s.policy_version for s in read.segments} == {4}


def test_policy_version_is_named_only_when_the_call_ran_under_one_version() -> None:
    assert policy_version_of(SimpleNamespace(extra_fields={"global_steps": 7})) == 7
    resumed = {"global_steps": 8, "min_global_steps": 7, "max_global_steps": 8}  # a partial rollout across an update
    assert policy_version_of(SimpleNamespace(extra_fields=resumed)) is None
    assert policy_version_of(SimpleNamespace(extra_fields={"global_steps": None})) is None


def test_an_engine_routereplay_does_not_decode_is_refused() -> None:
    with pytest.raises(ConfigError, match="rollout engine 'trtllm': routereplay decodes the routes of 'vllm' and"):
        AgentLoopRoutes(GEOMETRY, engine="trtllm")


def test_recording_server_refuses_a_call_whose_dense_layer_holds_expert_ids() -> None:
    """An engine call whose layer 0 (dense by GEOMETRY) carries routes: the layer axis is not the model's, so the
    call is refused when it returns, not recorded with those routes dropped."""

    class Server:
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> Any:
            output = token_output(prompt_ids, FIRST, model=1)
            output.routed_experts[:, 0] = output.routed_experts[:, 1]  # layer 0 holds layer 1's routes
            return output

    server = RecordingServer(Server(), lambda: AgentLoopRoutes(GEOMETRY, engine="vllm"))
    with pytest.raises(DenseLayerRouteError, match=r"token 0, layer 0: moe_layers=\[1, 2\] drops payload layer 0"):
        asyncio.run(server.generate("r", prompt_ids=PROMPT, sampling_params={}))
