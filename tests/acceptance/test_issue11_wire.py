"""Acceptance tests for issue 11, wire decoders (items 1, 4, 9, 10, 12, 13, 15, 19, 31), from the public API only.

Each test replays the issue's original scenario as literally as it is described there.
"""

from __future__ import annotations

import base64
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import routereplay
from routereplay import RouteReplayError, decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import (
    AmbiguousChoiceError,
    ConfigError,
)
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints

MEMORY_BOUND = 64 << 20  # a refusal of a tiny input must stay far below this


def _npy_header(shape_text: str, descr: str = "<i4") -> bytes:
    """A version 1.0 .npy file holding only a header (no data), padded like numpy does."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}"
    total = 10 + len(header) + 1
    pad = (-total) % 64
    header = header + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1")


def _peak(call):
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as exc:  # asserted by the caller
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- item 4 ---------------------------------------------------------------------------------------
TINY_BOMB = _npy_header("(0, 10000000, 8)")


def test_item4_payload_is_172_chars() -> None:
    """Issue 11 item 4 (resource exhaustion): the scenario's payload really is 172 base64 characters."""
    assert len(base64.b64encode(TINY_BOMB)) == 172


@pytest.mark.parametrize("decoder", ["decode_vllm", "decode_megatron"])
def test_item4_zero_row_huge_axis_npy_refused_without_allocating(decoder: str) -> None:
    """Issue 11 item 4 (resource exhaustion): a 172-character .npy payload of shape (0, 1e7, 8) through
    decode_vllm / decode_megatron is refused with a RouteReplayError, not built as tuple(range(1e7))."""
    text = base64.b64encode(TINY_BOMB).decode()
    if decoder == "decode_vllm":
        result, peak = _peak(lambda: decode_vllm(text, num_experts=8))
    else:
        result, peak = _peak(lambda: decode_megatron(text, num_experts=8))
    assert isinstance(result, RouteReplayError), result
    assert "10000000" in str(result) or "layer" in str(result).lower()
    assert peak < MEMORY_BOUND


def test_item4_zero_row_huge_axis_npy_file_refused_by_read_trace(tmp_path: Path) -> None:
    """Issue 11 item 4 (resource exhaustion): the same (0, 1e7, 8) .npy written to a file and read with
    read_trace is refused with a RouteReplayError within a small memory bound."""
    path = tmp_path / "bomb.npy"
    path.write_bytes(TINY_BOMB)
    result, peak = _peak(lambda: read_trace(path, PayloadHints(num_experts=8)))
    assert isinstance(result, RouteReplayError), result
    assert peak < MEMORY_BOUND


def test_item4_cli_inspect_refuses_npy_bomb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 4 (resource exhaustion): `routereplay inspect bomb.npy --num-experts 8` refuses in one
    line with no traceback."""
    from routereplay.cli.main import main

    path = tmp_path / "bomb.npy"
    path.write_bytes(TINY_BOMB)
    code = main(["inspect", str(path), "--num-experts", "8"])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert "Traceback" not in err


# -- item 9 ---------------------------------------------------------------------------------------
def test_item9_npy_with_65_dimensions() -> None:
    """Issue 11 item 9 (error that is not a RouteReplayError): a .npy header with 65 dimensions raises a
    named PayloadError, not numpy's ValueError."""
    shape = "(" + ", ".join(["1"] * 65) + ")"
    text = base64.b64encode(_npy_header(shape)).decode()
    with pytest.raises(RouteReplayError, match=r"(?i)dimension|shape|ndim|axes"):
        decode_vllm(text, num_experts=8)


@pytest.mark.parametrize("decoder", ["decode_vllm", "decode_megatron"])
def test_item9_npy_with_2_pow_63_axis(decoder: str) -> None:
    """Issue 11 item 9 (error that is not a RouteReplayError): shape (0, 2**63, 8) raises a named error."""
    text = base64.b64encode(_npy_header(f"(0, {2**63}, 8)")).decode()
    fn = decode_vllm if decoder == "decode_vllm" else decode_megatron
    with pytest.raises(RouteReplayError) as info:
        fn(text, num_experts=8)
    assert isinstance(info.value, ValueError)  # value errors subclass ValueError too


