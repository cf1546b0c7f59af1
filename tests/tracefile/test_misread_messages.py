"""A misread payload is explained, not blamed on the engine: a wrong --top-k names the splits the byte count
fits (never "stale capture buffer" or "zero padding"), an SGLang file read as vLLM names SGLang, truncated
JSON gives the character, and raw response text handed to decode_vllm says to pass the parsed JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import routereplay
from routereplay import RouteReplayError, decode_vllm
from routereplay.cli.main import main
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints

EXAMPLES = Path(routereplay.__file__).parent / "examples"


def test_a_wrong_top_k_names_the_splits_the_bytes_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong --top-k on the SGLang example must not blame
    "another sequence / stale capture buffer"; it names the splits the byte count fits."""
    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--num-experts", "128", "--num-layers", "48", "--top-k", "4"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (1, 2)
    assert "stale capture buffer" not in text
    assert "top_k" in text or "top-k" in text


def test_a_same_product_split_is_not_called_zero_padding(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11 item 31 (misleading message): --num-layers 24 --top-k 16 (same product as 48 x 8) must
    not be explained as "zero padding used for 'no route'"; the message names several fitting shapes."""
    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--num-experts", "128", "--num-layers", "24", "--top-k", "16", "--json"])
    verdict = json.loads(capsys.readouterr().out)
    assert code == 1
    assert verdict["valid"] is False
    assert "--num-layers 48, --top-k 8" in verdict["error"]  # the CLI names its flags (cli/failure.py)
    assert "split is probably wrong" in verdict["error"]


def test_an_sglang_file_read_as_vllm_names_sglang(capsys: pytest.CaptureFixture[str]) -> None:
    """An SGLang file read with --engine vllm is told it looks
    like SGLang, not given vLLM flags only."""
    path = EXAMPLES / "qwen3_30b_a3b_sglang.json"
    code = main(["inspect", str(path), "--engine", "vllm", "--num-experts", "128"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (1, 2)
    assert "sglang" in text.lower()


def test_truncated_json_says_invalid_json_at_character_n(tmp_path: Path) -> None:
    """Truncated JSON says "invalid JSON at character N"."""
    text = (EXAMPLES / "moonlight_vllm.json").read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(RouteReplayError, match=r"(?i)invalid JSON.*character \d+"):
        read_trace(path, PayloadHints(num_experts=64))


def test_raw_response_text_to_decode_vllm_says_pass_the_parsed_json() -> None:
    """The raw response text given to decode_vllm is told to pass
    the parsed JSON, not called corrupt base64."""
    text = (EXAMPLES / "moonlight_vllm.json").read_text()
    with pytest.raises(RouteReplayError, match=r"(?i)pars"):
        decode_vllm(text, num_experts=64)
