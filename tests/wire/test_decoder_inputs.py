"""What the decoders are handed from the public API: empty vLLM 0.21 lists, None for an integer argument and
routes on the meta device are refused by name; Megatron-LM 0.20's `["ndarray", {...}]` wrapper is read
exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import routereplay
from routereplay import RouteReplayError, decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import ConfigError


def test_empty_vllm_021_lists_are_a_named_error() -> None:
    """VLLM 0.21 lists with
    prompt_routed_experts=[[]] and routed_experts=[] raise a named error, not np.concatenate's ValueError."""
    with pytest.raises(RouteReplayError):
        decode_vllm([], prompt_value=[[]], num_experts=8)
    response = {"prompt_routed_experts": [[]], "choices": [{"index": 0, "routed_experts": []}]}
    with pytest.raises(RouteReplayError):
        decode_vllm(response, num_experts=8)


ROUTES_TLK = np.zeros((3, 2, 2), dtype=np.int32)
ROUTES_TLK[:, :, 1] = 1


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, prompt_start=None), "prompt_start"),
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, max_bytes=None), "max_bytes"),
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, choice=None), "choice"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, start=None), "start"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, index=None), "index"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, max_bytes=None), "max_bytes"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, start_len=None), "start_len"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, index=None), "index"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, choice=None), "choice"),
    ],
)
def test_none_arguments_are_config_errors_naming_the_argument(call, name: str) -> None:
    """None for start / max_bytes / index /
    choice raises ConfigError naming the argument, not TypeError."""
    with pytest.raises(ConfigError, match=name):
        call()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2**70, r"max_bytes=<int of 71 bits> does not fit in int64"),
        (-(2**70), r"max_bytes=<-int of 71 bits> must be >= 0"),
        (2**63, r"max_bytes=9223372036854775808 does not fit in int64"),
    ],
)
def test_an_integer_too_large_to_print_is_named_by_its_width(value: int, message: str) -> None:
    """Issue 38 acceptance: max_bytes=2**70 read "max_bytes=of 71 bits does not fit in int64"."""
    with pytest.raises(ConfigError, match=message):
        decode_vllm(ROUTES_TLK, num_experts=8, max_bytes=value)


def test_meta_device_routes_are_refused_by_the_decoders() -> None:
    """Routes on the meta device given to a
    decoder raise a RouteReplayError, not NotImplementedError."""
    meta = torch.zeros(3, 2, 2, dtype=torch.int32, device="meta")
    for call in (
        lambda: decode_vllm(meta, num_experts=8),
        lambda: decode_megatron(meta, num_experts=8),
        lambda: decode_sglang(meta, num_layers=2, top_k=2, num_experts=8),
        lambda: routereplay.RouteTrace(meta, 8),
    ):
        with pytest.raises(RouteReplayError, match="meta"):
            call()


def test_megatrons_int16_ndarray_wrapper_is_read_exactly() -> None:
    """Megatron-LM 0.20's HTTP server sends moe_topk_indices as
    ["ndarray", {"data": [...], "dtype": "int16"}]; decode_megatron reads it exactly."""
    experts_TLK = np.array([[[0, 3], [5, 1]], [[2, 7], [4, 6]], [[1, 2], [3, 0]]], dtype=np.int16)
    payload = {"moe_topk_indices": ["ndarray", {"data": experts_TLK.tolist(), "dtype": "int16"}]}
    trace = decode_megatron(json.loads(json.dumps(payload)), num_experts=8)
    np.testing.assert_array_equal(np.asarray(trace.experts), experts_TLK)
