"""Fuzz: whatever arrives on the wire, the decoders raise only RouteReplayError (or return a trace).

Covers decode_vllm, decode_sglang, decode_megatron and the `.npy` parser with hostile input:
random bytes and text, JSON documents with deep nesting, huge integers, non-finite floats and
wrong types in every field, Megatron ndarray wrappers, forged `.npy` headers (huge, negative,
non-int and 65-dim shapes, fortran order, object and structured dtypes), and arguments of the
wrong type. Bounded by `max_examples`; deadlines are off project-wide (tests/conftest.py).

Allocation bound (the README's limits section): decoding a payload of S bytes allocates at most
`ALLOCATION_FACTOR * S + ALLOCATION_SLACK` bytes (tracemalloc peak), whatever its header claims.
"""

from __future__ import annotations

import base64
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import RouteReplayError
from routereplay.wire.payload import load_npy

ALLOCATION_FACTOR = 64  # peak bytes traced per byte of input
ALLOCATION_SLACK = 1 << 20  # fixed bytes for Python bookkeeping, messages and small arrays

FIELDS = [
    "choices",
    "outputs",
    "index",
    "routed_experts",
    "meta_info",
    "sglext",
    "sgl_ext",
    "moe_topk_indices",
    "prompt_routed_experts",
    "routed_experts_dtype",
    "prompt_tokens",
    "completion_tokens",
    "data",
    "dtype",
    "x",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.integers(-(2**200), 2**200)  # beyond int64: numpy makes object arrays of these
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["ndarray", "int16", "uint8", "float32", "object", "AAAA", "{}", "[1]"])
)

json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS), children, max_size=4)
        | st.tuples(st.just("ndarray"), st.dictionaries(st.sampled_from(["data", "dtype", "shape"]), children))
    ),
    max_leaves=30,
)


def nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


deep_values = st.builds(nested, st.integers(1, 5000), scalars)

DECODERS: tuple[Callable[[Any], RouteTrace], ...] = (
    lambda v: decode_vllm(v, num_experts=16),
    lambda v: decode_vllm({"choices": [{"routed_experts": v}], "prompt_routed_experts": v}, num_experts=16),
    lambda v: decode_sglang(v, num_layers=2, top_k=2, num_experts=16),
    lambda v: decode_sglang(
        {"meta_info": {"routed_experts": v, "prompt_tokens": 2}}, num_layers=2, top_k=2, num_experts=16
    ),
    lambda v: decode_megatron(v, num_experts=16),
    lambda v: decode_megatron({"moe_topk_indices": v}, num_experts=16, num_layers=2, top_k=2),
)


def _decode_all(value: Any) -> None:
    for decode in DECODERS:
        try:
            result = decode(value)
        except RouteReplayError:
            continue
        assert isinstance(result, RouteTrace)
        result.validate()  # anything returned has passed the whole catalogue


def _peak_of(call: Callable[[], Any]) -> int:
    """tracemalloc peak of `call()`, which may raise only RouteReplayError."""
    tracemalloc.start()
    try:
        call()
    except RouteReplayError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _assert_bounded(call: Callable[[], Any], input_bytes: int) -> None:
    peak = _peak_of(call)
    bound = ALLOCATION_FACTOR * input_bytes + ALLOCATION_SLACK
    assert peak <= bound, f"decoding {input_bytes} input bytes traced a peak of {peak} bytes (bound {bound})"


# --- random bytes, text, JSON --------------------------------------------------------------------


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_random_base64_payloads(data: bytes) -> None:
    _decode_all(base64.b64encode(data).decode())
    _decode_all(data)


@given(st.text(max_size=80))
@settings(max_examples=200)
def test_random_text(text: str) -> None:
    _decode_all(text)


@given(json_values)
@settings(max_examples=400)
def test_random_json_documents(document: Any) -> None:
    """Wrong types everywhere, huge ints, NaN/inf, malformed ndarray wrappers: only named errors."""
    _decode_all(document)
    _decode_all(json.loads(json.dumps(document)))  # tuples become lists, as on the wire


