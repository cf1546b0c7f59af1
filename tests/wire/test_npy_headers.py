"""Hostile `.npy` headers from outside: zero rows of a 1e7-long axis (172 base64 characters), 65 dimensions or
a 2**63 axis are refused by name, without allocating, by the decoders, `read_trace` and `inspect`."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from routereplay import RouteReplayError, decode_megatron, decode_vllm
from routereplay.cli.main import main
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints
from tests.codec.blobs import traced_peak
from tests.engines.test_hostile_wire import forged_npy

MEMORY_BOUND = 64 << 20  # a refusal of a tiny input must stay far below this

TINY_BOMB = forged_npy("(0, 10000000, 8)", "<i4")


def test_the_bomb_payload_is_172_base64_characters() -> None:
    """The scenario's payload really is 172 base64 characters."""
    assert len(base64.b64encode(TINY_BOMB)) == 172


@pytest.mark.parametrize("decoder", ["decode_vllm", "decode_megatron"])
def test_a_zero_row_npy_of_a_huge_axis_is_refused_without_allocating(decoder: str) -> None:
    """A 172-character .npy payload of shape (0, 1e7, 8) through
    decode_vllm / decode_megatron is refused with a RouteReplayError, not built as tuple(range(1e7))."""
    text = base64.b64encode(TINY_BOMB).decode()
    if decoder == "decode_vllm":
        result, peak = traced_peak(lambda: decode_vllm(text, num_experts=8))
    else:
        result, peak = traced_peak(lambda: decode_megatron(text, num_experts=8))
    assert isinstance(result, RouteReplayError), result
    assert "10000000" in str(result) or "layer" in str(result).lower()
    assert peak < MEMORY_BOUND


def test_the_same_npy_as_a_file_is_refused_by_read_trace(tmp_path: Path) -> None:
    """The same (0, 1e7, 8) .npy written to a file and read with
    read_trace is refused with a RouteReplayError within a small memory bound."""
    path = tmp_path / "bomb.npy"
    path.write_bytes(TINY_BOMB)
    result, peak = traced_peak(lambda: read_trace(path, PayloadHints(num_experts=8)))
    assert isinstance(result, RouteReplayError), result
    assert peak < MEMORY_BOUND


def test_inspect_refuses_the_npy_bomb_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 4 (resource exhaustion): `routereplay inspect bomb.npy --num-experts 8` refuses in one
    line with no traceback."""
    path = tmp_path / "bomb.npy"
    path.write_bytes(TINY_BOMB)
    code = main(["inspect", str(path), "--num-experts", "8"])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert "Traceback" not in err


def test_an_npy_of_65_dimensions_is_a_named_error() -> None:
    """A .npy header with 65 dimensions raises a
    named PayloadError, not numpy's ValueError."""
    shape = "(" + ", ".join(["1"] * 65) + ")"
    text = base64.b64encode(forged_npy(shape, "<i4")).decode()
    with pytest.raises(RouteReplayError, match=r"(?i)dimension|shape|ndim|axes"):
        decode_vllm(text, num_experts=8)


@pytest.mark.parametrize("decoder", ["decode_vllm", "decode_megatron"])
def test_an_npy_axis_of_2_pow_63_is_a_named_value_error(decoder: str) -> None:
    """Shape (0, 2**63, 8) raises a named error."""
    text = base64.b64encode(forged_npy(f"(0, {2**63}, 8)", "<i4")).decode()
    fn = decode_vllm if decoder == "decode_vllm" else decode_megatron
    with pytest.raises(RouteReplayError) as info:
        fn(text, num_experts=8)
    assert isinstance(info.value, ValueError)  # value errors subclass ValueError too
