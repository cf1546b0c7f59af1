"""The bounded JSON parser's one-pass pre-check in C (`json_scan.c`) clears exactly what the Python
pre-check clears: no document with a digit run over the limit, or more brackets than the depth limit,
may skip the exact scan. It works 64 bytes at a time, so runs are placed across every word boundary."""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay import jsondocument
from routereplay.errors import PayloadEncodingError
from routereplay.jsondocument import JsonLimits, load_json

pytestmark = pytest.mark.native


def python_within(data: bytes, limits: JsonLimits, monkeypatch: pytest.MonkeyPatch) -> bool:
    with monkeypatch.context() as patch:
        patch.setattr(jsondocument, "JSON_SCAN", None)
        return jsondocument._plainly_within(data, limits)


def test_the_scan_is_built() -> None:
    assert jsondocument.JSON_SCAN is not None


@pytest.mark.parametrize("limit", [1, 20, 63, 64, 65, 100, 127, 128, 200])
@pytest.mark.parametrize("run", [1, 62, 63, 64, 65, 99, 100, 101, 127, 128, 129, 200, 201])
@pytest.mark.parametrize("start", [0, 1, 30, 63, 64, 65, 100, 127, 128, 191, 250])
def test_a_digit_run_anywhere_is_measured_as_python_does(
    limit: int, run: int, start: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytearray(b"a" * 400)
    data[start : start + run] = b"7" * run
    data = bytes(data[:400])
    limits = JsonLimits(max_number_digits=limit)
    assert jsondocument._plainly_within(data, limits) == python_within(data, limits, monkeypatch)
    assert jsondocument._plainly_within(data, limits) == (min(run, 400 - start) <= limit)


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 127, 128, 129, 1000])
def test_documents_that_end_in_digits(length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    for tail in (0, 1, 36, 63, 64, 101, 150):
        data = b"x" * length + b"5" * tail
        limits = JsonLimits()
        assert jsondocument._plainly_within(data, limits) == python_within(data, limits, monkeypatch)


@pytest.mark.parametrize("brackets", [0, 1, 63, 64, 65, 200])
def test_brackets_are_counted_everywhere(brackets: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = (b"[{" * brackets)[:brackets] + base64.b64encode(os.urandom(500)) + b"}" * 3
    for depth in (1, 63, 64, 65, 100):
        limits = JsonLimits(max_depth=depth)
        assert jsondocument._plainly_within(data, limits) == python_within(data, limits, monkeypatch)


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(st.sampled_from([b"1", b"a", b"[", b"{", b'"', b" ", b"\xff"]), st.integers(1, 140)), max_size=12
    ),
    st.integers(1, 150),
    st.integers(1, 80),
)
def test_hypothesis_random_documents(pieces: list[tuple[bytes, int]], digits: int, depth: int) -> None:
    data = b"".join(byte * count for byte, count in pieces)
    limits = JsonLimits(max_number_digits=digits, max_depth=depth)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jsondocument, "JSON_SCAN", None)
        want = jsondocument._plainly_within(data, limits)
    assert jsondocument._plainly_within(data, limits) == want


def test_load_json_still_names_long_numbers_and_deep_nesting() -> None:
    number = b'{"a": ' + b"9" * 150 + b"}"
    with pytest.raises(PayloadEncodingError, match="more than 100 digits"):
        load_json(number, what="body", error=PayloadEncodingError)
    deep = b"[" * 70 + b"]" * 70
    with pytest.raises(PayloadEncodingError, match="nested more than 64 levels"):
        load_json(deep, what="body", error=PayloadEncodingError)
    body = json.dumps({"choices": [{"routed_experts": base64.b64encode(os.urandom(3000)).decode()}]}).encode()
    assert load_json(body, what="body", error=PayloadEncodingError) == json.loads(body)


@pytest.mark.parametrize("limit", [2**63 - 1, 2**63, 10**20, 10**400])
@pytest.mark.parametrize("kernel", [True, False])
def test_limits_past_a_c_ssize_t_parse_as_in_python(limit: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`JsonLimits(max_number_digits=10**20)` raised OverflowError from the C pre-check where the Python pre-check
    parses: the kernel is asked with the limit clamped to sys.maxsize (no digit run is longer)."""
    if not kernel:
        monkeypatch.setattr(jsondocument, "JSON_SCAN", None)
    body = b'{"a": [1, 22, ' + b"3" * 150 + b'], "b": "' + b"4" * 70 + b'"}'
    for field in ("max_number_digits", "max_depth", "max_bytes", "scan_chunk_bytes"):
        limits = JsonLimits(**{field: limit})
        if field == "max_number_digits":
            assert load_json(body, what="body", error=PayloadEncodingError, limits=limits) == json.loads(body)
        else:
            with pytest.raises(PayloadEncodingError, match="more than 100 digits"):
                load_json(body, what="body", error=PayloadEncodingError, limits=limits)
