"""Trace files (issue 11 items 10, 13, 20, 27, 31): hostile JSON, argument types, layer numbers kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, decode, encode
from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.errors import ConfigError, JsonDocumentError, PayloadEncodingError, RouteReplayError, ZeroLayerError
from routereplay.jsondocument import JsonLimits
from routereplay.tracefile.format import FileFormat
from routereplay.tracefile.io import TraceFileLimits, read_trace, write_trace
from routereplay.tracefile.payload import CARRIED_FIELD, PayloadHints
from tests.wire.payloads import distinct_routes, vllm_npy_b64, vllm_response

HINTS = PayloadHints(num_experts=16)


def write(tmp_path: Path, data: bytes | str, name: str = "resp.json") -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# --- hostile JSON (item 10) and invalid JSON (item 31) ----------------------------------------


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ('{"choices": ' + "[" * 50_000 + "]" * 50_000 + "}", JsonDocumentError, "nested more than 64 levels"),
        ('{"moe_topk_indices": [[[' + "7" * 5000 + "]]]}", JsonDocumentError, "more than 100 digits"),
        ('{"moe_topk_indices": [[[1e999]]]}', JsonDocumentError, "non-finite number 1e999"),
        ('{"choices": [{"routed_experts": NaN}]}', JsonDocumentError, "non-finite number NaN"),
        ('{"choices": 5}', PayloadEncodingError, "'choices' is a int"),
        ('{"choices": true}', PayloadEncodingError, "'choices' is a bool"),
        ('{"choices": 1.5}', PayloadEncodingError, "'choices' is a float"),
        ('{"choices": "abc"}', PayloadEncodingError, "'choices' is a str"),
        ('{"choices": [5]}', PayloadEncodingError, "no routed experts field"),
        ("[1, 2]", PayloadEncodingError, "no routed experts field"),
    ],
)
def test_hostile_json_raises_named_errors(tmp_path: Path, text: str, error: type[Exception], match: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 10): deep nesting (RecursionError), a
    5000-digit number (ValueError), non-finite numbers and `"choices": 5` / true / 1.5 (TypeError in
    engine detection) are named RouteReplayErrors."""
    with pytest.raises(error, match=match):
        read_trace(write(tmp_path, text), HINTS)


def test_truncated_json_says_where(tmp_path: Path, rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 31): truncated JSON was called "not a codec file, a .npy array,
    nor a JSON engine response"; it now says invalid JSON at which line, column and character."""
    text = json.dumps(vllm_response([vllm_npy_b64(distinct_routes(rng, 5, 2, 2, 16), 16)]))
    cut = len(text) - 40
    with pytest.raises(JsonDocumentError, match=r"invalid JSON at line 1, column \d+ \(character \d+\).*truncated"):
        read_trace(write(tmp_path, text[:cut]), HINTS)
    with pytest.raises(PayloadEncodingError, match="not a routereplay codec file, a .npy array, nor a JSON"):
        read_trace(write(tmp_path, b"\x00\x01garbage", "junk.bin"), HINTS)


