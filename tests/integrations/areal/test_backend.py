"""`RoutedSGLangBackend` pass by pass, as AReaL's `RemoteInfEngine.agenerate` drives it: build, response, parse.

Responses are SGLang's /generate JSON built here (`response`), rows from a seeded generator over every hidden
layer (layer 0 dense, zero-filled, as SGLang sends it), so each fault can be put exactly where it belongs.
Legend: T rows, A every hidden layer, K top-k.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest
from areal.api import ModelRequest
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.engine.vllm_remote import RemotevLLMEngine

from routereplay.errors import (
    ConfigError,
    ExpertIdRangeError,
    MissingRoutesError,
    PayloadEncodingError,
    ResponseFieldError,
    RouteReplayError,
    RowCountError,
)
from routereplay.integrations.areal.backend import START_FIELD, RoutedSGLangBackend, install
from routereplay.integrations.verl import RouteGeometry

GEOMETRY = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))
PROMPT = [10, 11, 12, 13, 14]


def rows(count: int, seed: int) -> np.ndarray:
    """`count` rows (T, A, K) int32: distinct experts per MoE layer, the dense layer 0 zero."""
    rng = np.random.default_rng(seed)
    out_TAK = np.zeros((count, GEOMETRY.num_layers, GEOMETRY.top_k), dtype=np.int32)
    for t in range(count):
        for layer in GEOMETRY.moe_layers:
            out_TAK[t, layer] = rng.choice(GEOMETRY.num_experts, GEOMETRY.top_k, replace=False)
    return out_TAK


def response(sent: int, output: list[int], rows_TAK: np.ndarray | None, *, finish: str = "length") -> dict[str, Any]:
    meta: dict[str, Any] = {
        "prompt_tokens": sent,
        "completion_tokens": len(output),
        "finish_reason": {"type": finish},
        "output_token_logprobs": [[-0.5, token, None] for token in output],
    }
    if rows_TAK is not None:
        meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(rows_TAK, dtype=np.int32).tobytes()).decode()
    return {"meta_info": meta}


def request(ids: list[int], rid: str = "r0") -> ModelRequest:
    req = ModelRequest(rid=rid, input_ids=list(ids), gconfig=GenerationHyperparameters(max_new_tokens=8))
    req.metadata["return_routed_experts"] = True
    return req


def interrupted(backend: RoutedSGLangBackend, *, honour: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AReaL's agenerate loop by hand: 3 tokens then abort, then the resume (rows re-routed under new weights).
    Returns the rows AReaL concatenates, the first pass's rows and the resumed pass's full rows."""
    first_out, second_out = [20, 21, 22], [23, 24]
    http = backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    assert START_FIELD not in http.payload
    first_TAK = rows(len(PROMPT) + 3 - 1, seed=1)
    one = backend.parse_generation_response(response(len(PROMPT), first_out, first_TAK, finish="abort"))
    resumed = PROMPT + first_out
    http = backend.build_generation_request(request(resumed), with_lora=False, version=1)
    start = len(resumed) - 1
    assert http.payload[START_FIELD] == start
    full_TAK = rows(len(resumed) + 2 - 1, seed=2)  # every row re-routed: the prefix differs from the first pass
    two = backend.parse_generation_response(
        response(len(resumed), second_out, full_TAK[start:] if honour else full_TAK)
    )
    return np.concatenate([one.routed_experts, two.routed_experts]), first_TAK, full_TAK


@pytest.mark.parametrize("honour", [True, False], ids=["honoured", "ignored"])
def test_resumed_pass_keeps_every_row_once_first_pass_first(honour: bool) -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    concatenated_TA, first_TAK, full_TAK = interrupted(backend, honour=honour)
    width = GEOMETRY.num_layers * GEOMETRY.top_k
    assert concatenated_TA.shape == (len(PROMPT) + 5 - 1, width) and concatenated_TA.dtype == np.int32
    held = len(first_TAK)
    np.testing.assert_array_equal(concatenated_TA[:held], first_TAK.reshape(held, width))
    np.testing.assert_array_equal(concatenated_TA[held:], full_TAK[held:].reshape(-1, width))
    passes = backend.request_passes()
    assert passes is not None and [p.start for p in passes.passes] == [0, held]
    assert passes.passes[1].start_honoured is honour
    assert passes.rows_held == len(PROMPT) + 5 - 1


