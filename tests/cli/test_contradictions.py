"""Flags that contradict each other or the file they are given with are refused by name (issue 30 items 13, 16, 19,
and 23's `inspect FILE.rrt` hints), before any work, never silently ignored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, encode
from routereplay.cli.main import EXIT_ERROR, EXIT_INVALID, EXIT_OK, main
from tests.wire.payloads import distinct_routes


@pytest.fixture
def rrt(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A set-mode codec file of 6 rows from token 2 (num_tokens 9), layers 1-3, top-4 of 64."""
    path = tmp_path / "m.rrt"
    path.write_bytes(encode(RouteTrace(distinct_routes(rng, 6, 3, 4, 64), 64, (1, 2, 3), start=2)))
    return path


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    assert main(args) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# -- item 19: convert --------------------------------------------------------------------------------------------


def test_convert_refuses_to_that_contradicts_the_extension(
    rrt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert m.rrt out.rrt --to npy` wrote .npy bytes under the .rrt name; the same for .npy / .json."""
    for name, to in (("out.rrt", "npy"), ("out.npy", "rrt"), ("out.npy", "vllm"), ("out.json", "rrt")):
        _refused(["convert", str(rrt), str(tmp_path / name), "--to", to], capsys, f"--to {to} contradicts OUT")
        assert not (tmp_path / name).exists()
    assert main(["convert", str(rrt), str(tmp_path / "out.json"), "--to", "vllm"]) == EXIT_OK


def test_convert_refuses_codec_options_for_another_output(
    rrt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert mo.rrt out.npy --mode ordered` was accepted and the mode dropped; --zstd likewise."""
    _refused(["convert", str(rrt), str(tmp_path / "o.npy"), "--mode", "ordered"], capsys, "--mode only applies")
    _refused(["convert", str(rrt), str(tmp_path / "o.json"), "--to", "sglang", "--zstd"], capsys, "--zstd only")
    assert not list(tmp_path.glob("o.*"))


def test_inspect_refuses_a_flag_against_what_a_written_payload_records(
    rrt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect m_vllm.json --num-experts 32` on a payload routereplay wrote with E=64 decoded with E=32 (the .rrt
    of the same routes refused it); now refused the same way, as are --top-k, --moe-layers and --start."""
    payload = tmp_path / "m_vllm.json"
    assert main(["convert", str(rrt), str(payload), "--to", "vllm"]) == EXIT_OK
    capsys.readouterr()
    for flags, needle in (
        (["--num-experts", "32"], "num_experts=64"),
        (["--top-k", "2"], "top_k=4"),
        (["--moe-layers", "1-2"], "moe_layers=1-3"),
        (["--start", "5"], "start=2"),
    ):
        _refused(["inspect", str(payload), *flags], capsys, needle, "ConfigError")
    assert main(["inspect", str(payload), "--num-experts", "64", "--start", "2", "--json"]) == EXIT_OK


# -- item 23 (left from earlier): inspect FILE.rrt ignored --num-tokens, --start, --index -----------------------


def test_inspect_codec_file_refuses_contradicting_sequence_flags(rrt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["inspect", str(rrt), "--index", "1"], capsys, "--index 1", "holds one sequence")
    _refused(["inspect", str(rrt), "--start", "0"], capsys, "records start=2 but --start says 0")
    assert main(["inspect", str(rrt), "--num-tokens", "12", "--json"]) == EXIT_INVALID
    verdict = json.loads(capsys.readouterr().out)
    assert (
        verdict["error_type"] == "RowCountError" and "expected 9 = --num-tokens(12) - 1 - start(2)" in verdict["error"]
    )
    assert main(["inspect", str(rrt), "--num-tokens", "9", "--start", "2", "--index", "0", "--json"]) == EXIT_OK


def test_npy_file_checks_num_tokens_and_refuses_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npy = tmp_path / "m.npy"
    np.save(npy, np.tile(np.arange(4), (5, 2, 1)))
    _refused(["inspect", str(npy), "--num-experts", "8", "--index", "2"], capsys, "a .npy array")
    assert main(["inspect", str(npy), "--num-experts", "8", "--num-tokens", "7"]) == EXIT_INVALID
    assert "RowCountError" in capsys.readouterr().out
    assert main(["inspect", str(npy), "--num-experts", "8", "--num-tokens", "6"]) == EXIT_OK


# -- item 19: demo -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--report", "x"], ["--force"], ["--report", "x", "--force"]])
def test_demo_refuses_no_report_with_report_flags(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _refused(["demo", "--no-report", *flags], capsys, "--no-report and", "contradict")
    assert not (tmp_path / "x").exists()


# -- item 13: train --url without a remote engine --------------------------------------------------------------


def test_train_refuses_url_with_the_built_in_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """`train --url URL` without --engine trained on the built-in engine and exited 0."""
    _refused(["train", "--url", "http://127.0.0.1:9"], capsys, "--engine vllm or --engine sglang", "drop --url")
    _refused(["train", "--engine", "sglang"], capsys, "--engine sglang needs --url")


def test_train_refuses_an_empty_url(capsys: pytest.CaptureFixture[str]) -> None:
    """`train --url "" --mode R3 --steps 1` trained on the built-in engine and exited 0."""
    for engine in ([], ["--engine", "sglang"], ["--engine", "vllm"]):
        _refused(["train", "--url", "", "--mode", "R3", "--steps", "1", *engine], capsys, "--url '' is empty")
    _refused(["train", "--url", " ", "--steps", "1"], capsys, "--url ' ' is empty")


def test_train_mode_lists_its_choices_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # `r3` is R3 (issue 38 item 20); a mode that names none is refused
        main(["train", "--mode", "r4"])
    assert exited.value.code == EXIT_ERROR
    assert "invalid choice: 'r4' (choose from 'off', 'R2', 'R3')" in capsys.readouterr().err


def test_train_async_flag_without_async_is_one_grammatical_line(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["train", "--schedule", "seeded"], capsys, "--schedule only applies to fully-async training")


# -- item 16: bench all --readme ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "# no markers\n", "<!-- bench:end -->\n<!-- bench:begin -->\n"])
def test_bench_all_checks_the_readme_before_running(
    text: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing --readme, or one without the markers, failed after the ~12 min run and left a fresh BENCHMARKS.md;
    it is refused before the first suite, and nothing is written."""
    readme = tmp_path / "README.md"
    if text is not None:
        readme.write_text(text)
    output = tmp_path / "BENCHMARKS.md"
    _refused(["bench", "all", "--quick", "--output", str(output), "--readme", str(readme)], capsys, "--readme")
    assert not output.exists()


def test_bench_readme_only_with_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["bench", "codec", "--readme", str(tmp_path / "README.md")], capsys, "only `bench all`")
