"""Hostile and mistaken wire input (issue 11): each test names its defect class and item.

Forged `.npy` headers, multi-choice responses whose routes belong to another choice, arguments of
the wrong type, Megatron-LM 0.20's ndarray wrapper, and shape mistakes whose hint used to point
the wrong way.
"""

from __future__ import annotations

import base64
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from routereplay import decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import (
    AmbiguousChoiceError,
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    LayerCountError,
    PayloadEncodingError,
    PayloadLimitError,
    PickleRefusedError,
    RowCountError,
    TopKMismatchError,
    TraceShapeError,
)
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints
from routereplay.wire.limits import DEFAULT_MAX_LAYERS, WireLimits
from routereplay.wire.payload import load_npy
from tests.wire.payloads import distinct_routes, sglang_b64, sglang_generate, vllm_npy_b64, vllm_response

HEADER_SLACK = 1 << 20  # bytes of Python bookkeeping allowed when refusing a forged header


def forged_npy(shape: str, descr: str = "|u1", fortran: str = "False", body: bytes = b"", extra: str = "") -> bytes:
    """`.npy` bytes whose header says exactly what we write (np.save would refuse most of these)."""
    descr_text = descr if descr.startswith("[") else repr(descr)  # a list descr is a structured dtype
    header = f"{{'descr': {descr_text}, 'fortran_order': {fortran}, 'shape': {shape}, {extra}}}".encode("latin1")
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def peak_bytes(call: Any) -> tuple[int, BaseException | None]:
    """Peak traced allocation of `call()` and the exception it raised (None if it returned)."""
    tracemalloc.start()
    try:
        call()
        raised: BaseException | None = None
    except BaseException as exc:  # the caller asserts on the type
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


# --- item 1: SGLang n > 1 ----------------------------------------------------------------------


def test_sglang_response_level_routes_are_refused_for_another_choice(rng: np.random.Generator) -> None:
    """Silent misroute (issue 11 item 1): sglext.routed_experts holds choice 0's routes only.

    Both choices have the same length, so no row count can catch it: `choice=1` used to return
    choice 0's routes.
    """
    first = distinct_routes(rng, 6, 4, 2, 16)
    response = {
        "choices": [{"index": 0, "message": {"content": "a"}}, {"index": 1, "message": {"content": "b"}}],
        "sglext": {"routed_experts": sglang_b64(first)},
    }
    shape: dict[str, Any] = {"num_layers": 4, "top_k": 2, "num_experts": 16, "num_tokens": 7}
    with pytest.raises(AmbiguousChoiceError, match=r"choice=1 asked.*first choice only \(2 choices here\)"):
        decode_sglang(response, choice=1, **shape)
    assert np.array_equal(decode_sglang(response, choice=0, **shape).experts, first)


def test_sglang_per_choice_form_and_mismatched_list(rng: np.random.Generator) -> None:
    """Silent misroute (issue 11 item 1): the per-choice sgl_ext answers for its own choice only."""
    a, b = distinct_routes(rng, 5, 4, 2, 16), distinct_routes(rng, 5, 4, 2, 16)
    shape: dict[str, Any] = {"num_layers": 4, "top_k": 2, "num_experts": 16}
    per_choice = {"choices": [{"sgl_ext": {"routed_experts": sglang_b64(x)}} for x in (a, b)]}
    assert np.array_equal(decode_sglang(per_choice, choice=1, **shape).experts, b)
    short_list = {"choices": [{}, {}, {}], "sglext": {"routed_experts": [sglang_b64(a), sglang_b64(b)]}}
    with pytest.raises(AmbiguousChoiceError, match="lists 2 payloads for 3 choices"):
        decode_sglang(short_list, choice=1, **shape)
    with pytest.raises(ConfigError, match="choice=1 picks a choice of an OpenAI-style response"):
        decode_sglang(sglang_generate(a, 3, 3), choice=1, **shape)


