"""A checkpoint that cannot be loaded (issue 30 items 12 and 21): a truncated model.safetensors, in `--model DIR` or
in the demo model's cache, and a model_type transformers does not know, each end in one line naming the folder
(and, for the cache, the folder to delete), with exit status 2; no traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main

pytestmark = pytest.mark.hf

TINY = ["--prompts", "4", "--max-new-tokens", "2", "--rl-steps", "0", "--no-report"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real save_pretrained checkpoint (a 2-step demo model and its tokenizer)."""
    from routereplay.rl.model import train_demo_model

    folder = tmp_path_factory.mktemp("ckpt") / "ckpt"
    model, tokenizer = train_demo_model("qwen3_moe", steps=2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _truncate(weights: Path) -> None:
    os.truncate(weights, weights.stat().st_size // 2)  # what a full disk or a killed copy leaves


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("routereplay ")]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("command", [["demo", *TINY], ["train", "--steps", "1"]])
def test_truncated_weights_in_model_dir_are_named_in_one_line(
    command: list[str], saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    _truncate(broken / "model.safetensors")
    assert main([*command, "--model", str(broken)]) == EXIT_ERROR
    line = _one_line(capsys)
    assert f"CheckpointError: --model {broken}: its weights (*.safetensors) are truncated or corrupt" in line


def test_a_truncated_cached_demo_model_names_the_folder_to_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path / "cache"))
    args = ["demo", *TINY, "--train-steps", "2", "--json"]
    assert main(args) == EXIT_OK  # trains and caches the demo model
    capsys.readouterr()
    (cached,) = (tmp_path / "cache").glob("demo-qwen3_moe-*")
    _truncate(cached / "model.safetensors")
    assert main(args) == EXIT_ERROR
    line = _one_line(capsys)
    # issue 38 item 20: the fix (delete the folder) comes first, and no advice meant for a --model follows it
    assert f"the cached demo model {cached} cannot be loaded: delete that folder (rm -r {cached}) and run again" in line
    assert "(what failed: its weights (*.safetensors) are truncated or corrupt" in line
    assert "copy or save the checkpoint again" not in line
    shutil.rmtree(cached)  # what the message says to do
    assert main(args) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["model"]["source"].startswith("trained now")


def test_an_unknown_model_type_is_one_line(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' error for an unknown model_type carries paragraphs of upgrade advice; the CLI keeps the first."""
    unknown = tmp_path / "unknown"
    shutil.copytree(saved, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not_a_model_type"}))
    assert main(["demo", *TINY, "--model", str(unknown)]) == EXIT_ERROR
    line = _one_line(capsys)
    assert "CheckpointError" in line and "not_a_model_type" in line and "pip install" not in line
    # issue 38 item 20: a fact, not transformers' guess that it is out of date
    assert "model_type 'not_a_model_type', which transformers 5." in line and "does not have" in line
    assert "out of date" not in line and "This could be because" not in line


def test_a_weights_file_as_model_is_a_file_not_a_folder(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38 item 20: `--model ckpt/model.safetensors` said "not a checkpoint folder (no config.json there)"."""
    weights = saved / "model.safetensors"
    assert main(["demo", *TINY, "--model", str(weights)]) == EXIT_ERROR
    line = _one_line(capsys)
    assert f"--model {weights} is a file, not a folder" in line and f"this file's is {saved})" in line