def test_hostile_json_through_inspect_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Error that is not a RouteReplayError (issue 11 item 10): `inspect` printed a RecursionError
    traceback and exited 1 ("invalid"); an unreadable file is exit 2 with a one-line reason."""
    path = write(tmp_path, '{"choices": ' + "[" * 100_000 + "}")
    assert main(["inspect", str(path), "--num-experts", "8"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "nested more than 64 levels" in err and "Traceback" not in err


def test_json_size_limits_refuse_before_reading(tmp_path: Path, rng: np.random.Generator) -> None:
    """Resource exhaustion (issue 11 item 10): a JSON file above `JsonLimits.max_bytes`, or any file
    above `TraceFileLimits.max_file_bytes`, is refused from its size; both limits are adjustable."""
    text = json.dumps(vllm_response([vllm_npy_b64(distinct_routes(rng, 5, 2, 2, 16), 16)]))
    path = write(tmp_path, text)
    small_json = TraceFileLimits(json=JsonLimits(max_bytes=len(text) - 1))
    with pytest.raises(JsonDocumentError, match=f"{len(text)} bytes.*above the {len(text) - 1}-byte limit"):
        read_trace(path, HINTS, limits=small_json)
    with pytest.raises(ConfigError, match="above the 100-byte limit for one trace file"):
        read_trace(path, HINTS, limits=TraceFileLimits(max_file_bytes=100))
    assert read_trace(path, HINTS, limits=TraceFileLimits(json=JsonLimits(max_bytes=len(text))))[1] is FileFormat.VLLM
    codec_path = write(tmp_path, encode(RouteTrace(distinct_routes(rng, 5, 2, 2, 16), 16)), "t.rrt")
    assert read_trace(codec_path, limits=TraceFileLimits(json=JsonLimits(max_bytes=1)))[1] is FileFormat.CODEC


# --- argument types (item 13) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("start", None),
        ("start", -1),
        ("start", "3"),
        ("index", None),
        ("index", 1.0),
        ("num_experts", 0),
        ("num_experts", "64"),
        ("num_layers", True),
        ("top_k", -2),
        ("num_tokens", 0.5),
        ("moe_layers", "1-26"),
        ("moe_layers", [1, None]),
        ("layers", [-1]),
    ],
)
def test_payload_hints_types_are_config_errors(field: str, value: object) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): None or a wrong type for start, index,
    counts or layer lists raised TypeError deep in a decoder; it is a ConfigError naming the flag."""
    with pytest.raises(ConfigError, match=f"{field}=.*CLI: --{field.replace('_', '-')}"):
        PayloadHints(**{field: value})  # type: ignore[arg-type]