def test_choices_are_matched_by_index_not_position(rng: np.random.Generator) -> None:
    """Silent misroute (issue 11 item 1): a reordered choice list handed back another sample's routes.

    Choices are matched by their `index` field; duplicates or missing indices are refused.
    """
    a, b = distinct_routes(rng, 4, 2, 2, 8), distinct_routes(rng, 4, 2, 2, 8)
    response = vllm_response([vllm_npy_b64(a, 8), vllm_npy_b64(b, 8)])
    response["choices"].reverse()
    assert np.array_equal(decode_vllm(response, num_experts=8, choice=0).experts, a)
    assert np.array_equal(decode_vllm(response, num_experts=8, choice=1).experts, b)
    response["choices"][0]["index"] = 0  # now two choices claim index 0
    with pytest.raises(AmbiguousChoiceError, match="2 choices carry index 0"):
        decode_vllm(response, num_experts=8)
    del response["choices"][0]["index"]
    with pytest.raises(AmbiguousChoiceError, match="no integer index field"):
        decode_vllm(response, num_experts=8)
    with pytest.raises(
        ConfigError, match=r"choices index 5 is out of range: the response holds 2 \(indices \[0, 1\]\)"
    ):
        decode_vllm(vllm_response([vllm_npy_b64(a, 8), vllm_npy_b64(b, 8)]), num_experts=8, choice=5)


# --- items 4 and 9: forged .npy headers --------------------------------------------------------


@pytest.mark.parametrize("route", ["vllm", "megatron", "read_trace"])
def test_empty_npy_with_huge_layer_axis_is_refused_unallocated(route: str, tmp_path: Path) -> None:
    """Resource exhaustion (issue 11 item 4): a ~170-byte `.npy` of shape (0, 10**7, 8).

    It built tuple(range(10**7)) (13 s, 1 GB). Now it is refused from its header, with a traced
    peak far below the 1 GB it used to cost.
    """
    data = forged_npy("(0, 10000000, 8)")
    assert len(data) < 200
    calls = {
        "vllm": lambda: decode_vllm(b64(data), num_experts=8),
        "megatron": lambda: decode_megatron({"moe_topk_indices": b64(data)}, num_experts=8),
        "read_trace": lambda: read_trace(_write(tmp_path / "forged.npy", data), PayloadHints(num_experts=8)),
    }
    peak, raised = peak_bytes(calls[route])
    assert isinstance(raised, PayloadLimitError), raised
    assert "declares 10000000 layers" in str(raised) and "WireLimits.max_layers=1024" in str(raised)
    assert peak < HEADER_SLACK, f"refusing a {len(data)}-byte header traced {peak} bytes"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_arrays_and_lists_with_huge_axes_are_refused() -> None:
    """Resource exhaustion (issue 11 item 4): in-process arrays reach the same O(L) work."""
    with pytest.raises(PayloadLimitError, match="declares 2000 layers"):
        decode_vllm(np.zeros((0, 2000, 8), np.int32), num_experts=8)
    with pytest.raises(PayloadLimitError, match="declares 5000 top_k"):
        decode_megatron(np.zeros((0, 4, 5000), np.int16), num_experts=8)
    with pytest.raises(TraceShapeError, match="has 3 rows but no layers or no top-k"):
        decode_vllm(np.zeros((3, 0, 8), np.int32), num_experts=8)