def test_areal_backend_keeps_the_prefix_twice() -> None:
    """The defect, on AReaL's own SGLangBackend and the same two responses (the server ignores nothing: AReaL
    never asks for a start): the concatenation holds the prefix rows twice."""
    backend = SGLangBackend()
    first_TAK, full_TAK = rows(len(PROMPT) + 2, seed=1), rows(len(PROMPT) + 5 - 1, seed=2)
    one = backend.parse_generation_response(response(len(PROMPT), [20, 21, 22], first_TAK, finish="abort"))
    http = backend.build_generation_request(request([*PROMPT, 20, 21, 22]), with_lora=False, version=1)
    assert START_FIELD not in http.payload
    two = backend.parse_generation_response(response(len(PROMPT) + 3, [23, 24], full_TAK))
    assert len(one.routed_experts) + len(two.routed_experts) == len(first_TAK) + len(full_TAK) > len(full_TAK)


def test_new_request_or_new_turn_starts_at_zero() -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    backend.parse_generation_response(response(len(PROMPT), [20, 21], rows(len(PROMPT) + 1, seed=1)))
    turn = [*PROMPT, 20, 21, 2, 30, 31]  # a next turn: more tokens than the request sent and generated
    http = backend.build_generation_request(request(turn, rid="r0"), with_lora=False, version=0)
    assert START_FIELD not in http.payload
    http = backend.build_generation_request(request([*PROMPT, 20, 21], rid="other"), with_lora=False, version=0)
    assert START_FIELD not in http.payload


def test_concurrent_tasks_pair_their_own_passes() -> None:
    """Two requests interleaved on one backend in two asyncio tasks (build, await, parse each): each task's
    resume gets its own start and rows, as AReaL's WorkflowExecutor runs episodes."""
    backend = RoutedSGLangBackend(GEOMETRY)

    async def run(prompt: list[int], rid: str, seed: int) -> tuple[int, int]:
        backend.build_generation_request(request(prompt, rid), with_lora=False, version=0)
        await asyncio.sleep(0)
        backend.parse_generation_response(response(len(prompt), [20, 21], rows(len(prompt) + 1, seed), finish="abort"))
        http = backend.build_generation_request(request([*prompt, 20, 21], rid), with_lora=False, version=0)
        await asyncio.sleep(0)
        result = backend.parse_generation_response(response(len(prompt) + 2, [22], rows(1, seed + 1)))
        return http.payload[START_FIELD], len(result.routed_experts)

    async def both() -> list[tuple[int, int]]:
        return list(await asyncio.gather(run([1, 2, 3], "a", 1), run([4, 5, 6, 7, 8, 9], "b", 3)))

    assert asyncio.run(both()) == [(4, 1), (7, 1)]


def corrupt(kind: str) -> dict[str, Any]:
    good_TAK = rows(len(PROMPT) + 2 - 1, seed=4)
    if kind == "row count":
        return response(len(PROMPT), [20, 21], good_TAK[:-2])
    if kind == "id >= E":
        good_TAK[1, 1, 0] = GEOMETRY.num_experts
    elif kind == "negative id":
        good_TAK[2, 2, 1] = -3
    elif kind == "layer count":
        extra_TAK = np.zeros((len(good_TAK), GEOMETRY.num_layers + 1, GEOMETRY.top_k), dtype=np.int32)
        extra_TAK[:, 1:] = good_TAK
        return response(len(PROMPT), [20, 21], extra_TAK)
    elif kind == "truncated base64":
        body = response(len(PROMPT), [20, 21], good_TAK)
        body["meta_info"]["routed_experts"] = body["meta_info"]["routed_experts"][:-5]
        return body
    elif kind == "prompt tokens":
        return response(len(PROMPT) + 1, [20, 21], rows(len(PROMPT) + 2, seed=4))
    return response(len(PROMPT), [20, 21], good_TAK)


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("row count", RowCountError, r"needs 6 rows, one per position of \[0, 6\)"),
        ("id >= E", ExpertIdRangeError, "16"),
        ("negative id", ExpertIdRangeError, "-3"),
        ("layer count", RowCountError, "num_hidden_layers"),
        ("truncated base64", PayloadEncodingError, "base64"),
        ("prompt tokens", ResponseFieldError, "prompt_tokens"),
    ],
)
def test_hostile_responses_are_named(kind: str, error: type[RouteReplayError], match: str) -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    with pytest.raises(error, match=match):
        backend.parse_generation_response(corrupt(kind))


