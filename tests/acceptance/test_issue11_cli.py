"""Acceptance tests for issue 11, the command line (items 4/10 via inspect elsewhere; 16, 20, 24, 27, 28,
29, 30, 32), through `routereplay.cli.main.main([...])` and the installed `routereplay` script."""

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


# -- item 27 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang", "megatron"], ids=["to-v-llm", "to-sglang", "to-megatron"])
def test_item27_convert_round_trip_keeps_layer_numbers(
    tmp_path: Path, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11 item 27 (silent misroute): convert moonlight_vllm.json moon.rrt --num-experts 64
    --moe-layers 1-26, then convert moon.rrt out.json --to vllm|sglang|megatron, then inspect out.json:
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


# -- item 20 --------------------------------------------------------------------------------------
def test_item20_inspect_token_positions_text(tmp_path: Path) -> None:
    """Issue 11 item 20 (misleading message): inspect on an 83-row trace says "token positions 0..82",
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


# -- item 30 --------------------------------------------------------------------------------------
INVALID_CASES = {
    "ExpertIdRangeError": (MOONLIGHT, ["--num-experts", "8", "--moe-layers", "1-26"]),
    "TopKMismatchError": (SGLANG, ["--num-experts", "128", "--num-layers", "48", "--top-k", "4"]),
    "RowCountError": (MOONLIGHT, ["--num-experts", "64", "--moe-layers", "1-26", "--num-tokens", "50"]),
    "LayerCountError": (SGLANG, ["--num-experts", "128", "--num-layers", "48", "--top-k", "8", "--moe-layers", "0-60"]),
}


@pytest.mark.parametrize("error", sorted(INVALID_CASES))
def test_item30_invalid_routes_exit_1_with_json_verdict(error: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 30 (misleading message): ExpertIdRangeError / TopKMismatchError / RowCountError /
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


def test_item30_valid_and_unreadable_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 30 (misleading message): valid is 0, unreadable (not a trace) is 2; both print a
    JSON verdict with --json."""
    code, verdict = inspect_json(MOONLIGHT, "--num-experts", "64", "--moe-layers", "1-26", capsys=capsys)
    assert (code, verdict["valid"]) == (0, True)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a trace at all")
    code, verdict = inspect_json(junk, capsys=capsys)
    assert code == 2
    assert verdict["readable"] is False and verdict["valid"] is False and verdict["error_type"]


# -- item 28 --------------------------------------------------------------------------------------
def test_item28_inspect_directory_one_line_exit_2(tmp_path: Path) -> None:
    """Issue 11 item 28 (error that is not a RouteReplayError): `inspect .` (a directory) prints one line
    and exits 2, no IsADirectoryError traceback."""
    result = cli("inspect", str(tmp_path))
    assert result.returncode == 2
    assert one_line(result.stderr), result.stderr
    assert str(tmp_path) in result.stderr


def test_item28_convert_onto_existing_directory_with_force(tmp_path: Path) -> None:
    """Issue 11 item 28 (error that is not a RouteReplayError): `convert IN EXISTING_DIR --force` prints
    one line and exits non-zero; the directory is left alone."""
    target = tmp_path / "somedir"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    result = cli("convert", str(MOONLIGHT), str(target), "--num-experts", "64", "--moe-layers", "1-26", "--force")
    assert result.returncode == 2
    assert one_line(result.stderr), result.stderr
    assert (target / "keep.txt").read_text() == "x"


# -- item 29 --------------------------------------------------------------------------------------
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
def test_item29_numeric_flags_validated(flags: list[str]) -> None:
    """Issue 11 item 29 (misleading message): --num-experts 0 / -5 (and other bad numeric flags) are
    refused when parsed (exit 2, naming the flag), not accepted into "outside [0, -5)"."""
    result = cli("inspect", str(MOONLIGHT), *flags)
    assert result.returncode == 2
    assert flags[-2] in result.stderr, result.stderr
    assert "outside [0," not in result.stderr + result.stdout


# -- item 16 --------------------------------------------------------------------------------------
def _file_size_limit(limit: int):
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return setup


def test_item16_write_error_is_one_line_and_old_file_kept(tmp_path: Path) -> None:
    """Issue 11 item 16 (error that is not a RouteReplayError): an OS error while writing (the file-size
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


def test_item16_parent_is_a_file_one_line(tmp_path: Path) -> None:
    """Issue 11 item 16 (error that is not a RouteReplayError): an output path under a regular file
    (NotADirectoryError) prints one line naming the path, exits non-zero."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = cli("convert", str(MOONLIGHT), str(blocker / "out.rrt"), "--num-experts", "64", "--moe-layers", "1-26")
    assert result.returncode != 0
    assert one_line(result.stderr), result.stderr
    assert "out.rrt" in result.stderr or str(blocker) in result.stderr


# -- item 24 --------------------------------------------------------------------------------------
def test_item24_demo_json_without_matplotlib_fails_before_work(tmp_path: Path) -> None:
    """Issue 11 item 24 (data loss): `routereplay demo --json` where matplotlib cannot be imported fails at
    once (one line naming matplotlib, exit 2) instead of training and then losing the output."""
    blocker = tmp_path / "block"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib (blocked)')\n")
    cache = tmp_path / "cache"
    result = cli(
        "demo", "--json", "--report", str(tmp_path / "report"),
        env={"PYTHONPATH": str(blocker), "ROUTEREPLAY_CACHE": str(cache)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "matplotlib" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip() == ""
    assert not cache.exists() or (not any(cache.rglob("*.pt")) and not any(cache.rglob("*.safetensors"))), (
        "the demo model was trained before the missing dependency was noticed"
    )
    assert not (tmp_path / "report").exists()


# -- item 32 --------------------------------------------------------------------------------------
def test_item32_demo_progress_lines_when_stderr_is_not_a_tty(tmp_path: Path) -> None:
    """Issue 11 item 32 (misleading message): long work prints plain progress lines when stderr is a pipe
    (not silent until the end), and each phase's last line reaches its total."""
    result = cli(
        "demo", "--train-steps", "5", "--prompts", "8", "--rl-steps", "0", "--no-report",
        env={"ROUTEREPLAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr while working with stderr not a terminal"
    assert "\x1b[" not in result.stderr, "terminal control codes on a pipe"
    import re

    last: dict[str, tuple[int, int]] = {}
    for line in lines:
        match = re.search(r"^([^:]+):\D*?(\d+)/(\d+)\b", line)
        if match:
            last[match.group(1).strip()] = (int(match.group(2)), int(match.group(3)))
    assert last, lines[:10]
    stuck = {phase: dt for phase, dt in last.items() if dt[0] != dt[1]}
    assert not stuck, f"phases whose last progress line stops short of the total: {stuck}"