def test_limits_are_adjustable() -> None:
    """Resource exhaustion (issue 11 item 4): the bound is a parameter, not a wall."""
    genuine = np.zeros((0, DEFAULT_MAX_LAYERS + 1, 2), np.int32)
    with pytest.raises(PayloadLimitError):
        decode_vllm(genuine, num_experts=8)
    trace = decode_vllm(genuine, num_experts=8, limits=WireLimits(max_layers=DEFAULT_MAX_LAYERS + 1))
    assert trace.num_layers == DEFAULT_MAX_LAYERS + 1
    with pytest.raises(ConfigError, match="num_layers=2000 is above WireLimits.max_layers=1024"):
        decode_sglang("", num_layers=2000, top_k=8, num_experts=64)
    with pytest.raises(ConfigError, match="WireLimits.max_rows=0 must be >= 1"):
        WireLimits(max_rows=0)


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ("(" + "1, " * 65 + ")", TraceShapeError, r"declares 65 dimensions \(1, 1, 1, 1, 1, 1, \.\.\. 65 dims\)"),
        ("(0, 9223372036854775808, 8)", PayloadLimitError, "declares 9223372036854775808 layers"),
        ("(9223372036854775807, 0, 0)", PayloadLimitError, "declares 9223372036854775807 rows"),
        ("(0, -1, 8)", PayloadEncodingError, "negative shape"),
        ("(True, 1, 1)", PayloadEncodingError, "not a tuple of ints"),
        ("(1.5, 1, 1)", PayloadEncodingError, "not a tuple of ints"),
        ("[1, 1, 1]", PayloadEncodingError, "not a tuple of ints"),
        ("(" + "9" * 5000 + ", 1, 1)", PayloadEncodingError, "malformed .npy header"),
        ("(" * 500 + ")" * 500, PayloadEncodingError, "malformed .npy header"),
    ],
)
def test_forged_npy_shapes_raise_named_errors(shape: str, error: type[Exception], message: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 9): numpy's own ValueError escaped.

    65 dimensions and (0, 2**63, 8) raised `ValueError` from numpy; every forged shape is now a
    named error raised from the header alone.
    """
    with pytest.raises(error, match=message):
        load_npy(forged_npy(shape), "x")


@pytest.mark.parametrize(
    ("descr", "fortran", "extra", "error", "message"),
    [
        ("|O", "False", "", PickleRefusedError, "object dtype"),
        ("<f4", "False", "", DtypeError, "dtype float32"),
        ("[('a', '<i4')]", "False", "", DtypeError, "routed experts are integers"),
        ("not a dtype", "False", "", PayloadEncodingError, "malformed .npy dtype"),
        ("|u1", "'yes'", "", PayloadEncodingError, "fortran_order 'yes' is not a bool"),
        ("|u1", "False", "'x': 1, ", PayloadEncodingError, "expected the keys descr, fortran_order, shape"),
    ],
)
def test_forged_npy_headers_raise_named_errors(
    descr: str, fortran: str, extra: str, error: type[Exception], message: str
) -> None:
    """Error that is not a RouteReplayError (issue 11 item 9): every malformed header field is named."""
    with pytest.raises(error, match=message):
        load_npy(forged_npy("(1, 1, 1)", descr, fortran, b"\x00", extra), "x")


# --- item 12: empty parts of a vLLM 0.21 split payload ------------------------------------------


def test_empty_prompt_row_list_is_a_named_shape_error(rng: np.random.Generator) -> None:
    """Error that is not a RouteReplayError (issue 11 item 12): np.concatenate's ValueError escaped."""
    with pytest.raises(TraceShapeError, match=r"prompt_routed_experts has shape \(1, 0\).*not \[\[\]\]"):
        decode_vllm([], prompt_value=[[]], num_experts=8)
    generated = distinct_routes(rng, 3, 2, 2, 8)
    assert np.array_equal(decode_vllm(generated.tolist(), prompt_value=[], num_experts=8).experts, generated)
    assert np.array_equal(decode_vllm([], prompt_value=generated.tolist(), num_experts=8).experts, generated)
    assert decode_vllm([], prompt_value=[], num_experts=8, num_layers=2, top_k=2).num_tokens == 0
    with pytest.raises(TraceShapeError, match="pass num_layers"):
        decode_vllm([], prompt_value=[], num_experts=8)


# --- item 13: argument types --------------------------------------------------------------------

