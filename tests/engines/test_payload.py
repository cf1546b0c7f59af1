"""Payload containers: strict base64, pickle-free .npy, size checks before allocation."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pytest

from routereplay import decode_sglang, decode_vllm
from routereplay.errors import DtypeError, PayloadEncodingError, PayloadSizeError, PickleRefusedError
from routereplay.wire.payload import b64_to_bytes, load_npy, npy_bytes
from tests.wire.payloads import distinct_routes, vllm_npy_b64


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, ("raise SystemExit('pickle executed')",))


def test_pickle_payload_is_refused_not_executed() -> None:
    text = base64.b64encode(pickle.dumps(_Boom())).decode()
    with pytest.raises(PickleRefusedError, match="is a Python pickle.*never unpickles"):
        decode_vllm(text, num_experts=8)


def test_object_npy_is_refused() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Boom()], dtype=object), allow_pickle=True)
    with pytest.raises(PickleRefusedError, match="object dtype"):
        decode_vllm(base64.b64encode(buffer.getvalue()).decode(), num_experts=8)


def test_float_npy_and_float_lists_are_refused(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 3, 2, 2, 8).astype(np.float32)
    text = base64.b64encode(npy_bytes(routes)).decode()
    with pytest.raises(DtypeError, match="dtype float32; routed experts are integers"):
        decode_vllm(text, num_experts=8)
    with pytest.raises(DtypeError, match="nested lists hold float64"):
        decode_vllm(routes.tolist(), num_experts=8)


def test_ragged_lists_refused() -> None:
    with pytest.raises(PayloadEncodingError, match="ragged"):
        decode_vllm([[[1, 2]], [[1]]], num_experts=8)


def test_corrupt_and_truncated_base64(rng: np.random.Generator) -> None:
    text = vllm_npy_b64(distinct_routes(rng, 3, 2, 2, 8), 8)
    with pytest.raises(PayloadEncodingError, match="corrupt or truncated base64"):
        decode_vllm(text[:-3], num_experts=8)
    with pytest.raises(PayloadEncodingError, match="corrupt or truncated base64"):
        decode_sglang("ab$d", num_layers=1, top_k=1, num_experts=8)
    with pytest.raises(PayloadEncodingError, match="non-ASCII character"):
        b64_to_bytes("AAAA\u00e9", "x")


def test_truncated_npy_body(rng: np.random.Generator) -> None:
    data = npy_bytes(distinct_routes(rng, 4, 2, 2, 8).astype(np.uint8))
    with pytest.raises(PayloadSizeError, match=r"declares shape \(4, 2, 2\).*but 10 bytes follow"):
        load_npy(data[:-6], "x")


def test_bomb_header_rejected_before_allocation() -> None:
    data = npy_bytes(np.zeros((1, 1, 1), dtype=np.uint8))
    forged = data.replace(b"(1, 1, 1)", b"(9999999999, 48, 8)")
    with pytest.raises(PayloadSizeError, match=r"declares 9999999999 rows \(shape \(9999999999, 48, 8\)\)"):
        load_npy(forged, "x")


def test_decoded_size_bounded_before_decoding() -> None:
    with pytest.raises(PayloadSizeError, match="more than max_bytes=1000"):
        decode_sglang("A" * 4000, num_layers=1, top_k=1, num_experts=8, max_bytes=1000)


def test_malformed_npy_header() -> None:
    data = npy_bytes(np.zeros((1, 1, 1), dtype=np.uint8)).replace(b"'descr'", b"'dexcr'")
    with pytest.raises(PayloadEncodingError, match="malformed .npy header"):
        load_npy(data, "x")


def test_big_endian_and_fortran_npy(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 3, 2, 300)
    for array in (routes.astype(">u2"), np.asfortranarray(routes.astype(np.uint16))):
        assert np.array_equal(load_npy(npy_bytes(array), "x"), routes)