@given(deep_values)
@settings(max_examples=40)
def test_deeply_nested_documents(document: Any) -> None:
    """Nesting far beyond the interpreter's recursion limit: only named errors."""
    _decode_all(document)
    _decode_all({"choices": [{"index": document, "routed_experts": document}]})


@given(
    st.integers(0, 5),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(-3, 20),
    st.sampled_from(["int8", "uint8", "int16", "uint16", "int32", "int64", "float32", "bool"]),
)
@settings(max_examples=200)
def test_random_arrays(tokens: int, layers: int, top_k: int, fill: int, dtype: str) -> None:
    rng = np.random.default_rng(tokens * 1000 + layers * 100 + top_k)
    array = rng.integers(-3, 20, size=(tokens, layers, top_k)).astype(dtype)
    if fill % 3 == 0:
        array[:] = np.array(fill).astype(dtype)  # wraps for unsigned dtypes, like a bad cast would
    _decode_all(array)
    _decode_all(["ndarray", {"data": array.tolist(), "dtype": dtype}])


# --- forged .npy headers ---------------------------------------------------------------------------

dims = st.sampled_from([0, 1, 2, 3, 8, 255, 1025, 10**7, 2**31, 2**63, 2**64, -1]) | st.integers(-5, 40)
weird_dims = st.sampled_from(["True", "1.5", "None", "'x'", "(1,)", "9" * 400])
shapes = st.lists(dims, max_size=70).map(lambda d: "(" + "".join(f"{n}, " for n in d) + ")") | st.lists(
    dims | weird_dims, min_size=1, max_size=4
).map(lambda d: "(" + ", ".join(map(str, d)) + ",)")
descrs = st.sampled_from(
    [
        *("'|u1'", "'<u2'", "'>u2'", "'<i4'", "'<i8'", "'<u8'", "'|O'", "'<f4'", "'|b1'", "'<U3'", "'|V8'", "'x'"),
        *("[('a', '<i4')]", "[('a', '|O')]", "1", "None"),
    ]
)
fortrans = st.sampled_from(["False", "True", "'yes'", "1", "None"])


def forged_npy(shape: str, descr: str, fortran: str, body: bytes, version: int) -> bytes:
    header = f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}".encode("latin1")
    prefix = 10 if version == 1 else 12
    header += b" " * (63 - (prefix + len(header)) % 64) + b"\n"
    size = len(header).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + header + body


@given(shapes, descrs, fortrans, st.binary(max_size=64), st.sampled_from([1, 2, 3]))
@settings(max_examples=400)
def test_forged_npy_headers(shape: str, descr: str, fortran: str, body: bytes, version: int) -> None:
    """Huge, negative, non-int and 65-dim shapes, fortran order, object dtypes: named errors only."""
    data = forged_npy(shape, descr, fortran, body, version)
    for call in (
        lambda: load_npy(data, "fuzz"),
        lambda: decode_vllm(base64.b64encode(data).decode(), num_experts=300),
        lambda: decode_megatron({"moe_topk_indices": base64.b64encode(data).decode()}, num_experts=300),
    ):
        try:
            result = call()
        except RouteReplayError:
            continue
        assert isinstance(result, (np.ndarray, RouteTrace))


# empty (T, L, K) shapes: the body-size check passes with no bytes, whatever the other axes claim
big_dims = st.sampled_from([1, 2, 8, 1025, 4096, 10**5, 10**6])
empty_shapes = st.tuples(st.integers(0, 2), big_dims, big_dims).map(
    lambda d: tuple(0 if i == d[0] else n for i, n in enumerate(d))
)


