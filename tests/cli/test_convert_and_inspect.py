"""`convert` and `inspect` as a user runs them (the installed `routereplay` script and `main([...])`): layer
numbers survive a round trip through every engine format; inspect counts token positions 0..T-1 and exits 0
(valid), 1 (invalid, with a JSON verdict) or 2 (unreadable); bad numeric flags, directories and failed writes
are refused in one line, and a failed write keeps the old file."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import routereplay
from routereplay import RouteTrace, encode
from routereplay.cli.main import main

EXAMPLES = Path(routereplay.__file__).parent / "examples"
MOONLIGHT = EXAMPLES / "moonlight_vllm.json"
SGLANG = EXAMPLES / "qwen3_30b_a3b_sglang.json"
SCRIPT = Path(sys.executable).parent / "routereplay"


def cli(*args: str, env: dict[str, str] | None = None, preexec=None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, env=full_env, preexec_fn=preexec, check=False
    )


def one_line(text: str) -> bool:
    return "Traceback" not in text and len(text.strip().splitlines()) == 1


def inspect_json(path: Path | str, *flags: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["inspect", str(path), *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "megatron"], ids=["to-v-llm", "to-sglang", "to-megatron"])
def test_a_convert_round_trip_keeps_the_layer_numbers(
    tmp_path: Path, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert moonlight_vllm.json moon.rrt --num-experts 64
    --moe-layers 1-26`, then convert moon.rrt out.json --to vllm|sglang|megatron, then inspect out.json:
    the layers are still 1-26 (not silently renumbered 0-25)."""
    moon, out = tmp_path / "moon.rrt", tmp_path / f"out_{engine}.json"
    assert main(["convert", str(MOONLIGHT), str(moon), "--num-experts", "64", "--moe-layers", "1-26"]) == 0
    assert main(["convert", str(moon), str(out), "--to", engine]) == 0
    capsys.readouterr()
    code, verdict = inspect_json(out, "--num-experts", "64", capsys=capsys)
    assert code == 0, verdict
    assert verdict["layers"] == list(range(1, 27)), verdict["layers"]
    original = main(["inspect", str(moon), "--json"])
    assert original == 0
    assert json.loads(capsys.readouterr().out)["layers"] == verdict["layers"]


def test_inspect_counts_token_positions_from_0_to_rows_minus_1(tmp_path: Path) -> None:
    """Inspect on an 83-row trace says "token positions 0..82",
    not 0..83."""
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((83, 2, 8)), axis=-1)[..., :2].astype(np.int16)
    path = tmp_path / "t83.rrt"
    path.write_bytes(encode(RouteTrace(experts, 8)))
    result = cli("inspect", str(path))
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "83 (token positions 0..82)" in text, text[:400]
    assert "0..83" not in text


INVALID_CASES = {
    "ExpertIdRangeError": (MOONLIGHT, ["--num-experts", "8", "--moe-layers", "1-26"]),
    "TopKMismatchError": (SGLANG, ["--num-experts", "128", "--num-layers", "48", "--top-k", "4"]),
    "RowCountError": (MOONLIGHT, ["--num-experts", "64", "--moe-layers", "1-26", "--num-tokens", "50"]),
    "LayerCountError": (SGLANG, ["--num-experts", "128", "--num-layers", "48", "--top-k", "8", "--moe-layers", "0-60"]),
}


@pytest.mark.parametrize("error", sorted(INVALID_CASES))
def test_invalid_routes_exit_1_with_a_json_verdict(error: str, capsys: pytest.CaptureFixture[str]) -> None:
    """ExpertIdRangeError / TopKMismatchError / RowCountError /
    LayerCountError are invalid traces: inspect exits 1 (not 2), and with --json prints a verdict."""
    path, flags = INVALID_CASES[error]
    code, verdict = inspect_json(path, *flags, capsys=capsys)
    assert verdict["valid"] is False
    assert verdict["error_type"] == error or error in verdict["error_type"], verdict
    assert code == 1, verdict
    assert verdict["readable"] is True
    code = main(["inspect", str(path), *flags])
    assert code == 1
    assert "INVALID" in capsys.readouterr().out