# -- item 10 --------------------------------------------------------------------------------------
HOSTILE_JSON = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep_dict": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "long_number": '{"choices": [{"routed_experts": ' + "9" * 5000 + "}]}",
    "choices_int": '{"choices": 5}',
    "choices_true": '{"choices": true}',
    "choices_float": '{"choices": 1.5}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_item10_read_trace_hostile_json(tmp_path: Path, name: str) -> None:
    """Issue 11 item 10 (error that is not a RouteReplayError): read_trace on deeply nested JSON, a
    5000-digit number, "choices": 5 / true / 1.5 raises a RouteReplayError (no RecursionError,
    ValueError or TypeError)."""
    path = tmp_path / f"{name}.json"
    path.write_text(HOSTILE_JSON[name])
    with pytest.raises(RouteReplayError):
        read_trace(path, PayloadHints(num_experts=8, num_layers=2, top_k=2))


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_item10_cli_inspect_hostile_json_exit_codes(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11 item 10 (error that is not a RouteReplayError): `inspect` on hostile JSON prints no
    traceback and exits 1 (invalid) or 2 (unreadable), never a crash."""
    from routereplay.cli.main import main

    path = tmp_path / f"{name}.json"
    path.write_text(HOSTILE_JSON[name])
    code = main(["inspect", str(path), "--num-experts", "8"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code in (1, 2)
    assert err.strip().count("\n") == 0, err


# -- item 12 --------------------------------------------------------------------------------------
def test_item12_empty_prompt_rows_and_empty_routes() -> None:
    """Issue 11 item 12 (error that is not a RouteReplayError): vLLM 0.21 lists with
    prompt_routed_experts=[[]] and routed_experts=[] raise a named error, not np.concatenate's ValueError."""
    with pytest.raises(RouteReplayError):
        decode_vllm([], prompt_value=[[]], num_experts=8)
    response = {"prompt_routed_experts": [[]], "choices": [{"index": 0, "routed_experts": []}]}
    with pytest.raises(RouteReplayError):
        decode_vllm(response, num_experts=8)


# -- item 13 --------------------------------------------------------------------------------------
ROUTES_TLK = np.zeros((3, 2, 2), dtype=np.int32)
ROUTES_TLK[:, :, 1] = 1


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, prompt_start=None), "prompt_start"),
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, max_bytes=None), "max_bytes"),
        (lambda: decode_vllm(ROUTES_TLK, num_experts=8, choice=None), "choice"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, start=None), "start"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, index=None), "index"),
        (lambda: decode_megatron(ROUTES_TLK, num_experts=8, max_bytes=None), "max_bytes"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, start_len=None), "start_len"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, index=None), "index"),
        (lambda: decode_sglang(ROUTES_TLK, num_layers=2, top_k=2, num_experts=8, choice=None), "choice"),
    ],
)
def test_item13_none_arguments_are_config_errors(call, name: str) -> None:
    """Issue 11 item 13 (error that is not a RouteReplayError): None for start / max_bytes / index /
    choice raises ConfigError naming the argument, not TypeError."""
    with pytest.raises(ConfigError, match=name):
        call()


# -- item 15 --------------------------------------------------------------------------------------
def test_item15_meta_device_routes_to_decoders() -> None:
    """Issue 11 item 15 (error that is not a RouteReplayError): routes on the meta device given to a
    decoder raise a RouteReplayError, not NotImplementedError."""
    meta = torch.zeros(3, 2, 2, dtype=torch.int32, device="meta")
    for call in (
        lambda: decode_vllm(meta, num_experts=8),
        lambda: decode_megatron(meta, num_experts=8),
        lambda: decode_sglang(meta, num_layers=2, top_k=2, num_experts=8),
        lambda: routereplay.RouteTrace(meta, 8),
    ):
        with pytest.raises(RouteReplayError, match="meta"):
            call()


# -- item 19 --------------------------------------------------------------------------------------
def test_item19_megatron_ndarray_wrapper_int16() -> None:
    """Issue 11 item 19 (other defect): Megatron-LM 0.20's HTTP server sends moe_topk_indices as
    ["ndarray", {"data": [...], "dtype": "int16"}]; decode_megatron reads it exactly."""
    experts_TLK = np.array([[[0, 3], [5, 1]], [[2, 7], [4, 6]], [[1, 2], [3, 0]]], dtype=np.int16)
    payload = {"moe_topk_indices": ["ndarray", {"data": experts_TLK.tolist(), "dtype": "int16"}]}
    trace = decode_megatron(json.loads(json.dumps(payload)), num_experts=8)
    np.testing.assert_array_equal(np.asarray(trace.experts), experts_TLK)