def test_read_trace_arguments_are_checked(tmp_path: Path, rng: np.random.Generator) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): a bad engine name, hints or limits object."""
    path = write(tmp_path, encode(RouteTrace(distinct_routes(rng, 3, 2, 2, 16), 16)), "t.rrt")
    with pytest.raises(ConfigError, match="engine='vllm2' is not a trace format"):
        read_trace(path, engine="vllm2")
    with pytest.raises(ConfigError, match="hints must be a PayloadHints"):
        read_trace(path, {"num_experts": 16})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="limits must be a TraceFileLimits"):
        read_trace(path, limits=JsonLimits())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="TraceFileLimits.max_file_bytes=None"):
        TraceFileLimits(max_file_bytes=None)  # type: ignore[arg-type]


# --- layer numbers through engine JSON (item 27) -----------------------------------------------


@pytest.fixture
def dense_first(tmp_path: Path, rng: np.random.Generator) -> tuple[RouteTrace, Path]:
    """A Moonlight-like trace: layer 0 dense, MoE layers 1..6 (of 64 experts), rows from token 3."""
    trace = RouteTrace(distinct_routes(rng, 11, 6, 4, 64), 64, layers=range(1, 7), start=3)
    path = tmp_path / "moon.rrt"
    path.write_bytes(encode(trace, mode="ordered"))
    return trace, path


ENGINE_JSON = [pytest.param(fmt, id=f"to-{fmt}") for fmt in ("vllm", "sglang", "megatron")]  # an id "vllm" would
# be read as the conftest's `vllm` marker (needs the vllm package) and skip the test


@pytest.mark.parametrize("fmt", ENGINE_JSON)
def test_convert_to_engine_json_keeps_layer_numbers(
    tmp_path: Path, dense_first: tuple[RouteTrace, Path], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Silent misroute (issue 11 item 27): `convert moon.rrt out.json --to vllm` (sglang, megatron)
    then `inspect` showed layers 0-25 for a trace of layers 1-26: the dense-layer offset was lost
    without a word. Through the real CLI the layers, start and ids now come back unchanged."""
    trace, source = dense_first
    out = tmp_path / f"out.{fmt}.json"
    assert main(["convert", str(source), str(out), "--to", fmt]) == EXIT_OK
    note = capsys.readouterr().err
    if fmt != "megatron":  # all-layer formats: the note says what was zero-filled and which flag selects
        assert "wrote layers 0-6, non-MoE layer(s) 0 zero-filled" in note and "--moe-layers 1-6" in note
    assert main(["inspect", str(out), "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    assert record["layers"] == [1, 2, 3, 4, 5, 6] and record["start"] == 3 and record["num_tokens"] == 11
    back = tmp_path / f"back.{fmt}.rrt"
    assert main(["convert", str(out), str(back), "--mode", "ordered"]) == EXIT_OK
    restored = decode(back.read_bytes())
    assert restored.layers == trace.layers and restored.start == trace.start
    assert np.array_equal(restored.experts, trace.experts)


@pytest.mark.parametrize("fmt", ENGINE_JSON[:2])
def test_all_layer_payloads_read_back_with_moe_layers(
    tmp_path: Path, dense_first: tuple[RouteTrace, Path], fmt: str
) -> None:
    """Silent misroute (issue 11 item 27): vLLM and SGLang send every hidden layer, so the written
    payload holds 7 layers with layer 0 zero-filled; `--moe-layers 1-6` reads the same layers as the
    source, and without the carried object and without the flag the zero layer is refused, not shifted."""
    trace, source = dense_first
    out = tmp_path / "out.json"
    assert main(["convert", str(source), str(out), "--to", fmt]) == EXIT_OK
    explicit = PayloadHints(num_experts=64, num_layers=7, top_k=4, moe_layers=range(1, 7), start=3)
    restored, _ = read_trace(out, explicit)
    assert restored.layers == trace.layers and np.array_equal(restored.experts, trace.experts)
    document = json.loads(out.read_text())
    del document[CARRIED_FIELD]
    out.write_text(json.dumps(document))
    with pytest.raises(ZeroLayerError, match=r"layer\(s\) \[0\] are all zeros.*pass moe_layers="):
        read_trace(out, PayloadHints(num_experts=64, num_layers=7, top_k=4, start=3))


def test_contradicting_num_layers_is_named(tmp_path: Path, dense_first: tuple[RouteTrace, Path]) -> None:
    """Misleading message (issue 11 item 27): --num-layers that contradicts the written payload names both."""
    _, source = dense_first
    out = tmp_path / "out.json"
    write_trace(decode(source.read_bytes()), out, "sglang")
    with pytest.raises(RouteReplayError, match="num_layers=6.*wrote this payload with 7 layers.*MoE layers 1-6"):
        read_trace(out, PayloadHints(num_layers=6))


def test_malformed_carried_object_is_refused(tmp_path: Path, dense_first: tuple[RouteTrace, Path]) -> None:
    """Error that is not a RouteReplayError (issue 11 item 10): a hostile "routereplay" object is named."""
    _, source = dense_first
    out = tmp_path / "out.json"
    write_trace(decode(source.read_bytes()), out, "megatron")
    document = json.loads(out.read_text())
    for bad in (5, {"layers": "1-6"}, {**document[CARRIED_FIELD], "num_experts": 1.5}, {"layers": [1, 1]}):
        document[CARRIED_FIELD] = bad
        out.write_text(json.dumps(document))
        with pytest.raises(PayloadEncodingError, match=f"'{CARRIED_FIELD}' object is malformed"):
            read_trace(out)


# --- inspect wording (item 20) -----------------------------------------------------------------


def test_inspect_names_the_last_token_position(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 11 item 20): 83 rows were shown as "token positions 0..83"; the last
    position is 82 (and 5..87 for rows from token 5)."""
    for start, shown in ((0, "0..82"), (5, "5..87")):
        path = write(tmp_path, encode(RouteTrace(distinct_routes(rng, 83, 2, 2, 16), 16, start=start)), "t.rrt")
        assert main(["inspect", str(path)]) == EXIT_OK
        out = capsys.readouterr().out
        assert f"83  (token positions {shown})" in out


def test_all_layer_payload_of_an_absurd_layer_number_is_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    """Resource exhaustion (issue 11 item 27): an all-layer payload is as wide as the largest layer
    number; one above MAX_CARRIED_LAYERS is refused before the (T, L, K) array is allocated."""
    trace = RouteTrace(distinct_routes(rng, 4, 2, 2, 16), 16, layers=(0, 10**6))
    with pytest.raises(ConfigError, match="layer number 1000000 is above 4095"):
        write_trace(trace, tmp_path / "out.json", "vllm")
    assert not (tmp_path / "out.json").exists()