@given(empty_shapes, st.sampled_from(["'|u1'", "'<u2'", "'<i4'"]), fortrans)
@settings(max_examples=60)
def test_empty_npy_allocation_is_bounded(shape: tuple[int, ...], descr: str, fortran: str) -> None:
    """Resource exhaustion (issue 11 item 4): a header's claims never buy allocation beyond the bound.

    A ~170-byte `.npy` of shape (0, 10**6, 8) used to build a million layer numbers.
    """
    text = base64.b64encode(forged_npy(str(shape), descr, fortran, b"", 1)).decode()
    _assert_bounded(lambda: decode_vllm(text, num_experts=300), len(text))
    _assert_bounded(lambda: decode_megatron({"moe_topk_indices": text}, num_experts=300), len(text))
    _assert_bounded(lambda: decode_vllm(np.zeros(shape, np.uint8), num_experts=300), 0)


@given(shapes, descrs, fortrans, st.binary(max_size=64))
@settings(max_examples=150)
def test_forged_npy_allocation_is_bounded(shape: str, descr: str, fortran: str, body: bytes) -> None:
    """Resource exhaustion (issue 11 item 4): arbitrary forged headers stay within the bound too."""
    data = forged_npy(shape, descr, fortran, body, 1)
    text = base64.b64encode(data).decode()
    _assert_bounded(lambda: decode_vllm(text, num_experts=300), len(text))
    _assert_bounded(lambda: decode_megatron(text, num_experts=300), len(text))


@given(
    st.integers(0, 64),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from(["uint8", "int32"]),
)
@settings(max_examples=60)
def test_flat_payload_allocation_is_bounded(rows: int, layers: int, top_k: int, dtype: str) -> None:
    """Resource exhaustion (issue 11 item 4): real-sized payloads, right and wrong splits, stay in bound."""
    rng = np.random.default_rng(rows)
    ids = rng.integers(-1, 16, size=(rows, layers, top_k)).astype(dtype)
    text = base64.b64encode(ids.tobytes()).decode()
    for guess in ((layers, top_k), (top_k, layers), (1, layers * top_k)):
        _assert_bounded(
            lambda g=guess: decode_sglang(  # type: ignore[misc]
                text, num_layers=g[0], top_k=g[1], num_experts=16, dtype=dtype, num_tokens=rows + 1
            ),
            len(text),
        )


# --- arguments of the wrong type ---------------------------------------------------------------------

bad_arguments = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=True)
    | st.text(max_size=5)
    | st.integers(-(2**70), 2**70)
    | st.lists(st.integers(-3, 3), max_size=3)
    | st.just(np.int64(2))
)
ARGUMENTS = {
    decode_vllm: [
        *("num_experts", "layers", "moe_layers", "num_tokens", "num_layers", "top_k", "prompt_start"),
        *("choice", "sequence", "policy_version", "max_bytes", "validate", "limits"),
    ],
    decode_sglang: [
        *("num_experts", "num_layers", "top_k", "moe_layers", "start_len", "num_tokens", "dtype", "layers"),
        *("index", "choice", "sequence", "policy_version", "max_bytes", "validate", "limits"),
    ],
    decode_megatron: [
        *("num_experts", "layers", "moe_layers", "num_layers", "top_k", "num_tokens", "start", "index"),
        *("sequence", "policy_version", "max_bytes", "validate", "limits"),
    ],
}
REQUIRED = {decode_vllm: {"num_experts": 16}, decode_sglang: {"num_experts": 16, "num_layers": 2, "top_k": 2}}


@given(st.sampled_from(list(ARGUMENTS)), st.data())
@settings(max_examples=300)
def test_wrong_argument_types(decode: Any, data: st.DataObject) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): any argument of any type."""
    kwargs: dict[str, Any] = dict(REQUIRED.get(decode, {"num_experts": 16}))
    for name in data.draw(st.lists(st.sampled_from(ARGUMENTS[decode]), min_size=1, max_size=3, unique=True)):
        kwargs[name] = data.draw(bad_arguments, label=name)
    payload = data.draw(st.sampled_from([np.zeros((2, 2, 2), np.int32), [[[0, 1], [2, 3]]], []]))
    try:
        result = decode(payload, **kwargs)
    except RouteReplayError:
        return
    assert isinstance(result, RouteTrace)
