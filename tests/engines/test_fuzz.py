"""Fuzz: whatever arrives on the wire, the decoders raise only RouteReplayError (or return a trace)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import RouteReplayError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "routed_experts",
                    "meta_info",
                    "sglext",
                    "sgl_ext",
                    "moe_topk_indices",
                    "prompt_routed_experts",
                    "routed_experts_dtype",
                    "prompt_tokens",
                    "completion_tokens",
                    "x",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=30,
)


def _decode_all(value: Any) -> None:
    for decode in (
        lambda v: decode_vllm(v, num_experts=16),
        lambda v: decode_sglang(v, num_layers=2, top_k=2, num_experts=16),
        lambda v: decode_megatron(v, num_experts=16),
    ):
        try:
            result = decode(value)
        except RouteReplayError:
            continue
        assert isinstance(result, RouteTrace)
        result.validate()  # anything returned has passed the whole catalogue


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_random_base64_payloads(data: bytes) -> None:
    _decode_all(base64.b64encode(data).decode())
    _decode_all(data)


@given(st.text(max_size=80))
@settings(max_examples=200, deadline=None)
def test_random_text(text: str) -> None:
    _decode_all(text)


@given(json_values)
@settings(max_examples=400, deadline=None)
def test_random_json_documents(document: Any) -> None:
    _decode_all(document)


@given(
    st.integers(0, 5),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(-3, 20),
    st.sampled_from(["int8", "uint8", "int16", "uint16", "int32", "int64", "float32"]),
)
@settings(max_examples=200, deadline=None)
def test_random_arrays(tokens: int, layers: int, top_k: int, fill: int, dtype: str) -> None:
    rng = np.random.default_rng(tokens * 1000 + layers * 100 + top_k)
    array = rng.integers(-3, 20, size=(tokens, layers, top_k)).astype(dtype)
    if fill % 3 == 0:
        array[:] = np.array(fill).astype(dtype)  # wraps for unsigned dtypes, like a bad cast would
    _decode_all(array)
