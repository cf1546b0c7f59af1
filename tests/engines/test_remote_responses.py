"""Malformed fields and foreign models in remote responses (issue 11 item 14), vLLM and SGLang shapes.

The stub server (tests/engines/stub_server.py) generates a correct response, then `mutate`
rewrites one field the way a broken server, a proxy or another API would. Before the fix six of
these raised TypeError, ValueError or AttributeError out of `generate`, and the others (floats,
negative ids, NaN log-probs, another model) were accepted silently.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import ModelMismatchError, ResponseFieldError, SGLangClient, VLLMClient
from routereplay.errors import PayloadError, RouteReplayError
from tests.engines.hostile_server import answer, hostile_server
from tests.engines.stub_server import StubConfig, StubServer, stub_server

MOE = (1, 2, 3)
PARAMS = SamplingParams(max_new_tokens=3, seed=1)
Mutation = Callable[[dict[str, Any]], None]


def vllm(stub: StubServer, **kwargs: Any) -> VLLMClient:
    cfg = stub.config
    options = {"model": cfg.model, "num_experts": cfg.num_experts, "moe_layers": MOE, "top_k": cfg.top_k}
    return VLLMClient(stub.url, **{**options, "timeout": 5.0, "backoff": 0.0, **kwargs})


def sglang(stub: StubServer, **kwargs: Any) -> SGLangClient:
    cfg = stub.config
    options = {"num_layers": cfg.num_layers, "top_k": cfg.top_k, "num_experts": cfg.num_experts, "moe_layers": MOE}
    return SGLangClient(stub.url, **{**options, "timeout": 5.0, "backoff": 0.0, **kwargs})


def mutated(change: Mutation) -> StubConfig:
    def mutate(path: str, response: Any) -> Any:
        response = copy.deepcopy(response)
        change(response)
        return response

    return StubConfig(mutate=mutate)


def choice(field: str, value: Any) -> Mutation:
    def change(r: dict[str, Any]) -> None:
        r["choices"][0][field] = value

    return change


def token_logprobs(value: Any) -> Mutation:
    def change(r: dict[str, Any]) -> None:
        r["choices"][0]["logprobs"]["token_logprobs"] = value

    return change


def output_ids(value: Any) -> Mutation:
    def change(r: dict[str, Any]) -> None:
        r["output_ids"] = value

    return change


def triples(column: int, value: Any) -> Mutation:
    """Set column 0 (log-prob) or 1 (token id) of every output_token_logprobs triple; drop output_ids."""

    def change(r: dict[str, Any]) -> None:
        r.pop("output_ids", None)
        for triple in r["meta_info"]["output_token_logprobs"]:
            triple[column] = value

    return change


VLLM_CASES: dict[str, tuple[Mutation, str]] = {
    "token_ids-strings": (
        choice("token_ids", ["a", "b", "c"]),
        r"choices\[0\]\.token_ids\[0\] = 'a' is not a token id",
    ),
    "token_ids-lists": (choice("token_ids", [[1], [2], [3]]), r"token_ids\[0\] = \[1\] is not a token id"),
    "token_ids-floats": (choice("token_ids", [1.5, 2.0, 3.0]), r"token_ids\[0\] = 1\.5 is not a token id"),
    "token_ids-bools": (choice("token_ids", [True, False, True]), r"token_ids\[0\] = True is not a token id"),
    "token_ids-negative": (choice("token_ids", [4, -1, 5]), r"token_ids\[1\] = -1 is not a token id"),
    "token_ids-huge": (choice("token_ids", [4, 2**40, 5]), r"token_ids\[1\] = 1099511627776 is not a token id"),
    "token_ids-object": (choice("token_ids", {"a": 1}), r"token_ids must be a list of token ids, got \{'a': 1\}"),
    "logprobs-string": (choice("logprobs", "x"), r"choices\[0\]\.logprobs must be an object.*got 'x'"),
    "logprobs-list": (choice("logprobs", [-1.0, -2.0, -3.0]), r"choices\[0\]\.logprobs must be an object"),
    "token_logprobs-strings": (token_logprobs(["a", "b", "c"]), r"token_logprobs\[0\] = 'a' is not a log-prob"),
    "token_logprobs-lists": (
        token_logprobs([[1.0], [2.0], [3.0]]),
        r"token_logprobs\[0\] = \[1\.0\] is not a log-prob",
    ),
    "token_logprobs-bool": (token_logprobs([-1.0, True, -1.0]), r"token_logprobs\[1\] = True is not a log-prob"),
    "token_logprobs-short": (token_logprobs([-1.0]), r"one log-prob per response token \(3 tokens, 1 log-probs\)"),
    "token_logprobs-null": (token_logprobs([-1.0, None, -1.0]), r"null log-probs"),
}

SGLANG_CASES: dict[str, tuple[Mutation, str]] = {
    "output_ids-number": (output_ids(5), r"output_ids must be a list of token ids, got 5"),
    "output_ids-floats": (output_ids([1.0, 2.0, 3.0]), r"output_ids\[0\] = 1\.0 is not a token id"),
    "triple-id-string": (
        triples(1, "a"),
        r"token ids of meta_info\.output_token_logprobs\[0\] = 'a' is not a token id",
    ),
    "triple-id-list": (triples(1, [1]), r"output_token_logprobs\[0\] = \[1\] is not a token id"),
    "triple-logprob-string": (triples(0, "x"), r"log-probs of meta_info\.output_token_logprobs\[0\] = 'x' is not"),
    "triple-logprob-list": (triples(0, [0.5]), r"log-probs of meta_info\.output_token_logprobs\[0\] = \[0\.5\] is not"),
    "triples-not-lists": (lambda r: r["meta_info"].update(output_token_logprobs="abc"), r"must be \[logprob, token_id"),
}


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_vllm_malformed_fields_are_named_errors(case: str) -> None:
    """Error that is not a RouteReplayError / silent misroute (issue 11 item 14): malformed token
    ids and log-probs in a vLLM completion raise ResponseFieldError naming the field and position."""
    change, pattern = VLLM_CASES[case]
    with stub_server(mutated(change)) as stub:
        with pytest.raises(PayloadError, match=pattern) as info:
            vllm(stub).generate([[5, 6]], PARAMS)
    assert f"vLLM {stub.url}, sequence 0" in str(info.value)


@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
def test_sglang_malformed_fields_are_named_errors(case: str) -> None:
    """Error that is not a RouteReplayError / silent misroute (issue 11 item 14): malformed
    output_ids and output_token_logprobs in an SGLang /generate answer raise named errors."""
    change, pattern = SGLANG_CASES[case]
    with stub_server(mutated(change)) as stub:
        with pytest.raises(PayloadError, match=pattern) as info:
            sglang(stub).generate([[5, 6]], PARAMS)
    assert f"SGLang {stub.url}, sequence 0" in str(info.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_logprob_is_refused(value: float) -> None:
    """Silent misroute (issue 11 item 14): a NaN log-prob (JSON NaN; +inf as Infinity) was accepted
    and would poison the loss without a word; it is refused when the response is parsed."""
    with stub_server(mutated(token_logprobs([-1.0, value, -1.0]))) as stub:
        with pytest.raises(RouteReplayError, match=r"non-finite number (NaN|Infinity)"):
            vllm(stub).generate([[5, 6]], PARAMS)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_response_from_another_model_is_refused(kind: str) -> None:
    """Silent misroute (issue 11 item 14): a response whose "model" names another model than the
    client asked for was accepted silently; ModelMismatchError names both models."""

    def other_model(r: dict[str, Any]) -> None:
        r["model"] = "other-moe"

    with stub_server(mutated(other_model)) as stub:
        make = vllm if kind == "vllm" else sglang
        with pytest.raises(ModelMismatchError, match=r"from model 'other-moe', not model='test-moe'.*pass model="):
            make(stub, model="test-moe").generate([[5, 6]], PARAMS)
        if kind == "sglang":  # no model configured: nothing to compare, the response is used
            [rollout] = sglang(stub).generate([[5, 6]], PARAMS)
            assert len(rollout.response_ids) == 3


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_model_of_the_wrong_type_is_refused(kind: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 14): "model" must be a string."""

    def numeric_model(r: dict[str, Any]) -> None:
        r["model"] = 5

    with stub_server(mutated(numeric_model)) as stub:
        make = vllm if kind == "vllm" else sglang
        with pytest.raises(ResponseFieldError, match=r'"model" must be a string, got 5'):
            make(stub, model="test-moe").generate([[5, 6]], PARAMS)


