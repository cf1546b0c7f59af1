"""decode_megatron on Megatron inference responses (moe_topk_indices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay import Source, decode_megatron
from routereplay.errors import MissingRoutesError, RowCountError, TraceShapeError
from tests.wire.payloads import distinct_routes, vllm_npy_b64


def test_response_nested_lists_int16(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 9, 3, 2, 32).astype(np.int16)
    response = {"text": "x", "moe_topk_indices": routes.tolist()}
    trace = decode_megatron(response, num_experts=32, num_tokens=10, top_k=2)
    assert np.array_equal(trace.experts, routes)
    assert trace.segments[0].source is Source.MEGATRON


def test_tensor_choices_and_lists_of_results(rng: np.random.Generator) -> None:
    a, b = distinct_routes(rng, 4, 3, 2, 32), distinct_routes(rng, 6, 3, 2, 32)
    assert np.array_equal(decode_megatron(torch.from_numpy(a), num_experts=32).experts, a)
    results = [{"moe_topk_indices": a.tolist()}, {"moe_topk_indices": b.tolist()}]
    assert np.array_equal(decode_megatron(results, num_experts=32, index=1).experts, b)
    choices = {"choices": [{"moe_topk_indices": a.tolist()}, {"moe_topk_indices": b.tolist()}]}
    assert np.array_equal(decode_megatron(choices, num_experts=32, index=1).experts, b)
    assert np.array_equal(decode_megatron(vllm_npy_b64(a, 32), num_experts=32).experts, a)


def test_all_layer_payload_and_errors(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 4, 3, 2, 32)
    routes[:, 0] = 0
    assert decode_megatron(routes, num_experts=32, moe_layers=[1, 2]).layers == (1, 2)
    with pytest.raises(RowCountError, match="expected 7"):
        decode_megatron(routes[:, 1:], num_experts=32, num_tokens=8)
    with pytest.raises(MissingRoutesError, match="carries no moe_topk_indices"):
        decode_megatron({"text": "x"}, num_experts=32)
    with pytest.raises(TraceShapeError, match="empty list; pass num_layers"):
        decode_megatron({"moe_topk_indices": []}, num_experts=32)
    assert (
        decode_megatron({"moe_topk_indices": []}, num_experts=32, num_layers=3, top_k=2, num_tokens=1).num_tokens == 0
    )
