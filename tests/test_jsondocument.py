"""Bounded JSON parsing (issue 11 items 10, 11, 31): hostile documents raise named errors, not Python's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.errors import ConfigError, JsonDocumentError
from routereplay.jsondocument import DEFAULT_MAX_JSON_DEPTH, JsonLimits, load_json, scan

UNBOUNDED = JsonLimits(max_depth=10**9, max_number_digits=10**9)


def reference_scan(data: bytes) -> tuple[int, int, int]:
    """Deepest [/{ nesting, longest digit run and final depth outside strings, one character at a time."""
    depth = deepest = run = longest = 0
    inside = escaped = False
    for char in data.decode():
        if inside:
            run = 0
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
            continue
        if char == '"':
            inside, run = True, 0
            continue
        depth += char in "[{"
        depth -= char in "]}"
        deepest = max(deepest, depth)
        run = run + 1 if char.isdigit() else 0
        longest = max(longest, run)
    return deepest, longest, depth


documents = st.recursive(  # small documents: the scan runs one numpy pass per chunk, and chunks go down to 1 byte
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='ab1"\\[]{}', max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=200)
@given(document=documents, chunk=st.integers(1, 64))
def test_scan_matches_a_character_reference_across_chunk_borders(document: object, chunk: int) -> None:
    """Silent misparse guard (issue 11 item 10): the vectorised depth/number scan agrees with a plain
    reference on any JSON (escaped quotes and backslashes in strings included), for every chunk size."""
    data = json.dumps(document).encode()
    limits = JsonLimits(max_depth=10**9, max_number_digits=10**9, scan_chunk_bytes=chunk)
    assert scan(data, limits) == reference_scan(data)
    assert load_json(data, what="doc", error=JsonDocumentError, limits=limits) == document


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested more than 64 levels"),  # RecursionError before
        (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "nested more than 64 levels"),
        (b"[" + b"7" * 5_000 + b"]", "more than 100 digits"),  # ValueError (int-string limit) before
        (b'{"x": 1' + b"0" * 400 + b".5}", "more than 100 digits"),
        (b'{"x": Infinity}', "non-finite number Infinity"),  # OverflowError later, before
        (b'{"x": -Infinity}', "non-finite number -Infinity"),
        (b"[NaN]", "non-finite number NaN"),
        (b"[1e999]", r"non-finite number 1e999 \(overflows a float\)"),
        (
            b'{"choices": [{"routed_experts": "abc',
            # json's "Unterminated string starting at" was cut there ("starting at;"): it now ends in a word
            r"invalid JSON at line 1, column 33 \(character 32\): Unterminated string starting there; .*truncated",
        ),
        (b'{"a": 1,\n "b": }', r"invalid JSON at line 2, column 7 \(character 15\)"),
        (b'{"a": "\xff"}', "not UTF-8|invalid JSON"),
        (b'{"a": [1, 2', "invalid JSON at line 1, column 12 .*truncated"),
    ],
)
def test_hostile_documents_raise_the_named_error(data: bytes, match: str) -> None:
    """Error that is not a RouteReplayError (issue 11 items 10, 11) and misleading message (item 31):
    RecursionError / ValueError / OverflowError became named errors, and invalid JSON says where."""
    with pytest.raises(JsonDocumentError, match=match):
        load_json(data, what="doc", error=JsonDocumentError)


def test_depth_and_digit_limits_are_exact_and_adjustable() -> None:
    """Resource bound (issue 11 item 10): the documented limits hold exactly and can be changed."""
    deep = b"[" * DEFAULT_MAX_JSON_DEPTH + b"]" * DEFAULT_MAX_JSON_DEPTH
    assert load_json(deep, what="doc", error=JsonDocumentError) is not None
    with pytest.raises(JsonDocumentError, match="nested more than 64"):
        load_json(b"[" + deep + b"]", what="doc", error=JsonDocumentError)
    assert load_json(b"[" + deep + b"]", what="doc", error=JsonDocumentError, limits=JsonLimits(max_depth=65))
    assert load_json(b"1" * 100, what="doc", error=JsonDocumentError) == int("1" * 100)
    with pytest.raises(JsonDocumentError, match="more than 3 digits"):
        load_json(b"[1234]", what="doc", error=JsonDocumentError, limits=JsonLimits(max_number_digits=3))
    with pytest.raises(JsonDocumentError, match="6 bytes of JSON, above the 5-byte limit"):
        load_json(b"[1234]", what="doc", error=JsonDocumentError, limits=JsonLimits(max_bytes=5))


def test_digits_inside_strings_are_not_numbers() -> None:
    """Silent misparse guard (issue 11 item 10): a long digit string (base64, ids as text) is no number."""
    data = json.dumps({"routed_experts": "1" * 10_000, "b": "[[[[" * 100}).encode()
    assert load_json(data, what="doc", error=JsonDocumentError)["b"] == "[[[[" * 100


@pytest.mark.parametrize("field", ["max_bytes", "max_depth", "max_number_digits", "scan_chunk_bytes"])
@pytest.mark.parametrize("value", [None, 0, -1, "8", 1.5, True])
def test_limits_are_checked(field: str, value: object) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): a bad limit is a ConfigError."""
    with pytest.raises(ConfigError, match=f"JsonLimits.{field}="):
        JsonLimits(**{field: value})  # type: ignore[arg-type]