def test_check_server_with_a_malformed_model_list() -> None:
    """Error that is not a RouteReplayError (hostile servers): /v1/models with "data": 5 raised
    TypeError while listing the served names."""
    with hostile_server(answer({"object": "list", "data": 5})) as server:
        client = VLLMClient(server.url, model="m", num_experts=8, retries=1)
        with pytest.raises(ResponseFieldError, match=r'/v1/models has no "data" list'):
            client.check_server()


# --- fuzz: any JSON value in any field ------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
VLLM_PATHS = [
    ("model",),
    ("choices",),
    ("choices", 0),
    ("choices", 0, "token_ids"),
    ("choices", 0, "token_ids", 0),
    ("choices", 0, "logprobs"),
    ("choices", 0, "logprobs", "token_logprobs"),
    ("choices", 0, "logprobs", "token_logprobs", 1),
    ("choices", 0, "routed_experts"),
]
SGLANG_PATHS = [
    ("model",),
    ("output_ids",),
    ("output_ids", 0),
    ("meta_info",),
    ("meta_info", "output_token_logprobs"),
    ("meta_info", "output_token_logprobs", 0),
    ("meta_info", "output_token_logprobs", 0, 0),
    ("meta_info", "output_token_logprobs", 0, 1),
    ("meta_info", "routed_experts"),
    ("meta_info", "routed_experts_dtype"),
]


def _set(response: Any, path: tuple[str | int, ...], value: Any) -> None:
    target = response
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_fuzz_any_field_any_value_raises_only_named_errors(kind: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 14, hostile servers): any JSON value in
    any field the clients read gives a rollout or a RouteReplayError, nothing else."""
    paths = VLLM_PATHS if kind == "vllm" else SGLANG_PATHS
    with stub_server(StubConfig(), max_lifetime=120.0) as stub:
        make = vllm if kind == "vllm" else sglang
        client = make(stub, model="test-moe", retries=1)

        @settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
        @given(path=st.sampled_from(paths), value=JSON_VALUES)
        def check(path: tuple[str | int, ...], value: Any) -> None:
            def change(r: dict[str, Any]) -> None:
                _set(r, path, value)

            stub.config.mutate = mutated(change).mutate
            try:
                client.generate([[5, 6]], PARAMS)
            except RouteReplayError:
                pass

        check()
