"""CLI failures: documented exit statuses, JSON verdicts, one-line OS errors, and engine hints.

Exit statuses (routereplay.cli.failure): 0 valid/done, 1 invalid routes (inspect), 2 unreadable or error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, encode
from routereplay.cli.main import EXIT_ERROR, EXIT_INVALID, EXIT_OK, main
from tests.wire.payloads import distinct_routes

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "routereplay" / "examples"
MOONLIGHT = EXAMPLES / "moonlight_vllm.json"  # all 27 layers of Moonlight; MoE layers 1-26, 64 experts, top-6
QWEN_SGLANG = EXAMPLES / "qwen3_30b_a3b_sglang.json"  # 48 layers, top-8 of 128


@pytest.mark.parametrize(
    ("flags", "error_type"),
    [
        (["--num-experts", "32"], "ExpertIdRangeError"),
        (["--num-experts", "64", "--top-k", "4"], "TopKMismatchError"),
        (["--num-experts", "64", "--num-tokens", "5"], "RowCountError"),
        (["--num-experts", "64", "--num-layers", "20"], "LayerCountError"),
    ],
)
def test_inspect_invalid_payload_exits_1_with_a_json_verdict(
    flags: list[str], error_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 11 item 30): a readable payload that fails validation is "invalid" (exit 1,
    a JSON verdict on stdout), not "unreadable" (exit 2 with nothing on stdout)."""
    assert main(["inspect", str(MOONLIGHT), *flags, "--json"]) == EXIT_INVALID
    captured = capsys.readouterr()
    verdict = json.loads(captured.out)
    assert verdict["valid"] is False and verdict["readable"] is True
    assert verdict["error_type"] == error_type and verdict["format"] == "vllm"
    assert verdict["error"] and verdict["file"] == str(MOONLIGHT)
    assert main(["inspect", str(MOONLIGHT), *flags]) == EXIT_INVALID
    assert f"INVALID {error_type}" in capsys.readouterr().out


def test_inspect_valid_json_says_readable(capsys: pytest.CaptureFixture[str]) -> None:
    """Misleading message (issue 11 item 30): every --json verdict carries `readable` and `valid`."""
    assert main(["inspect", str(MOONLIGHT), "--num-experts", "64", "--moe-layers", "1-26", "--json"]) == EXIT_OK
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["readable"] is True and verdict["valid"] is True and verdict["error_type"] is None


@pytest.mark.parametrize("junk", [b"\x00\x01garbage", b"RRT", b'{"choices": []}'])
def test_inspect_unreadable_exits_2_with_a_json_verdict(
    junk: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 11 item 30): an unreadable file exits 2 and, under --json, still prints a verdict."""
    path = tmp_path / "junk.bin"
    path.write_bytes(junk)
    assert main(["inspect", str(path), "--num-experts", "8", "--json"]) == EXIT_ERROR
    captured = capsys.readouterr()
    verdict = json.loads(captured.out)
    assert verdict["readable"] is False and verdict["valid"] is False and verdict["error_type"]
    assert "is unreadable" in captured.err


def test_inspect_corrupt_codec_file_is_unreadable(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 11 item 30): a codec file with a flipped byte is unreadable (2), not invalid (1)."""
    blob = bytearray(encode(RouteTrace(distinct_routes(rng, 6, 2, 2, 8), 8)))
    blob[-3] ^= 0xFF
    path = tmp_path / "t.rrt"
    path.write_bytes(bytes(blob))
    assert main(["inspect", str(path), "--json"]) == EXIT_ERROR
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["readable"] is False and verdict["error_type"] in {"ChecksumError", "CodecFormatError"}


