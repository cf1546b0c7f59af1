"""VLLMClient / SGLangClient against a real HTTP stub that speaks each engine's exact wire format."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from routereplay import Source
from routereplay.engines.hf import Rollout, SamplingParams
from routereplay.engines.remote import (
    EngineModelError,
    EngineRequestError,
    EngineTimeoutError,
    SGLangClient,
    VLLMClient,
)
from routereplay.errors import ConfigError, MissingRoutesError, PayloadEncodingError, RouteReplayError
from tests.engines.stub_server import StubConfig, StubServer, closed_port_url, stub_server

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [5, 6, 7]]  # a repeated prompt, as in a GRPO group
MOE = (1, 2, 3)  # layer 0 of the stub is dense (zero-filled)
FAST = {"timeout": 5.0, "backoff": 0.01}


def vllm(stub: StubServer, **kwargs: Any) -> VLLMClient:
    cfg = stub.config
    options = {"model": cfg.model, "num_experts": cfg.num_experts, "moe_layers": MOE, "top_k": cfg.top_k, **FAST}
    return VLLMClient(stub.url, **{**options, **kwargs})


def sglang(stub: StubServer, **kwargs: Any) -> SGLangClient:
    cfg = stub.config
    options = {"num_layers": cfg.num_layers, "top_k": cfg.top_k, "num_experts": cfg.num_experts, "moe_layers": MOE}
    return SGLangClient(stub.url, **{**options, **FAST, **kwargs})


CLIENTS = {"vllm": (vllm, "/v1/completions", Source.VLLM), "sglang": (sglang, "/generate", Source.SGLANG)}


def check_contract(rollouts: list[Rollout], stub: StubServer, prompts: list[list[int]], source: Source) -> None:
    """Each rollout matches what the server generated, cut at EOS, with prompt + response - 1 trace rows."""
    assert [r.prompt_ids for r in rollouts] == prompts
    for rollout in rollouts:
        assert rollout.trace is not None
        length = len(rollout.response_ids)
        truth = next(
            s for s in stub.served if s.prompt == rollout.prompt_ids and s.tokens[:length] == rollout.response_ids
        )
        assert rollout.logprobs == pytest.approx(truth.logprobs[:length])
        assert rollout.trace.num_tokens == len(rollout.prompt_ids) + length - 1, "trace rows != prompt + response - 1"
        assert rollout.trace.layers == MOE
        assert np.array_equal(rollout.trace.experts, truth.routes[: rollout.trace.num_tokens, list(MOE)])
        assert [(s.source, s.policy_version) for s in rollout.trace.segments] == [(source, 7)]


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("vllm", StubConfig(num_experts=64)),  # .npy uint8
        ("vllm", StubConfig(num_experts=300)),  # .npy uint16
        ("sglang", StubConfig(num_experts=64)),  # raw int32
        ("sglang", StubConfig(num_experts=300, sglang_dtype="uint16")),
        ("sglang", StubConfig(num_experts=64, sglang_dtype="uint8")),  # routed_experts_dtype field
    ],
    ids=["vllm-uint8", "vllm-uint16", "sglang-int32", "sglang-uint16", "sglang-uint8"],
)
def test_every_wire_form_decodes_to_the_served_rollout(kind: str, config: StubConfig) -> None:
    make, _, source = CLIENTS[kind]
    calls: list[tuple[int, int]] = []
    with stub_server(config) as stub:
        rollouts = make(stub, policy_version=7).generate(
            PROMPTS, SamplingParams(max_new_tokens=6, seed=3), lambda d, t: calls.append((d, t))
        )
        check_contract(rollouts, stub, PROMPTS, source)
    assert all(len(r.response_ids) == 6 and not r.finished for r in rollouts)
    assert rollouts[0].response_ids != rollouts[3].response_ids, "repeated prompts must get their own seed"
    assert sorted(calls) == [(i, len(PROMPTS)) for i in range(1, len(PROMPTS) + 1)]


def test_vllm_request_body() -> None:
    with stub_server() as stub:
        vllm(stub).generate(
            [[5, 6]], SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=11, eos_token_id=2)
        )
        [body] = stub.posts("/v1/completions")
    assert body == {
        "model": "test-moe",
        "prompt": [5, 6],
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": False,
        "stop_token_ids": [2],
    }


def test_sglang_request_body() -> None:
    with stub_server() as stub:
        sglang(stub).generate([[5, 6], [7]], SamplingParams(max_new_tokens=4, seed=11))
        bodies = sorted(stub.posts("/generate"), key=lambda b: b["sampling_params"]["sampling_seed"])
    assert bodies == [
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "sampling_seed": seed},
            "return_logprob": True,
            "return_routed_experts": True,
            "stream": False,
        }
        for prompt, seed in (([5, 6], 11), ([7], 12))
    ]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("server_stops", [True, False], ids=["server-stops", "client-cuts"])
def test_eos_cut_inclusive(kind: str, server_stops: bool) -> None:
    make, _, source = CLIENTS[kind]
    with stub_server(StubConfig(eos_at=2, ignore_eos=not server_stops)) as stub:
        rollouts = make(stub, policy_version=7).generate(PROMPTS, SamplingParams(max_new_tokens=6, eos_token_id=2))
        check_contract(rollouts, stub, PROMPTS, source)
    assert all(r.finished and len(r.response_ids) == 3 and r.response_ids[-1] == 2 for r in rollouts)
    assert all(len(r.logprobs) == 3 for r in rollouts)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize(("status", "failures"), [(503, 2), (429, 1)])
def test_transient_failures_are_retried(kind: str, status: int, failures: int) -> None:
    make, path, _ = CLIENTS[kind]
    with stub_server(StubConfig(fail_first=failures, fail_status=status)) as stub:
        [rollout] = make(stub, retries=3).generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert len(stub.posts(path)) == failures + 1
    assert len(rollout.response_ids) == 3


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_always_500_gives_up_after_retries(kind: str) -> None:
    make, path, _ = CLIENTS[kind]
    with stub_server(StubConfig(always_status=500)) as stub:
        with pytest.raises(EngineRequestError, match=r"failed after 3 attempts; last: HTTP 500.*stub failure") as info:
            make(stub, retries=3).generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert len(stub.posts(path)) == 3
    assert info.value.status == 500 and info.value.url == stub.url + path


def test_client_errors_are_not_retried() -> None:
    with stub_server(StubConfig(always_status=400)) as stub:
        with pytest.raises(EngineRequestError, match=r"HTTP 400.*not retried"):
            sglang(stub, retries=3).generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert len(stub.posts("/generate")) == 1


def test_timeout_is_a_named_error() -> None:
    with stub_server(StubConfig(delay=2.0)) as stub:
        with pytest.raises(EngineTimeoutError, match=r"failed after 2 attempts; last: timed out after 0.2s"):
            vllm(stub, timeout=0.2, retries=2).generate([[5, 6]], SamplingParams(max_new_tokens=3))


def test_connection_refused_is_retried_then_named() -> None:
    client = VLLMClient(closed_port_url(), model="m", num_experts=8, retries=2, backoff=0.01)
    with pytest.raises(EngineRequestError, match=r"failed after 2 attempts; last: ConnectError"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("routes", ["absent", "none"])
def test_routes_flag_off_names_the_server_flag(kind: str, routes: str) -> None:
    make, _, _ = CLIENTS[kind]
    with stub_server(StubConfig(routes=routes)) as stub:  # type: ignore[arg-type]
        with pytest.raises(MissingRoutesError, match=r"server http://127\.0\.0\.1:\d+.*--enable-return-routed-experts"):
            make(stub).generate([[5, 6]], SamplingParams(max_new_tokens=3))


def test_wrong_model() -> None:
    with stub_server(StubConfig(model="served-moe")) as stub:
        assert vllm(stub).check_server() == ["served-moe"]
        assert sglang(stub, model="served-moe").check_server()["model_path"] == "served-moe"
        sglang(stub).check_server()  # no model given: nothing to compare
        with pytest.raises(EngineModelError, match=r"serves \['served-moe'\], not model='other'"):
            vllm(stub, model="other").check_server()
        with pytest.raises(EngineModelError, match=r"serves \['served-moe'\], not model='other'"):
            sglang(stub, model="other").check_server()
        with pytest.raises(EngineModelError, match=r"does not serve model='other'.*does not exist"):
            vllm(stub, model="other").generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert len(stub.posts("/v1/completions")) == 1, "a 404 is not retried"


def test_sglang_model_info_fallback() -> None:
    with stub_server(StubConfig(sglang_info_path="/model_info")) as stub:
        assert sglang(stub, model="test-moe").check_server()["model_path"] == "test-moe"
        assert [p for m, p, _ in stub.requests] == ["/get_model_info", "/model_info"]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_malformed_json(kind: str) -> None:
    make, _, _ = CLIENTS[kind]
    with stub_server(StubConfig(malformed=True)) as stub:
        with pytest.raises(PayloadEncodingError, match=r"\(HTTP 200\): invalid JSON at line 1"):
            make(stub).generate([[5, 6]], SamplingParams(max_new_tokens=3))


def test_bad_settings_and_prompts() -> None:
    with pytest.raises(ConfigError, match=r"retries=0 \(total attempts per request\) must be an int >= 1"):
        VLLMClient("http://127.0.0.1:1", model="m", num_experts=8, retries=0)
    with pytest.raises(ConfigError, match=r"must start with http://"):
        SGLangClient("127.0.0.1:1", num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(ConfigError, match=r"every prompt at least one token"):
        VLLMClient("http://127.0.0.1:1", model="m", num_experts=8).generate([[]], SamplingParams())


def test_missing_httpx_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImportError, match=r"pip install 'routereplay\[serve\]'"):
        VLLMClient("http://127.0.0.1:1", model="m", num_experts=8).generate([[1]], SamplingParams())


def test_sglang_indexer_choices_ride_on_each_rollout() -> None:
    """DSA rollouts must carry SGLang's indexer_topk rows, cut with the routes at EOS, or R3 replays live keys."""
    with stub_server(StubConfig(num_experts=64, index_topk=3, eos_at=2)) as stub:
        rollouts = sglang(stub, index_topk=3, indexer_layers=(1, 3)).generate(PROMPTS, SamplingParams(max_new_tokens=6))
        assert all(body["return_indexer_topk"] is True for body in stub.posts("/generate"))
        for rollout in rollouts:
            length = len(rollout.response_ids)
            truth = next(
                s for s in stub.served if s.prompt == rollout.prompt_ids and s.tokens[:length] == rollout.response_ids
            )
            assert rollout.trace is not None and rollout.trace.indexer is not None
            assert rollout.trace.indexer.layers == (1, 3)
            assert truth.indexer is not None
            assert np.array_equal(rollout.trace.indexer.to_dense(), truth.indexer[: rollout.trace.num_tokens])


def test_sglang_without_indexer_choices_is_refused_when_asked_for() -> None:
    """A server without --enable-return-indexer-topk must not yield DSA rollouts that silently lack choices."""
    with stub_server(StubConfig(num_experts=64)) as stub:
        with pytest.raises(RouteReplayError, match="indexer_topk"):
            sglang(stub, index_topk=3, indexer_layers=(0,), retries=1).generate(
                [[5, 6]], SamplingParams(max_new_tokens=2)
            )
