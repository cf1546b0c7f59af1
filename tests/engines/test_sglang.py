"""decode_sglang on byte-exact SGLang payloads: /generate, OpenAI sglext / sgl_ext, tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay import Source, decode_sglang
from routereplay.errors import (
    ConfigError,
    DtypeError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadSizeError,
    RouteValueError,
    RowCountError,
    TraceShapeError,
)
from tests.wire.payloads import distinct_routes, sglang_b64, sglang_generate

SHAPE = {"num_layers": 4, "top_k": 2, "num_experts": 16}


def test_generate_meta_info_int32(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 11, 4, 2, 16)
    trace = decode_sglang(sglang_generate(routes, 5, 7), **SHAPE)
    assert np.array_equal(trace.experts, routes)
    assert trace.segments[0].source is Source.SGLANG


def test_meta_info_lengths_check_rows(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 11, 4, 2, 16)
    with pytest.raises(RowCountError, match=r"meta_info prompt_tokens\+completion_tokens\(13\)"):
        decode_sglang(sglang_generate(routes, 5, 8), **SHAPE)
    # an explicit num_tokens overrides meta_info
    decode_sglang(sglang_generate(routes, 5, 8), num_tokens=12, **SHAPE)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_routed_experts_dtype_field(rng: np.random.Generator, dtype: str) -> None:
    routes = distinct_routes(rng, 6, 4, 2, 16)
    response = sglang_generate(routes, 3, 4, dtype=dtype, routed_experts_dtype=dtype)
    assert np.array_equal(decode_sglang(response, **SHAPE).experts, routes)


def test_dtype_argument_and_bad_dtype(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 6, 4, 2, 16)
    assert np.array_equal(decode_sglang(sglang_b64(routes, "uint8"), dtype="uint8", **SHAPE).experts, routes)
    with pytest.raises(DtypeError, match="routed_experts_dtype 'float32' is not an integer type"):
        decode_sglang(sglang_b64(routes), dtype="float32", **SHAPE)


def test_start_len_and_moe_layers(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 8, 4, 2, 16)
    routes[:, 0] = 0  # layer 0 is dense
    trace = decode_sglang(sglang_b64(routes), start_len=6, num_tokens=15, moe_layers=[1, 2, 3], **SHAPE)
    assert (trace.start, trace.stop, trace.layers) == (6, 14, (1, 2, 3))
    assert np.array_equal(trace.experts, routes[:, 1:])


def test_openai_per_choice_sgl_ext_and_response_sglext(rng: np.random.Generator) -> None:
    a, b = distinct_routes(rng, 5, 4, 2, 16), distinct_routes(rng, 5, 4, 2, 16)
    per_choice = {
        "choices": [
            {"index": 0, "sgl_ext": {"routed_experts": sglang_b64(a)}},
            {"index": 1, "sgl_ext": {"routed_experts": sglang_b64(b)}},
        ]
    }
    assert np.array_equal(decode_sglang(per_choice, choice=1, **SHAPE).experts, b)
    response_level = {
        "choices": [{"index": 0, "message": {"content": "x"}}],
        "sglext": {"routed_experts": sglang_b64(a)},
    }
    assert np.array_equal(decode_sglang(response_level, **SHAPE).experts, a)
    listed = {"choices": [{}, {}], "sglext": {"routed_experts": [sglang_b64(a), sglang_b64(b)]}}
    assert np.array_equal(decode_sglang(listed, choice=1, **SHAPE).experts, b)


def test_batched_generate_list(rng: np.random.Generator) -> None:
    a, b = distinct_routes(rng, 5, 4, 2, 16), distinct_routes(rng, 7, 4, 2, 16)
    batch = [sglang_generate(a, 2, 4), sglang_generate(b, 3, 5)]
    trace = decode_sglang(batch, index=1, **SHAPE)
    assert np.array_equal(trace.experts, b)
    with pytest.raises(ConfigError, match="requests index 2 is out of range: the response holds 2"):
        decode_sglang(batch, index=2, **SHAPE)


def test_skip_tokenizer_init_tensor_and_empty_dict(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 4, 2, 16)
    tensor = torch.from_numpy(routes).to(torch.int32)
    assert np.array_equal(decode_sglang({"meta_info": {"routed_experts": tensor}}, **SHAPE).experts, routes)
    assert np.array_equal(decode_sglang(tensor.flatten(), **SHAPE).experts, routes)
    with pytest.raises(PayloadEncodingError, match=r"skip_tokenizer_init=True .* serialises as \{\}"):
        decode_sglang({"meta_info": {"routed_experts": {}}}, **SHAPE)


def test_byte_length_not_divisible(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 4, 2, 16)
    with pytest.raises(PayloadSizeError, match=r"is not a multiple of num_layers\(3\) x top_k\(2\)"):
        decode_sglang(sglang_b64(routes), num_layers=3, top_k=2, num_experts=16)
    # uint16 bytes (SGLANG_ROUTED_EXPERTS_DTYPE set) whose dtype field was dropped: read as int32
    with pytest.raises(PayloadSizeError, match="would fit dtype uint16, uint8"):
        decode_sglang(sglang_b64(routes, "uint16"), **SHAPE)


def test_wrong_dtype_never_decodes_silently(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 4, 4, 2, 16)
    # int32 bytes read as uint8 (wrong routed_experts_dtype): the length fits, the high zero bytes
    # turn into whole layers of expert 0, which validation refuses
    with pytest.raises(RouteValueError, match="all zeros"):
        decode_sglang(sglang_b64(routes), num_layers=4, top_k=2, num_experts=16, dtype="uint8")


def test_missing_and_none() -> None:
    with pytest.raises(MissingRoutesError, match="aborted before any forward pass"):
        decode_sglang({"meta_info": {"routed_experts": None}}, **SHAPE)
    with pytest.raises(
        MissingRoutesError, match=r"looked in meta_info, choices\[0\].sgl_ext / .nvext, sglext and nvext"
    ):
        decode_sglang({"text": "x", "choices": [{}]}, **SHAPE)
    with pytest.raises(MissingRoutesError, match="is None"):
        decode_sglang(None, **SHAPE)


def test_array_shape_that_cannot_fit(rng: np.random.Generator) -> None:
    with pytest.raises(TraceShapeError, match=r"cannot be viewed as \(tokens, 4, 2\)"):
        decode_sglang(np.zeros((3, 5), dtype=np.int32), **SHAPE)