_GOOD = np.zeros((0, 2, 2), np.int32)
_DECODERS: dict[str, Any] = {
    "vllm": lambda **kw: decode_vllm(_GOOD, **{"num_experts": 8, **kw}),
    "sglang": lambda **kw: decode_sglang(_GOOD, **{"num_layers": 2, "top_k": 2, "num_experts": 8, **kw}),
    "megatron": lambda **kw: decode_megatron(_GOOD, **{"num_experts": 8, **kw}),
}
_INT_ARGS = {
    "vllm": ["num_experts", "prompt_start", "choice", "max_bytes"],
    "sglang": ["num_experts", "num_layers", "top_k", "start_len", "index", "choice", "max_bytes"],
    "megatron": ["num_experts", "start", "index", "max_bytes"],
}
_OPTIONAL_INT_ARGS = {
    "vllm": ["num_tokens", "num_layers", "top_k", "policy_version"],
    "sglang": ["num_tokens", "policy_version"],
    "megatron": ["num_tokens", "num_layers", "top_k", "policy_version"],
}


@pytest.mark.parametrize(
    ("decoder", "name", "bad"),
    [
        (decoder, name, bad)
        for decoder in _DECODERS
        for name in _INT_ARGS[decoder] + _OPTIONAL_INT_ARGS[decoder]
        for bad in (None, True, 1.5, "3", -1)
        if not (bad is None and name in _OPTIONAL_INT_ARGS[decoder])
    ],
)
def test_wrong_argument_types_are_config_errors(decoder: str, name: str, bad: Any) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): None for start/index/choice was a TypeError."""
    with pytest.raises(ConfigError, match=name):
        _DECODERS[decoder](**{name: bad})


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("layers", [0.5, 1], r"layers\[0\] must be an int"),
        ("moe_layers", "01", "must be a sequence of global layer numbers"),
        ("moe_layers", [0, 0], "names a layer twice"),
        ("validate", "yes", "validate must be True or False"),
        ("sequence", 1.5, "sequence must be a str, an int or None"),
        ("limits", {"max_rows": 1}, "limits must be a WireLimits"),
    ],
)
@pytest.mark.parametrize("decoder", list(_DECODERS))
def test_wrong_sequence_and_flag_arguments_are_config_errors(decoder: str, name: str, bad: Any, message: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): layer lists and flags are checked too."""
    with pytest.raises(ConfigError, match=message):
        _DECODERS[decoder](**{name: bad})


# --- item 19: Megatron-LM 0.20 ndarray wrapper -------------------------------------------------


def test_megatron_ndarray_wrapper_is_decoded(rng: np.random.Generator, tmp_path: Path) -> None:
    """Error that is not a RouteReplayError (issue 11 item 19): the 0.20 server's form was refused.

    `InferenceClient(deserialize=False)` sends `["ndarray", {"data": nested lists, "dtype": "int16"}]`.
    """
    routes = distinct_routes(rng, 7, 3, 2, 32).astype(np.int16)
    wrapper = ["ndarray", {"data": routes.tolist(), "dtype": "int16"}]
    response = json.loads(json.dumps({"text": "x", "moe_topk_indices": wrapper}))
    trace = decode_megatron(response, num_experts=32, num_tokens=8, top_k=2)
    assert np.array_equal(trace.experts, routes)
    assert np.array_equal(decode_megatron(("ndarray", wrapper[1]), num_experts=32).experts, routes)
    path = tmp_path / "megatron.json"
    path.write_text(json.dumps(response))
    assert np.array_equal(read_trace(path, PayloadHints(num_experts=32))[0].experts, routes)


@pytest.mark.parametrize(
    ("wrapper", "error", "message"),
    [
        (["ndarray"], PayloadEncodingError, "malformed"),
        (["ndarray", {"data": [[[1, 2]]]}], PayloadEncodingError, "expected exactly data and dtype"),
        (["ndarray", {"data": [[[1, 2]]], "dtype": "int16", "shape": [1]}], PayloadEncodingError, "exactly"),
        (["ndarray", {"data": [[[1, 2]]], "dtype": "float32"}], DtypeError, "'float32' is not an integer type"),
        (["ndarray", {"data": [[[1, 2]]], "dtype": "object"}], DtypeError, "'object' is not an integer type"),
        (["ndarray", {"data": [[[1, 2]]], "dtype": "<i2,<i2"}], DtypeError, "not a dtype name this release"),
        (["ndarray", {"data": [[[1, 2]]], "dtype": 16}], DtypeError, "must be a dtype name, got int"),
        (["ndarray", {"data": "AAEC", "dtype": "int16"}], PayloadEncodingError, "data is str"),
        (["ndarray", {"data": [[[1, 300]]], "dtype": "int8"}], DtypeError, "holds 300, outside its range"),
        (["ndarray", {"data": [[[1.5, 2]]], "dtype": "int16"}], DtypeError, "nested lists hold float64"),
        (["ndarray", [[[1, 2]]]], PayloadEncodingError, "malformed"),
    ],
)
def test_malformed_megatron_ndarray_wrappers_are_named(
    wrapper: list[Any], error: type[Exception], message: str
) -> None:
    """Error that is not a RouteReplayError (issue 11 item 19): dtype whitelist and wrapper shape."""
    with pytest.raises(error, match=message):
        decode_megatron({"moe_topk_indices": wrapper}, num_experts=8)