def test_valid_exits_0_and_unreadable_exits_2_with_a_json_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid is 0, unreadable (not a trace) is 2; both print a
    JSON verdict with --json."""
    code, verdict = inspect_json(MOONLIGHT, "--num-experts", "64", "--moe-layers", "1-26", capsys=capsys)
    assert (code, verdict["valid"]) == (0, True)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a trace at all")
    code, verdict = inspect_json(junk, capsys=capsys)
    assert code == 2
    assert verdict["readable"] is False and verdict["valid"] is False and verdict["error_type"]


def test_inspecting_a_directory_exits_2_in_one_line(tmp_path: Path) -> None:
    """`inspect .` (a directory) prints one line
    and exits 2, no IsADirectoryError traceback."""
    result = cli("inspect", str(tmp_path))
    assert result.returncode == 2
    assert one_line(result.stderr), result.stderr
    assert str(tmp_path) in result.stderr


def test_convert_force_onto_a_directory_leaves_it_alone(tmp_path: Path) -> None:
    """`convert IN EXISTING_DIR --force` prints
    one line and exits non-zero; the directory is left alone."""
    target = tmp_path / "somedir"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    result = cli("convert", str(MOONLIGHT), str(target), "--num-experts", "64", "--moe-layers", "1-26", "--force")
    assert result.returncode == 2
    assert one_line(result.stderr), result.stderr
    assert (target / "keep.txt").read_text() == "x"


@pytest.mark.parametrize(
    "flags",
    [
        ["--num-experts", "0"],
        ["--num-experts", "-5"],
        ["--num-experts", "64", "--top-k", "0"],
        ["--num-experts", "64", "--num-layers", "-1"],
        ["--num-experts", "64", "--num-tokens", "-3"],
        ["--num-experts", "64", "--start", "-1"],
        ["--num-experts", "64", "--index", "-1"],
        ["--num-experts", "abc"],
    ],
)
def test_bad_numeric_flags_are_refused_when_parsed(flags: list[str]) -> None:
    """`--num-experts 0` / `-5` (and other bad numeric flags) are
    refused when parsed (exit 2, naming the flag), not accepted into "outside [0, -5)"."""
    result = cli("inspect", str(MOONLIGHT), *flags)
    assert result.returncode == 2
    assert flags[-2] in result.stderr, result.stderr
    assert "outside [0," not in result.stderr + result.stdout


def _file_size_limit(limit: int):
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return setup


def test_a_failed_write_is_one_line_and_keeps_the_old_file(tmp_path: Path) -> None:
    """An OS error while writing (the file-size
    limit makes the write fail as a full disk would) prints one line with the path and the cause, exits
    non-zero, and keeps the old file."""
    out = tmp_path / "moon.rrt"
    out.write_bytes(b"OLD CONTENT")
    result = cli(
        "convert", str(MOONLIGHT), str(out), "--num-experts", "64", "--moe-layers", "1-26", "--force",
        preexec=_file_size_limit(64),
    )  # fmt: skip
    assert result.returncode != 0
    assert one_line(result.stderr), result.stderr
    assert "moon.rrt" in result.stderr
    assert out.read_bytes() == b"OLD CONTENT"


def test_an_output_under_a_regular_file_is_one_line(tmp_path: Path) -> None:
    """An output path under a regular file
    (NotADirectoryError) prints one line naming the path, exits non-zero."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = cli("convert", str(MOONLIGHT), str(blocker / "out.rrt"), "--num-experts", "64", "--moe-layers", "1-26")
    assert result.returncode != 0
    assert one_line(result.stderr), result.stderr
    assert "out.rrt" in result.stderr or str(blocker) in result.stderr