# -- item 1 ---------------------------------------------------------------------------------------
def _openai_n2(choice_rows: list[np.ndarray]) -> dict:
    """An SGLang OpenAI-style n=2 response: sglext.routed_experts filled from choice 0 only."""
    blob = base64.b64encode(choice_rows[0].astype(np.int32).tobytes()).decode()
    return {
        "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
        "sglext": {"routed_experts": blob},
    }


def test_item1_sglang_n2_choice1_refused() -> None:
    """Issue 11 item 1 (silent misroute): decode_sglang(resp, choice=1) on an n=2 OpenAI response whose
    routes sit in sglext (choice 0's only) is refused, not answered with choice 0's routes."""
    rows = [np.arange(3 * 2 * 2).reshape(3, 2, 2) % 8, (np.arange(3 * 2 * 2).reshape(3, 2, 2) + 3) % 8]
    response = _openai_n2(rows)
    first = decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=0)
    np.testing.assert_array_equal(np.asarray(first.experts), rows[0])
    with pytest.raises(AmbiguousChoiceError, match="choice"):
        decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=1)


def test_item1_sglang_per_choice_sgl_ext_read() -> None:
    """Issue 11 item 1 (silent misroute): with per-choice sgl_ext, choice=1 gets choice 1's routes."""
    rows = [np.arange(12).reshape(3, 2, 2) % 8, (np.arange(12).reshape(3, 2, 2) + 3) % 8]
    response = {
        "choices": [
            {"index": i, "sgl_ext": {"routed_experts": base64.b64encode(r.astype(np.int32).tobytes()).decode()}}
            for i, r in enumerate(rows)
        ]
    }
    # distinct ids per row are needed for validation; build them from permutations instead
    trace = decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=1, validate=False)
    np.testing.assert_array_equal(np.asarray(trace.experts), rows[1])


# -- item 31 --------------------------------------------------------------------------------------
EXAMPLES = Path(routereplay.__file__).parent / "examples"


def test_item31_wrong_top_k_on_sglang_example_lists_fitting_splits(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 31 (misleading message): a wrong --top-k on the SGLang example must not blame
    "another sequence / stale capture buffer"; it names the splits the byte count fits."""
    from routereplay.cli.main import main

    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--num-experts", "128", "--num-layers", "48", "--top-k", "4"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (1, 2)
    assert "stale capture buffer" not in text
    assert "top_k" in text or "top-k" in text


def test_item31_same_product_split_not_called_zero_padding(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 31 (misleading message): --num-layers 24 --top-k 16 (same product as 48 x 8) must
    not be explained as "zero padding used for 'no route'"; the message names several fitting shapes."""
    from routereplay.cli.main import main

    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--num-experts", "128", "--num-layers", "24", "--top-k", "16", "--json"])
    verdict = json.loads(capsys.readouterr().out)
    assert code == 1
    assert verdict["valid"] is False
    assert "--num-layers 48, --top-k 8" in verdict["error"]  # the CLI names its flags, not the Python keywords
    assert "split is probably wrong" in verdict["error"]


def test_item31_sglang_file_read_as_vllm_names_sglang(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 31 (misleading message): an SGLang file read with --engine vllm is told it looks
    like SGLang, not given vLLM flags only."""
    from routereplay.cli.main import main

    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--engine", "vllm", "--num-experts", "128"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (1, 2)
    assert "sglang" in text.lower()


def test_item31_truncated_json_says_invalid_json_at_character(tmp_path: Path) -> None:
    """Issue 11 item 31 (misleading message): truncated JSON says "invalid JSON at character N"."""
    text = (EXAMPLES / "moonlight_vllm.json").read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(RouteReplayError, match=r"(?i)invalid JSON.*character \d+"):
        read_trace(path, PayloadHints(num_experts=64))


def test_item31_raw_response_text_to_decode_vllm_says_pass_parsed_json() -> None:
    """Issue 11 item 31 (misleading message): the raw response text given to decode_vllm is told to pass
    the parsed JSON, not called corrupt base64."""
    text = (EXAMPLES / "moonlight_vllm.json").read_text()
    with pytest.raises(RouteReplayError, match=r"(?i)pars"):
        decode_vllm(text, num_experts=64)