def test_inspect_a_directory_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Error that is not a RouteReplayError (issue 11 item 28): `inspect DIR` printed an IsADirectoryError
    traceback and exited 1; it is one line naming the path, exit 2 (unreadable), with a verdict under --json."""
    assert main(["inspect", str(tmp_path)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "Is a directory" in err and "Traceback" not in err
    assert main(["inspect", str(tmp_path), "--json"]) == EXIT_ERROR
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["readable"] is False and "directory" in verdict["error"]


def test_convert_into_an_existing_directory_is_one_line(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    """Error that is not a RouteReplayError (issue 11 item 28): `convert IN EXISTING_DIR --force` printed an
    IsADirectoryError traceback; it is one line saying OUT is a directory, exit 2, and the folder is untouched."""
    rrt = tmp_path / "t.rrt"
    rrt.write_bytes(encode(RouteTrace(distinct_routes(rng, 3, 2, 2, 8), 8)))
    folder = tmp_path / "out.rrt"
    folder.mkdir()
    (folder / "keep").write_text("kept")
    assert main(["convert", str(rrt), str(folder), "--force"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder} is a directory" in err
    assert [p.name for p in folder.iterdir()] == ["keep"]


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from routereplay.cli.main import main
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    sys.exit(main(sys.argv[1:]))
    """
)


def test_os_error_while_writing_is_one_line_and_keeps_the_old_file(tmp_path: Path, rng: np.random.Generator) -> None:
    """Error that is not a RouteReplayError / data loss (issue 11 item 16): an OS error while writing (here
    EFBIG from a file-size limit, as a full disk gives ENOSPC) printed an 18-line traceback; it prints one line
    with the path and the cause, exits 2, and the old output file is kept whole, with no temporary left."""
    source = tmp_path / "big.rrt"
    source.write_bytes(encode(RouteTrace(distinct_routes(rng, 200, 4, 4, 64), 64)))
    target = tmp_path / "out.npy"
    target.write_bytes(b"old contents")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, "convert", str(source), str(target), "--force"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == EXIT_ERROR, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "routereplay convert:" in result.stderr and "File too large" in result.stderr
    assert str(tmp_path) in result.stderr, "the line names the path"
    assert target.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.rrt", "out.npy"], "no temporary file left behind"


def test_forced_engine_that_disagrees_with_the_file_says_which_engine_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 11 item 31): an SGLang file read with --engine vllm advised vLLM server flags;
    the message now says the file looks like an SGLang response and to pass --engine sglang."""
    args = ["inspect", str(QWEN_SGLANG), "--engine", "vllm", "--num-experts", "128"]
    assert main(args) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "looks like an SGLang response, not vllm: pass --engine sglang" in err
    assert "--num-layers and --top-k" in err
    out = tmp_path / "out.rrt"
    assert main(["convert", str(QWEN_SGLANG), str(out), "--engine", "vllm", "--num-experts", "128"]) == EXIT_ERROR
    assert "pass --engine sglang" in capsys.readouterr().err and not out.exists()


def test_forced_engine_that_agrees_adds_no_hint(capsys: pytest.CaptureFixture[str]) -> None:
    """Misleading message (issue 11 item 31): no engine hint when --engine matches what the file is."""
    args = ["inspect", str(QWEN_SGLANG), "--engine", "sglang", "--num-experts", "128", "--num-layers", "48"]
    assert main(args) == EXIT_ERROR  # --top-k missing
    err = capsys.readouterr().err
    assert "--top-k" in err and "looks like" not in err


@pytest.mark.hf
def test_demo_report_path_in_the_way_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Data loss (issue 11 items 16, 24): a --report path that cannot become a folder failed only after the
    demo's training and scoring, losing the output; it is refused first, one line, exit 2."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(cache))
    blocker = tmp_path / "report"
    blocker.write_text("a file")
    args = ["demo", "--prompts", "4", "--train-steps", "2", "--max-new-tokens", "2", "--rl-steps", "0"]
    assert main([*args, "--report", str(blocker)]) == EXIT_ERROR
    assert f"--report {blocker} is a file, not a folder" in capsys.readouterr().err
    assert main([*args, "--report", str(blocker / "inside")]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{blocker / 'inside'}: Not a directory" in err
    assert not cache.exists() and blocker.read_text() == "a file"
