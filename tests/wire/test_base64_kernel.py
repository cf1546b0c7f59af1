"""Strict base64 in C (`wire/base64_kernel.c`) accepts only what `base64.b64decode(validate=True)` accepts,
with the same bytes; everything else falls through to binascii, so the named errors are unchanged.

The kernel is a fast path of `b64_to_bytes`, the decoder every engine payload goes through (vLLM's
.npy routes, SGLang's int32 routes). A kernel that accepted a corrupt text would turn a truncated HTTP
body into wrong routes silently, so acceptance is compared with Python's on random, hostile and
hypothesis-drawn texts.
"""

from __future__ import annotations

import base64
import binascii
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.errors import PayloadEncodingError, PayloadSizeError
from routereplay.wire import payload
from routereplay.wire.payload import b64_to_bytes

pytestmark = pytest.mark.native
ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def python_decode(text: bytes) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def test_the_kernel_is_built() -> None:
    assert payload.BASE64_KERNEL is not None


@pytest.mark.parametrize("size", [*range(0, 70), 1000, 4095, 4096, 4097, 1 << 20])
def test_round_trips_of_every_small_length(size: int) -> None:
    raw = os.urandom(size)
    text = base64.b64encode(raw)
    assert payload.BASE64_KERNEL.decode(text) == raw
    assert payload.BASE64_KERNEL.decode(text.decode("ascii")) == raw  # a str is read in place
    assert b64_to_bytes(text.decode("ascii"), "routes") == raw


@pytest.mark.parametrize(
    "text",
    [
        b"A",
        b"AB",
        b"ABC",
        b"AB=",
        b"A===",
        b"====",
        b"AB=C",
        b"A=BC",
        b"AB C",
        b"AB\nC",
        b"ab$d",
        b"QUJD\x00",
        b" QUJD",
        b"QUJD ",
        b"QUJD\n",
        b"QU-_",
        b"QUJ\xff",
        b"QUJD=",
        b"QUJD==",
        b"=QUJ",
    ],
)
def test_hostile_texts_fall_through_to_python(text: bytes) -> None:
    assert payload.BASE64_KERNEL.decode(text) is None or payload.BASE64_KERNEL.decode(text) == python_decode(text)
    assert (payload.BASE64_KERNEL.decode(text) is not None) <= (python_decode(text) is not None)


def test_non_ascii_and_json_text_get_the_named_errors() -> None:
    assert payload.BASE64_KERNEL.decode("QUJ\u00e9") is None
    with pytest.raises(PayloadEncodingError, match="non-ASCII character at offset 3"):
        b64_to_bytes("QUJ\u00e9", "routes")
    with pytest.raises(PayloadEncodingError, match="got JSON text"):
        b64_to_bytes('{"a": 1}', "routes")
    with pytest.raises(PayloadEncodingError, match="corrupt or truncated base64"):
        b64_to_bytes(base64.b64encode(os.urandom(30)).decode()[:-1], "routes")
    with pytest.raises(PayloadSizeError, match="max_bytes=10"):
        b64_to_bytes(base64.b64encode(os.urandom(30)).decode(), "routes", max_bytes=10)


def test_whitespace_around_the_text_is_still_stripped() -> None:
    raw = os.urandom(40)
    assert b64_to_bytes(b"  " + base64.b64encode(raw) + b"\n", "routes") == raw


@pytest.mark.parametrize("position", [0, 1, 2, 3, 100, 1001, 1002, 1003])
@pytest.mark.parametrize("bad", [b"=", b"-", b"_", b"\x00", b"\x80", b" ", b"."])
def test_one_bad_character_anywhere_is_refused(position: int, bad: bytes) -> None:
    text = bytearray(base64.b64encode(os.urandom(753)))  # 1004 characters, no padding
    text[position] = bad[0]
    if bad == b"=" and position == len(text) - 1:  # a padding character where padding may stand: valid
        assert payload.BASE64_KERNEL.decode(bytes(text)) == python_decode(bytes(text)) is not None
        return
    assert payload.BASE64_KERNEL.decode(bytes(text)) is None
    assert python_decode(bytes(text)) is None
    with pytest.raises(PayloadEncodingError, match="corrupt or truncated base64"):
        b64_to_bytes(bytes(text), "routes")


@settings(max_examples=400)
@given(st.binary(max_size=300), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3))
def test_hypothesis_the_kernel_never_accepts_what_python_refuses(raw: bytes, edits: list[tuple[int, int]]) -> None:
    """Texts of up to 400 characters: the 16-character vector steps (from 24 characters on) and the
    scalar tail both see the edited bytes."""
    text = bytearray(base64.b64encode(raw))
    for position, value in edits:
        if text:
            text[position % len(text)] = value
    got = payload.BASE64_KERNEL.decode(bytes(text))
    if got is not None:
        assert got == python_decode(bytes(text))


@settings(max_examples=200)
@given(st.text(alphabet=st.sampled_from(list(ALPHABET.decode() + "= \n\u00e9-")), max_size=40))
def test_hypothesis_texts_decode_as_python_does(text: str) -> None:
    got = payload.BASE64_KERNEL.decode(text)
    if got is not None:
        assert got == python_decode(text.encode("utf-8"))
