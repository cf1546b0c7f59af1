"""CLI errors name the CLI's flags, never a Python keyword no flag has (issue 30 item 18): `cli_message` turns a
library message's `start_len=` / `choice=` / `index=` advice into `--start` / `--index`, and leaves out advice for a
keyword without a flag (`layers=`, `retries=`, `timeout=`)."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from routereplay.cli.failure import cli_message
from routereplay.cli.main import EXIT_ERROR, EXIT_INVALID, main

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "routereplay" / "examples"
MOONLIGHT = EXAMPLES / "moonlight_vllm.json"  # all 27 layers of Moonlight; MoE layers 1-26, 64 experts, top-6
QWEN_SGLANG = EXAMPLES / "qwen3_30b_a3b_sglang.json"  # 48 layers, top-8 of 128, 300 rows
SGLANG_FLAGS = ["--num-experts", "128", "--num-layers", "48", "--top-k", "8"]
# a Python keyword advised as `name=` (a value may follow): none may reach a CLI user
KEYWORD_ADVICE = re.compile(r"(?<![\w.])(start_len|prompt_start|choice|index|layers|moe_layers|retries|timeout)=")


def _verdict(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*args, "--json"]) in (EXIT_INVALID, EXIT_ERROR)
    error = json.loads(capsys.readouterr().out)["error"]
    assert not KEYWORD_ADVICE.search(error), error
    return str(error)


def test_start_len_advice_names_start(capsys: pytest.CaptureFixture[str]) -> None:
    """`--start 3` on an SGLang response whose routes start at 0 advised `pass start_len=0`."""
    error = _verdict(["inspect", str(QWEN_SGLANG), *SGLANG_FLAGS, "--start", "3"], capsys)
    assert "pass --start 0" in error
    error = _verdict(["inspect", str(QWEN_SGLANG), *SGLANG_FLAGS, "--num-tokens", "500"], capsys)
    assert "not passed as --start" in error


def test_choice_and_index_advice_names_index(capsys: pytest.CaptureFixture[str]) -> None:
    """`--index 1` on a /generate result said `choice=1 picks ... indexed by index=`."""
    error = _verdict(["inspect", str(QWEN_SGLANG), *SGLANG_FLAGS, "--index", "1"], capsys)
    assert error.count("--index") == 2 and "--index 1 picks a choice" in error


def test_an_index_out_of_range_names_index(capsys: pytest.CaptureFixture[str]) -> None:
    """`convert m_vllm.json o.rrt --index 5` said `choices index 5 is out of range` without naming --index."""
    error = _verdict(["inspect", str(MOONLIGHT), "--num-experts", "64", "--index", "5"], capsys)
    assert "--index 5 (the choices index) is out of range" in error, error


def test_layers_advice_without_a_flag_is_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    """`--moe-layers` beyond the payload advised `pass layers= instead`: the CLI has no such flag."""
    error = _verdict(["inspect", str(MOONLIGHT), "--num-experts", "64", "--moe-layers", "1-30"], capsys)
    assert "has only 27 layers" in error and "instead" not in error


def test_a_flag_the_library_already_named_is_kept_once(capsys: pytest.CaptureFixture[str]) -> None:
    error = _verdict(["inspect", str(MOONLIGHT)], capsys)
    assert "pass --num-experts, taken from the model's config.json" in error and "(CLI:" not in error


@pytest.mark.hf
def test_retries_and_timeout_advice_is_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train --engine vllm --url DEAD` ended "... up and healthy, or raise retries=/timeout=": no flag sets them."""
    from routereplay.rl.model import train_demo_model

    model, tokenizer = train_demo_model("qwen3_moe", steps=2)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["train", "--engine", "vllm", "--url", f"http://127.0.0.1:{port}", "--model", str(tmp_path / "ckpt")]
    assert main(args) == EXIT_ERROR
    err = capsys.readouterr().err.splitlines()[-1]
    assert "EngineRequestError" in err and err.endswith("Check that the vLLM server is up and healthy"), err
    assert not KEYWORD_ADVICE.search(err), err


@pytest.mark.parametrize(
    ("library", "cli"),
    [
        (
            "the payload starts at token 0, not 3: pass start_len=0, or",
            "the payload starts at token 0, not 3: pass --start 0, or",
        ),
        (
            "x: the payload does not record top_k; pass top_k= (CLI: --top-k), taken",
            "x: the payload does not record top_k; pass --top-k, taken",
        ),
        ("x: num_layers=47 (CLI: --num-layers), but", "x: --num-layers 47, but"),
        (
            "the file records num_experts=64 but --num-experts says 32",
            "the file records num_experts=64 but --num-experts says 32",
        ),
        ("above CodecLimits.max_entries=268435456; raise", "above CodecLimits.max_entries=268435456; raise"),
        ("x failed. Check the server, or raise retries=/deadline=", "x failed. Check the server"),
        ("over max_response_bytes=5. Raise the client's max_response_bytes= if expected", "over max_response_bytes=5."),
        ("a; if MoE-only pass layers= instead; b", "a; b"),
        (
            "choices index 5 is out of range: the response holds 1 (indices [0])",
            "--index 5 (the choices index) is out of range: the response holds 1 (indices [0])",
        ),
        (
            "x: requests index 3 is out of range: the response holds 2",
            "x: --index 3 (the requests index) is out of range: the response holds 2",
        ),
    ],
)
def test_cli_message(library: str, cli: str) -> None:
    assert cli_message(library) == cli
