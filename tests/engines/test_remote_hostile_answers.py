"""Remote clients against real local sockets (`tests/engines/hostile_server.py`): a trickling server is cut at
the deadline, bodies past `max_response_bytes` are refused while reading (declared or chunked), and malformed
token ids / logprobs or another model's answer raise named errors, never TypeError / ValueError."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from routereplay import RouteReplayError
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import SGLangClient, VLLMClient
from routereplay.errors import (
    DeadlineExceededError,
    ModelMismatchError,
    PayloadError,
    ResponseTooLargeError,
)
from tests.codec.blobs import traced_peak
from tests.engines.hostile_server import answer, flood, hostile_server, trickle_body

pytest.importorskip("httpcore")

L, K, E = 2, 2, 8
PROMPT = [5, 6, 7]


def vllm_response(response_ids: list[int], model: str = "tiny") -> dict:
    rows = len(PROMPT) + len(response_ids) - 1
    experts_TLK = np.tile(np.array([0, 1], dtype=np.int32), (rows, L, 1))
    buffer = io.BytesIO()
    np.save(buffer, experts_TLK)
    return {
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "x",
                "token_ids": response_ids,
                "logprobs": {"token_logprobs": [-0.5] * len(response_ids)},
                "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
            }
        ],
    }


def vllm_client(url: str, **kw) -> VLLMClient:
    return VLLMClient(url, model="tiny", num_experts=E, top_k=K, **kw)


PARAMS = SamplingParams(max_new_tokens=2)


def test_a_trickling_server_is_cut_at_the_deadline() -> None:
    """A server sending one byte every 0.4 s with timeout=1, retries=1 no longer keeps the call alive for
    ever: a DeadlineExceededError (deadline 2 x timeout) ends it after a handful of the trickled bytes."""
    with hostile_server(trickle_body(2000, 0.4)) as server:
        client = vllm_client(server.url, timeout=1, retries=1)
        with pytest.raises(DeadlineExceededError) as info:
            client.generate([PROMPT], PARAMS)
    assert info.value.deadline == pytest.approx(2.0)
    assert info.value.received < 2000
    assert isinstance(info.value, RouteReplayError)


def test_a_declared_300_mb_body_is_refused_before_reading() -> None:
    """A response declaring a 300 MB body is refused by the size cap (ResponseTooLargeError) without
    reading or holding it."""
    size = 300 * 10**6
    with hostile_server(flood(size, declared=size, piece=1 << 20)) as server:
        client = vllm_client(server.url, retries=1, max_response_bytes=16 << 20)
        result, peak = traced_peak(lambda: client.generate([PROMPT], PARAMS))
    assert isinstance(result, ResponseTooLargeError), result
    assert peak < 32 << 20


def test_a_chunked_body_past_the_cap_is_refused_while_reading() -> None:
    """A chunked body without Content-Length is refused as soon as it passes max_response_bytes; memory
    stays near the cap, not the body (256 MiB if read whole)."""
    with hostile_server(flood(256 << 20, chunked=True)) as server:
        client = vllm_client(server.url, retries=1, max_response_bytes=2 << 20)
        result, peak = traced_peak(lambda: client.generate([PROMPT], PARAMS))
    assert isinstance(result, ResponseTooLargeError), result
    assert peak < 16 << 20


def test_a_well_behaved_server_passes_the_deadline_and_cap() -> None:
    """A normal answer passes the deadline and cap."""
    with hostile_server(answer(vllm_response([9, 10]))) as server:
        rollout = vllm_client(server.url, timeout=5, retries=1).generate([PROMPT], PARAMS)[0]
    assert rollout.response_ids == [9, 10]
    assert rollout.trace.num_tokens == len(PROMPT) + 2 - 1


def _mutate(path: tuple, value: object) -> dict:
    document = vllm_response([9, 10])
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return document


VLLM_MALFORMED = {
    "token_ids_str": (("choices", 0, "token_ids"), "9,10"),
    "token_ids_float": (("choices", 0, "token_ids"), [9.5, 10]),
    "token_ids_nested": (("choices", 0, "token_ids"), [[9], [10]]),
    "token_ids_negative": (("choices", 0, "token_ids"), [-9, 10]),
    "token_ids_bool": (("choices", 0, "token_ids"), [True, 10]),
    "logprobs_list": (("choices", 0, "logprobs"), [-0.5, -0.5]),
    "token_logprobs_str": (("choices", 0, "logprobs", "token_logprobs"), ["a", "b"]),
    "token_logprobs_short": (("choices", 0, "logprobs", "token_logprobs"), [-0.5]),
    "token_logprobs_null": (("choices", 0, "logprobs", "token_logprobs"), None),
    "token_logprobs_nan_text": (("choices", 0, "logprobs", "token_logprobs"), [{"x": 1}, -0.5]),
}


@pytest.mark.parametrize("case", sorted(VLLM_MALFORMED))
def test_malformed_vllm_token_ids_or_logprobs_are_payload_errors(case: str) -> None:
    """Issue 11 item 14 (error that is not a RouteReplayError): remote vLLM responses with malformed
    token_ids or logprobs raise a PayloadError (not TypeError / ValueError / AttributeError)."""
    path, value = VLLM_MALFORMED[case]
    with hostile_server(answer(_mutate(path, value))) as server:
        with pytest.raises(PayloadError):
            vllm_client(server.url, timeout=5, retries=1).generate([PROMPT], PARAMS)


def sglang_response(output_ids: object, triples: object, model: str | None = None) -> dict:
    rows = len(PROMPT) + 2 - 1
    experts = np.tile(np.array([0, 1], dtype=np.int32), (rows, L, 1))
    document = {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": 2,
            "output_token_logprobs": triples,
            "routed_experts": base64.b64encode(experts.tobytes()).decode(),
        },
    }
    if model is not None:
        document["model"] = model
    return document


GOOD_TRIPLES = [[-0.5, 9, "a"], [-0.5, 10, "b"]]
SGLANG_MALFORMED = {
    "output_ids_str": ("9 10", GOOD_TRIPLES),
    "output_ids_floats": ([9.0, 10.0], GOOD_TRIPLES),
    "output_ids_disagree": ([9, 11], GOOD_TRIPLES),
    "triples_dicts": ([9, 10], [{"a": 1}, {"b": 2}]),
    "triples_id_str": ([9, 10], [[-0.5, "9", "a"], [-0.5, 10, "b"]]),
    "triples_logprob_str": ([9, 10], [["x", 9, "a"], [-0.5, 10, "b"]]),
    "triples_scalar": ([9, 10], 5),
}


@pytest.mark.parametrize("case", sorted(SGLANG_MALFORMED))
def test_malformed_sglang_output_ids_or_logprobs_are_payload_errors(case: str) -> None:
    """Issue 11 item 14 (error that is not a RouteReplayError): SGLang /generate responses with malformed
    output_ids or output_token_logprobs raise a PayloadError."""
    output_ids, triples = SGLANG_MALFORMED[case]
    with hostile_server(answer(sglang_response(output_ids, triples))) as server:
        client = SGLangClient(server.url, num_layers=L, top_k=K, num_experts=E, timeout=5, retries=1)
        with pytest.raises(PayloadError):
            client.generate([PROMPT], PARAMS)


def test_a_well_formed_sglang_answer_is_accepted() -> None:
    """Issue 11 item 14 (guard): the well-formed SGLang answer is accepted."""
    with hostile_server(answer(sglang_response([9, 10], GOOD_TRIPLES))) as server:
        client = SGLangClient(server.url, num_layers=L, top_k=K, num_experts=E, timeout=5, retries=1)
        rollout = client.generate([PROMPT], PARAMS)[0]
    assert rollout.trace.num_tokens == len(PROMPT) + 1


def test_an_answer_from_another_model_is_refused() -> None:
    """Issue 11 item 14 (silent misroute): a response whose "model" names another model than the client
    asked for is refused (ModelMismatchError), not accepted silently."""
    with hostile_server(answer(vllm_response([9, 10], model="some-other-model"))) as server:
        with pytest.raises(ModelMismatchError, match="some-other-model"):
            vllm_client(server.url, timeout=5, retries=1).generate([PROMPT], PARAMS)
