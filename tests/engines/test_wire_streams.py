"""The newest wire forms (issue 24 item 4): vLLM >= 0.31 streams routes on the final chunk of
/inference/v1/generate, and NVIDIA Dynamo relays SGLang-style raw int32 routes in an `nvext` envelope.

Payloads are built the way those servers build them (facts: shared/research/peers-2026-11-24.md):
each stream chunk is `data: <json>` with `choices[i].token_ids` holding that chunk's tokens and
`routed_experts` null until the final chunk (finish_reason set), whose routes cover the whole sequence.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from routereplay.errors import MissingRoutesError, PayloadEncodingError, StreamedResponseError
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm
from tests.wire.payloads import distinct_routes, sglang_b64, vllm_npy_b64

E, L, K = 16, 3, 2
PROMPT, STEPS = 7, 4  # tokens: 7 prompt + 4 generated, one per chunk -> 10 route rows


def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "gen-1", "created": 0, "model": "tiny", "choices": choices}


def generate_stream(routes_by_choice: list[np.ndarray | None], *, n_chunks: int = STEPS) -> str:
    """Server-sent events of a streamed /inference/v1/generate request (one chunk per token, then [DONE])."""
    events = []
    for step in range(n_chunks):
        last = step == n_chunks - 1
        choices = []
        for index, routes in enumerate(routes_by_choice):
            entry: dict[str, Any] = {
                "index": index,
                "token_ids": [100 + step],
                "finish_reason": "length" if last else None,
            }
            entry["routed_experts"] = vllm_npy_b64(routes, E) if last and routes is not None else None
            choices.append(entry)
        events.append("data: " + json.dumps(chunk(choices)))
    return "\n\n".join([*events, "data: [DONE]"]) + "\n\n"


def test_final_stream_chunk_decodes_from_the_event_text_and_parsed(rng: np.random.Generator) -> None:
    a, b = distinct_routes(rng, PROMPT + STEPS - 1, L, K, E), distinct_routes(rng, PROMPT + STEPS - 1, L, K, E)
    text = generate_stream([a, b])
    for choice, routes in ((0, a), (1, b)):
        trace = decode_vllm(text, num_experts=E, num_tokens=PROMPT + STEPS, choice=choice)
        assert np.array_equal(trace.experts, routes)
    final = json.loads(text.split("\n\n")[STEPS - 1].removeprefix("data: "))
    assert np.array_equal(decode_vllm(final, num_experts=E, choice=1).experts, b)
    assert np.array_equal(decode_vllm(text.encode(), num_experts=E).experts, a)


def test_a_mid_stream_chunk_is_named_as_such_not_as_an_abort(rng: np.random.Generator) -> None:
    text = generate_stream([distinct_routes(rng, 10, L, K, E)])
    middle = json.loads(text.split("\n\n")[0].removeprefix("data: "))
    with pytest.raises(StreamedResponseError, match=r"mid-stream chunk .* not because the request was aborted"):
        decode_vllm(middle, num_experts=E)


def test_streams_without_routes_say_where_routes_stream() -> None:
    completions = "data: " + json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})
    with pytest.raises(StreamedResponseError, match=r"carry no routed_experts.*/inference/v1/generate"):
        decode_vllm(completions + "\n\ndata: [DONE]\n\n", num_experts=E)
    with pytest.raises(MissingRoutesError, match=r"no chunk of the stream carries choice 0's routes.*aborted"):
        decode_vllm(generate_stream([None]), num_experts=E)
    with pytest.raises(PayloadEncodingError, match="not JSON"):
        decode_vllm("data: {not json\n\n", num_experts=E)
    with pytest.raises(PayloadEncodingError, match="not JSON"):  # nesting deeper than the JSON parser goes
        decode_vllm("data: " + "[" * 100_000 + "]" * 100_000 + "\n\n", num_experts=E)
    with pytest.raises(PayloadEncodingError, match="exceeds twice max_bytes"):
        decode_vllm("data: " + "x" * (2000 + (1 << 20)), num_experts=E, max_bytes=1000)


def test_dynamo_nvext_decodes_like_sgl_ext(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 9, L, K, E)
    shape = {"num_layers": L, "top_k": K, "num_experts": E}
    per_choice = {"choices": [{"index": 0, "nvext": {"routed_experts": sglang_b64(routes)}}]}
    response_level = {"choices": [{"index": 0}], "nvext": {"routed_experts": sglang_b64(routes)}}
    narrow = {
        "choices": [
            {"index": 0, "nvext": {"routed_experts": sglang_b64(routes, "uint8"), "routed_experts_dtype": "uint8"}}
        ]
    }
    for value in (per_choice, response_level, narrow):
        assert np.array_equal(decode_sglang(value, **shape).experts, routes)