# --- item 31: hints that pointed the wrong way ---------------------------------------------------


def test_wrong_top_k_on_sglang_names_top_k_not_a_stale_buffer(rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 31): a wrong top_k blamed "another sequence, or a stale buffer"."""
    routes = distinct_routes(rng, 6, 4, 4, 16)
    response = sglang_generate(routes, 3, 4)  # 6 rows = 3 + 4 - 1
    with pytest.raises(TopKMismatchError, match=r"12 route rows, expected 6.*It fits num_layers=4, top_k=4") as bad:
        decode_sglang(response, num_layers=4, top_k=2, num_experts=16)
    assert "stale" not in str(bad.value)
    with pytest.raises(TopKMismatchError, match="It fits num_layers=4, top_k=4"):
        decode_sglang(response, num_layers=4, top_k=8, num_experts=16)
    with pytest.raises(LayerCountError, match="It fits num_layers=4, top_k=4"):
        decode_sglang(response, num_layers=3, top_k=4, num_experts=16)
    odd = distinct_routes(rng, 5, 4, 3, 16)  # 60 ids: not a multiple of 4 x 2
    with pytest.raises(TopKMismatchError, match="make exactly 5 rows of 12 ids.*fits num_layers=4, top_k=3"):
        decode_sglang(sglang_b64(odd), num_layers=4, top_k=2, num_experts=16, num_tokens=6)


def test_same_product_split_is_named_not_blamed_on_zero_padding(rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 31): 24 x 16 for a 48 x 8 payload blamed zero padding alone."""
    routes = distinct_routes(rng, 10, 48, 8, 64)
    with pytest.raises(DuplicateExpertError, match=r"read cleanly as num_layers=48, top_k=8"):
        decode_sglang(sglang_b64(routes), num_layers=24, top_k=16, num_experts=64, num_tokens=11)


def test_duplicated_prefix_keeps_its_own_diagnosis_on_flat_payloads(rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 31): the split hint must not hide a real duplicated prefix."""
    prompt, generated = distinct_routes(rng, 4, 2, 2, 8), distinct_routes(rng, 2, 2, 2, 8)
    doubled = np.concatenate([prompt, prompt, generated])
    with pytest.raises(RowCountError, match="duplicated prefix"):
        decode_sglang(sglang_b64(doubled), num_layers=2, top_k=2, num_experts=8, num_tokens=7)


@pytest.mark.parametrize("decoder", list(_DECODERS))
def test_response_text_is_not_called_corrupt_base64(decoder: str, rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 31): raw JSON text was reported as corrupt base64."""
    text = json.dumps(vllm_response([vllm_npy_b64(distinct_routes(rng, 3, 2, 2, 8), 8)]))
    decode = {
        "vllm": lambda: decode_vllm(text, num_experts=8),
        "sglang": lambda: decode_sglang(text, num_layers=2, top_k=2, num_experts=8),
        "megatron": lambda: decode_megatron(text, num_experts=8),
    }[decoder]
    with pytest.raises(PayloadEncodingError, match=r"got JSON text .*pass the parsed JSON \(json\.loads") as bad:
        decode()
    assert "corrupt" not in str(bad.value)