@pytest.mark.parametrize("null", [False, True], ids=["field-missing", "field-null"])
def test_a_finished_pass_asked_for_routes_without_them_is_a_missing_routes_error(null: bool) -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    body = response(len(PROMPT), [20, 21], None, finish="stop")
    if null:
        body["meta_info"]["routed_experts"] = None
    backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    got = "routed_experts: null" if null else "no routed_experts field"
    with pytest.raises(
        MissingRoutesError,
        match=rf"request r0, pass 1 \(finish_reason 'stop'\).*{got}.*--enable-return-routed-experts.*"
        r"rollout.return_routed_experts=true.*MoE model",
    ):
        backend.parse_generation_response(body)


def test_an_aborted_pass_or_one_that_did_not_ask_may_come_without_routes() -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    aborted = backend.parse_generation_response(response(len(PROMPT), [], None, finish="abort"))
    assert aborted.routed_experts is None and aborted.stop_reason == "abort"
    plain = ModelRequest(rid="r1", input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=8))
    backend.build_generation_request(plain, with_lora=False, version=0)
    assert backend.parse_generation_response(response(len(PROMPT), [20], None)).routed_experts is None


def test_a_first_pass_row_count_error_names_the_rows_from_position_zero() -> None:
    backend = RoutedSGLangBackend(GEOMETRY)
    backend.build_generation_request(request(PROMPT), with_lora=False, version=0)
    with pytest.raises(RowCountError, match=r"= 4 rows .*needs 6 rows, one per position of \[0, 6\)") as caught:
        backend.parse_generation_response(response(len(PROMPT), [20, 21], rows(4, seed=3)))
    assert "honoured" not in str(caught.value) and "neither" not in str(caught.value)


def test_routes_without_a_built_pass_are_refused() -> None:
    with pytest.raises(ConfigError, match="build_generation_request first"):
        RoutedSGLangBackend(GEOMETRY).parse_generation_response(response(5, [20], rows(5, seed=1)))


def test_install_puts_it_on_areals_engine_once() -> None:
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1"))
    backend = install(engine, GEOMETRY)
    assert engine._engine.backend is backend and isinstance(backend, SGLangBackend)
    assert install(engine, GEOMETRY) is backend
    other = RouteGeometry(num_experts=8, num_layers=3, top_k=2, moe_layers=(1, 2))
    with pytest.raises(ConfigError, match="one engine serves one model"):
        install(engine, other)


def test_install_reaches_through_an_episodes_recorder() -> None:
    from routereplay.integrations.areal.episode_routes import EpisodeRoutes
    from routereplay.integrations.areal.workflows import EpisodeEngine

    inner = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1"))._engine  # what AReaL's executor passes
    recorder = EpisodeEngine(EpisodeEngine(inner, EpisodeRoutes(GEOMETRY)), EpisodeRoutes(GEOMETRY))
    backend = install(recorder, GEOMETRY)
    assert inner.backend is backend and "backend" not in vars(recorder)


def test_install_refuses_vllm_and_foreign_engines() -> None:
    with pytest.raises(ConfigError, match="VLLMBackend.*SGLang only"):
        install(RemotevLLMEngine(InferenceEngineConfig(backend="vllm:d1")), GEOMETRY)
    with pytest.raises(ConfigError, match="no AReaL RemoteInfEngine"):
        install(object(), GEOMETRY)
