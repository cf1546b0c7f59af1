"""The `routereplay` CLI: --help everywhere, inspect, convert, env, and exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, decode, encode
from routereplay.cli.main import COMMANDS, EXIT_ERROR, EXIT_INVALID, EXIT_OK, main
from routereplay.testing.synthetic import random_trace
from tests.wire.payloads import distinct_routes, sglang_generate, vllm_npy_b64, vllm_response

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "routereplay" / "examples"


@pytest.mark.parametrize("command", [c.__name__.rsplit(".", 1)[-1] for c in COMMANDS] + [None])
def test_help_everywhere(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: routereplay" in out and len(out.splitlines()) > 5


def test_console_script_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "routereplay.cli.main", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("routereplay ")


def test_inspect_codec_file_json(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    trace = random_trace(
        rng, num_tokens=20, num_layers=3, top_k=2, num_experts=8, unrouted_fraction=0.25, source="sglang"
    )
    path = tmp_path / "t.rrt"
    path.write_bytes(encode(trace))
    assert main(["inspect", str(path), "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    assert record["format"] == "rrt" and record["valid"] is True
    assert (record["num_tokens"], record["num_layers"], record["top_k"], record["num_experts"]) == (20, 3, 2, 8)
    mask = trace.routed_mask
    assert record["unrouted_rows"] == int((~mask).sum())
    assert [load["routed_rows"] for load in record["layer_load"]] == mask.sum(axis=0).tolist()
    assert record["segments"][0]["source"] == "sglang"


def test_inspect_reports_invalid_payload_with_exit_1(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    routes = distinct_routes(rng, 6, 3, 2, 16)
    routes[:, 0] = 0  # dense layer left in: all zeros
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(vllm_response([vllm_npy_b64(routes, 16)])))
    assert main(["inspect", str(path), "--num-experts", "16", "--json"]) == EXIT_INVALID
    record = json.loads(capsys.readouterr().out)
    assert record["valid"] is False and record["error_type"] == "ZeroLayerError"
    assert main(["inspect", str(path), "--num-experts", "16", "--moe-layers", "1-2"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "valid" in out and "expert load per layer" in out


def test_inspect_needs_model_facts(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(sglang_generate(distinct_routes(rng, 5, 2, 2, 8), 2, 4)))
    assert main(["inspect", str(path), "--num-experts", "8"]) == EXIT_ERROR
    err = capsys.readouterr().err  # issue 38 item 14: every missing flag at once, each named once
    assert "does not record num_layers or top_k; pass --num-layers and --top-k, taken from" in err
    assert main(["inspect", str(path), "--num-experts", "8", "--num-layers", "2", "--top-k", "2"]) == EXIT_OK


def test_inspect_names_every_missing_model_flag_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38 item 14: `inspect` on the bundled SGLang payload asked for --num-experts, then (given it) for
    --num-layers, then for --top-k; it names all three in one message."""
    sglang = str(EXAMPLES / "qwen3_30b_a3b_sglang.json")
    assert main(["inspect", sglang]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "does not record num_experts, num_layers or top_k; pass --num-experts, --num-layers and --top-k" in err
    assert main(["inspect", sglang, "--num-layers", "48"]) == EXIT_ERROR
    assert "does not record num_experts or top_k; pass --num-experts and --top-k" in capsys.readouterr().err


def test_inspect_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\x00\x01garbage")
    assert main(["inspect", str(path)]) == EXIT_ERROR
    assert "PayloadEncodingError" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.rrt")]) == EXIT_ERROR
    assert "cannot read" in capsys.readouterr().err


def test_convert_round_trip_through_every_format(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    routes = distinct_routes(rng, 9, 4, 2, 16)
    routes[:, 0] = 0
    source = tmp_path / "resp.json"
    source.write_text(json.dumps(vllm_response([vllm_npy_b64(routes, 16)])))
    hints = ["--num-experts", "16", "--moe-layers", "1-3"]
    rrt = tmp_path / "t.rrt"
    assert main(["convert", str(source), str(rrt), *hints, "--mode", "ordered", "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    assert record["output_bytes"] == rrt.stat().st_size and record["rows"] == 27
    trace = decode(rrt.read_bytes())
    assert trace.layers == (1, 2, 3) and np.array_equal(trace.experts, routes[:, 1:])
    for fmt, extra in (("sglang", ["--num-layers", "4", "--top-k", "2"]), ("megatron", []), ("vllm", [])):
        out = tmp_path / f"t.{fmt}.json"
        assert main(["convert", str(rrt), str(out), "--to", fmt]) == EXIT_OK
        back = tmp_path / f"back.{fmt}.rrt"
        assert main(["convert", str(out), str(back), "--num-experts", "16", *extra]) == EXIT_OK
        assert np.array_equal(decode(back.read_bytes()).experts, np.sort(routes[:, 1:], axis=2)), "set mode sorts rows"
        assert decode(back.read_bytes()).layers == (1, 2, 3), "layer numbers survive (issue 11 item 27)"
    npy = tmp_path / "t.npy"
    assert main(["convert", str(rrt), str(npy)]) == EXIT_OK
    assert np.array_equal(np.load(npy), routes[:, 1:])
    assert "are dropped" in capsys.readouterr().err


def test_convert_refuses_overwrite_and_unknown_format(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    rrt = tmp_path / "t.rrt"
    rrt.write_bytes(encode(RouteTrace(distinct_routes(rng, 3, 2, 2, 8), 8)))
    target = tmp_path / "exists.rrt"
    target.write_bytes(b"keep me")
    assert main(["convert", str(rrt), str(target)]) == EXIT_ERROR
    assert target.read_bytes() == b"keep me"
    assert "pass --force" in capsys.readouterr().err
    assert main(["convert", str(rrt), str(tmp_path / "out.json")]) == EXIT_ERROR
    assert "--to rrt|npy|vllm|sglang|megatron" in capsys.readouterr().err


def test_convert_vllm_form_refuses_unrouted_rows(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    routes = distinct_routes(rng, 4, 2, 2, 8)
    routes[1] = -1
    rrt = tmp_path / "t.rrt"
    rrt.write_bytes(encode(RouteTrace(routes, 8)))
    assert main(["convert", str(rrt), str(tmp_path / "v.json"), "--to", "vllm"]) == EXIT_ERROR
    assert "no -1 sentinel" in capsys.readouterr().err


def test_env_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["routereplay"] and info["numpy"] and info["torch"].startswith("2.")


def test_env_shows_the_thread_count_the_commands_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 38 item 20: `env` printed `torch_threads 2` (torch's default of one per core) while every command
    runs 1; it prints what the commands run, why, and torch's own default beside it, and leaves torch's count."""
    import torch

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["env", "--json"]) == EXIT_OK
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    info = json.loads(capsys.readouterr().out)
    assert info["torch_threads"] == 1 and info["torch_default_threads"] == 2
    assert info["torch_threads_reason"].startswith("default for tiny models (1)")


def test_bench_codec_small_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "codec", "--tokens", "64", "--layers", "4", "--repeats", "1", "--json"]
    assert main(args) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    names = [f["name"] for f in result["formats"]]
    assert names[:2] == ["routereplay set", "routereplay ordered"]
    assert {"JSON nested lists", "SGLang base64 int32", "vLLM base64 .npy uint8", "raw uint8"} <= set(names)
    by_name = {f["name"]: f for f in result["formats"]}
    assert by_name["raw uint8"]["bytes_per_row"] == 8.0
    assert by_name["routereplay set"]["bytes"] < by_name["raw uint8"]["bytes"]
    assert set(result["targets"]) == {
        "set_vs_entropy",
        "set_smaller_than_sglang_int32",
        "set_decode_seconds",
        "set_decode_rows_per_s",
        "set_encode_rows_per_s",
    }
    rates = {name for name, goal in result["targets"].items() if goal["rate"]}  # excused on a busy machine
    assert rates == {"set_decode_seconds", "set_decode_rows_per_s", "set_encode_rows_per_s"}


def test_bundled_examples_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    sglang = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    args = ["inspect", str(sglang), "--num-layers", "48", "--top-k", "8", "--num-experts", "128", "--json"]
    assert main(args) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    assert record["num_tokens"] == 300 and record["num_layers"] == 48
    vllm = EXAMPLES / "moonlight_vllm.json"
    assert main(["inspect", str(vllm), "--num-experts", "64", "--moe-layers", "1-26", "--json"]) == EXIT_OK
    assert main(["inspect", str(vllm), "--num-experts", "64", "--json"]) == EXIT_INVALID


@pytest.mark.hf
def test_bench_replay_small_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "replay", "--batch", "1", "--seq", "16", "--repeats", "2", "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    # order set and engine side by side, and counting disagreement on (replay) and off (replay_uncounted)
    assert set(result["seconds"]) == {"off", "record", "replay", "replay_engine", "replay_uncounted"}
    assert all(s["median"] > 0 for s in result["seconds"].values())
    targets = {"record_over_off", "replay_over_off", "set_over_engine", "counting_over_uncounted"}
    assert set(result["targets"]) == targets
    assert result["config"]["batch"] == 1 and result["config"]["seq"] == 16
    assert result["model"]["hidden"] == 256 and result["config"]["dtype"] == "float32"


@pytest.mark.hf
def test_bench_replay_in_bfloat16_with_fewer_layers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "replay", "--batch", "1", "--seq", "8", "--repeats", "1", "--replay-layers", "2"]
    assert main([*args, "--dtype", "bfloat16", "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["dtype"] == "bfloat16" and result["config"]["layers"] == 2


def test_bench_replay_and_layout_refuse_a_device_this_machine_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "replay", "--device", "cuda:64"]) == EXIT_ERROR
    assert "replay bench: device 'cuda:64' asked for but this machine has" in capsys.readouterr().err
    assert main(["bench", "layout", "--device", "tpu"]) == EXIT_ERROR
    assert "layout bench: 'tpu' is not a torch device" in capsys.readouterr().err


@pytest.mark.hf
def test_bench_engine_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--repeats", "1", "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert set(result["seconds"]) == {"no_capture", "capture"}
    assert result["ratios"]["capture_over_no_capture"] > 0
    assert set(result["targets"]) == {"capture_over_no_capture"}


def test_bench_layout_small_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "layout", "--sequences", "5", "--seq", "40", "--layers", "3", "--sp", "3", "--repeats", "2"]
    assert main([*args, "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert set(result["seconds"]) == {"loop", "plan", "all_ranks"}
    assert 5 * 10 <= result["tokens"] <= 5 * 40
    assert result["route_bytes"] == result["tokens"] * 3 * 8 * 2
    assert result["targets"]["loop_over_plan"]["target"] == 10.0


def test_bench_layout_rejects_a_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "layout", "--sp", "0"])
    assert exit_info.value.code == EXIT_ERROR
    assert "argument --sp: must be an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.hf
def test_bench_all_writes_benchmarks_and_the_readme_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# title\n<!-- bench:begin -->\nstale\n<!-- bench:end -->\nafter\n")
    output = tmp_path / "BENCHMARKS.md"
    assert main(["bench", "all", "--quick", "--output", str(output), "--readme", str(readme), "--json"]) == EXIT_OK
    results = json.loads(capsys.readouterr().out)
    assert list(results) == ["codec", "layout", "store", "delivery", "indexer", "replay", "engine"]
    text = output.read_text()
    for suite in results:
        assert f"`routereplay bench {suite}`" in text
    table = readme.read_text()
    assert "stale" not in table and table.endswith("<!-- bench:end -->\nafter\n")
    assert table.count("\n| ") == sum(len(r["targets"]) for r in results.values()) + 1


def test_bench_all_refuses_a_readme_without_markers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from routereplay.bench.record import write_readme_table
    from routereplay.errors import ConfigError

    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(ConfigError, match="has no <!-- bench:begin --> ... <!-- bench:end --> markers"):
        write_readme_table(readme, "| table |")
    assert readme.read_text() == "# no markers\n"
