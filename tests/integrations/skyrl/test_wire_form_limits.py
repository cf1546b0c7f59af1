"""`decode_skyrl` refuses oversized or mis-counted SkyRL arrays before widening them to int32, and names the payload
layer of an id >= E with dense layers in the payload. Legend: T rows, A all hidden layers, K top-k."""

from __future__ import annotations

import base64
import tracemalloc

import numpy as np
import pytest

from routereplay.errors import ConfigError, ExpertIdRangeError, PayloadLimitError, RowCountError
from routereplay.integrations.skyrl import decode_skyrl, unpack_envelope

READ = {"num_experts": 300, "moe_layers": (1, 2)}


def peak_bytes_of(call: object) -> int:
    tracemalloc.start()
    try:
        call()  # type: ignore[operator]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_oversized_narrow_array_is_refused_before_the_int32_copy() -> None:
    huge_TAK = np.broadcast_to(np.zeros((1, 3, 2), np.uint8), (20_000_000, 3, 2))  # 120 MB as int32 x4 = 480 MB

    def decode() -> None:
        with pytest.raises(PayloadLimitError, match="refused before allocating"):
            decode_skyrl(huge_TAK, **READ, num_tokens=6)

    assert peak_bytes_of(decode) < 1_000_000


def test_wrong_row_count_is_refused_before_the_int32_copy() -> None:
    many_TAK = np.broadcast_to(np.zeros((1, 3, 2), np.uint8), (4_000_000, 3, 2))  # within WireLimits.max_rows

    def decode() -> None:
        with pytest.raises(RowCountError, match="4000000 route rows, expected 5"):
            decode_skyrl(many_TAK, **READ, num_tokens=6)

    assert peak_bytes_of(decode) < 1_000_000


def test_envelope_row_count_is_refused_from_its_declared_shape_before_base64_decoding() -> None:
    rows = 1_000_000
    data = base64.b64encode(bytes(rows * 3 * 2)).decode()
    envelope = {"data": data, "shape": [rows, 3, 2], "dtype": "uint8"}

    def decode() -> None:
        with pytest.raises(RowCountError, match=f"{rows} route rows, expected 5"):
            decode_skyrl(envelope, **READ, num_tokens=6)

    assert peak_bytes_of(decode) < 1_000_000  # decoding alone would take 6 MB, its int32 copy 24 MB


def test_an_id_out_of_range_names_its_payload_layer_past_a_dense_layer() -> None:
    routes_TAK = np.zeros((5, 3, 2), np.int32)
    routes_TAK[:, 1:] = [0, 1]
    routes_TAK[3, 2] = [7, 16]  # payload layer 2 (dense layer 0 is in the payload)
    with pytest.raises(ExpertIdRangeError, match=r"payload layer 2: expert id 16 is outside \[0, 16\)"):
        decode_skyrl(routes_TAK, num_experts=16, moe_layers=(1, 2), num_tokens=6)


@pytest.mark.parametrize("max_bytes", [None, "1000", 1.5, -1, True], ids=["None", "str", "float", "negative", "bool"])
def test_a_bad_max_bytes_is_a_config_error_for_every_form(max_bytes: object) -> None:
    """Item 9: `decode_skyrl(envelope, max_bytes=None)` compared None with the size (TypeError)."""
    routes_TAK = np.zeros((5, 3, 2), np.uint8)
    routes_TAK[:, 1:] = [0, 1]
    envelope = {"data": base64.b64encode(routes_TAK.tobytes()).decode(), "shape": [5, 3, 2], "dtype": "uint8"}
    for value in (envelope, {"choices": [{"routed_experts": envelope}]}, routes_TAK):
        with pytest.raises(ConfigError, match="max_bytes.* must be (an int )?>= 0"):
            decode_skyrl(value, **READ, num_tokens=6, max_bytes=max_bytes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_bytes.* must be (an int )?>= 0"):
        unpack_envelope(envelope, max_bytes=max_bytes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="limits must be a WireLimits, got NoneType"):
        unpack_envelope(envelope, limits=None)  # type: ignore[arg-type]
