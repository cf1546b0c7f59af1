"""decode_vllm on byte-exact vLLM payloads of every version."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from routereplay import Source, decode_vllm
from routereplay.errors import (
    ConfigError,
    LayerCountError,
    MissingRoutesError,
    PayloadEncodingError,
    RowCountError,
    TopKMismatchError,
    ZeroLayerError,
)
from tests.wire.payloads import distinct_routes, vllm_021_response, vllm_npy_b64, vllm_response


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8, np.uint16])
def test_offline_ndarray_every_dtype(rng: np.random.Generator, dtype: type) -> None:
    routes = distinct_routes(rng, 9, 4, 2, 64)
    trace = decode_vllm(routes.astype(dtype), num_experts=64, num_tokens=10)
    assert np.array_equal(trace.experts, routes)
    assert trace.experts.dtype == np.int16
    assert trace.segments[0].source is Source.VLLM


def test_tensor_input(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 2, 2, 16)
    trace = decode_vllm(torch.from_numpy(routes).to(torch.int32), num_experts=16)
    assert np.array_equal(trace.experts, routes)


def test_http_022_base64_npy_uint8_with_dense_first_layer(rng: np.random.Generator) -> None:
    # DeepSeek-V3 / Moonlight shape: layer 0 dense (zero-filled by the engine), layers 1..5 MoE
    moe = distinct_routes(rng, 12, 5, 3, 64)
    payload = np.concatenate([np.zeros((12, 1, 3), dtype=moe.dtype), moe], axis=1)
    response = vllm_response([vllm_npy_b64(payload, 64)])
    trace = decode_vllm(response, num_experts=64, moe_layers=range(1, 6), num_tokens=13, top_k=3)
    assert trace.layers == (1, 2, 3, 4, 5)
    assert np.array_equal(trace.experts, moe)
    with pytest.raises(ZeroLayerError, match=r"layer\(s\) \[0\] are all zeros.*pass moe_layers="):
        decode_vllm(response, num_experts=64)


def test_http_022_uint16_for_many_experts(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 6, 2, 4, 300)
    text = vllm_npy_b64(routes, 300)
    assert np.load(io.BytesIO(base64.b64decode(text))).dtype == np.uint16
    trace = decode_vllm(vllm_response([text]), num_experts=300)
    assert np.array_equal(trace.experts, routes)


def test_choice_selection_and_prompt_start(rng: np.random.Generator) -> None:
    a, b = distinct_routes(rng, 7, 2, 2, 8), distinct_routes(rng, 5, 2, 2, 8)
    response = vllm_response([vllm_npy_b64(a, 8), vllm_npy_b64(b, 8)])
    trace = decode_vllm(response, num_experts=8, choice=1, prompt_start=3, num_tokens=9)
    assert np.array_equal(trace.experts, b) and trace.start == 3
    with pytest.raises(ConfigError, match="choices index 2 is out of range: the response holds 2"):
        decode_vllm(response, num_experts=8, choice=2)


def test_021_nested_lists_with_prefix_cached_rows(rng: np.random.Generator) -> None:
    prompt = distinct_routes(rng, 6, 3, 2, 16)
    prompt[:4] = -1  # prefix-cached positions: the engine never ran them
    generated = distinct_routes(rng, 4, 3, 2, 16)
    trace = decode_vllm(vllm_021_response(prompt, generated), num_experts=16, num_tokens=11)
    assert np.array_equal(trace.experts, np.concatenate([prompt, generated]))
    assert trace.num_routed == 6
    # explicit prompt_value with plain lists works the same
    again = decode_vllm(generated.tolist(), prompt_value=prompt.tolist(), num_experts=16)
    assert again == trace


@dataclass
class _CompletionOutput:  # the attributes vLLM's offline CompletionOutput exposes
    routed_experts: Any


@dataclass
class _RequestOutput:
    outputs: list[_CompletionOutput]
    prompt_routed_experts: Any = None


def test_offline_output_objects(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 8, 2, 2, 32).astype(np.int32)
    assert np.array_equal(decode_vllm(_RequestOutput([_CompletionOutput(routes)]), num_experts=32).experts, routes)
    assert np.array_equal(decode_vllm(_CompletionOutput(routes), num_experts=32).experts, routes)


def test_none_and_absent_routes() -> None:
    with pytest.raises(MissingRoutesError, match="routed_experts is None: the request was aborted"):
        decode_vllm(vllm_response([None]), num_experts=8)
    with pytest.raises(MissingRoutesError, match="routed_experts is None"):
        decode_vllm(None, num_experts=8)
    with pytest.raises(MissingRoutesError, match="no 'routed_experts' field.*--enable-return-routed-experts"):
        decode_vllm({"choices": [{"index": 0, "text": "x"}]}, num_experts=8)


def test_row_count_contract(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 10, 2, 2, 8)
    decode_vllm(routes, num_experts=8, num_tokens=11)
    with pytest.raises(RowCountError, match=r"10 route rows, expected 9 = num_tokens\(10\).*one row too many"):
        decode_vllm(routes, num_experts=8, num_tokens=10)
    with pytest.raises(RowCountError, match="too few rows: a truncated capture"):
        decode_vllm(routes, num_experts=8, num_tokens=20)
    with pytest.raises(RowCountError, match="payload starts at token 0, not 4"):
        decode_vllm(routes, num_experts=8, num_tokens=11, prompt_start=4)


def test_duplicated_prefix_is_named(rng: np.random.Generator) -> None:
    prompt, generated = distinct_routes(rng, 6, 2, 2, 8), distinct_routes(rng, 4, 2, 2, 8)
    doubled = np.concatenate([prompt, prompt, generated])  # resumed rollout, prompt rows twice
    with pytest.raises(RowCountError, match="the first 6 rows repeat exactly: a duplicated prefix"):
        decode_vllm(vllm_response([vllm_npy_b64(doubled, 8)]), num_experts=8, num_tokens=11)


def test_layer_and_topk_expectations(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 4, 6, 2, 8)
    with pytest.raises(LayerCountError, match="payload has 6 layers but layers= names 3.*pass moe_layers="):
        decode_vllm(routes, num_experts=8, layers=(1, 3, 5))
    with pytest.raises(LayerCountError, match=r"moe_layers names layers \[7\] but the payload has only 6"):
        decode_vllm(routes, num_experts=8, moe_layers=[1, 7])
    with pytest.raises(LayerCountError, match="payload has 6 layers, expected num_layers=48"):
        decode_vllm(routes, num_experts=8, num_layers=48)
    with pytest.raises(TopKMismatchError, match="payload has top-k 2, the model routes to 8"):
        decode_vllm(routes, num_experts=8, top_k=8)
    with pytest.raises(ConfigError, match="disagree"):
        decode_vllm(routes, num_experts=8, layers=[1], moe_layers=[2])


def test_sglang_bytes_sent_to_vllm_decoder_are_explained(rng: np.random.Generator) -> None:
    raw = base64.b64encode(distinct_routes(rng, 3, 2, 2, 8).astype(np.int32).tobytes()).decode()
    with pytest.raises(PayloadEncodingError, match=r"not a \.npy payload.*use decode_sglang"):
        decode_vllm(raw, num_experts=8)


def test_dict_payload_refused() -> None:
    with pytest.raises(PayloadEncodingError, match="got a dict"):
        decode_vllm({"choices": [{"routed_experts": {}}]}, num_experts=8)
