"""Piped output is not hard-wrapped (issue 30 item 21): rich laid tables and text out at 80 columns when stdout
was not a terminal, so the demo's summary broke mid-phrase, a GRPO table row split in two, and every line was
padded with trailing spaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from routereplay.cli.console import show
from routereplay.cli.main import EXIT_OK, main
from routereplay.cli.step_tables import render

MOONLIGHT = Path(__file__).resolve().parents[2] / "src" / "routereplay" / "examples" / "moonlight_vllm.json"


def _no_trailing_spaces(out: str) -> None:
    assert out and all(line == line.rstrip() for line in out.splitlines()), out


def test_piped_inspect_keeps_each_fact_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MOONLIGHT), "--num-experts", "64", "--moe-layers", "1-26"]) == EXIT_OK
    out = capsys.readouterr().out
    _no_trailing_spaces(out)
    coverage = next(line for line in out.splitlines() if line.startswith("coverage"))
    assert coverage.endswith("(live fallback); 96 tokens routed in every layer")


def test_piped_grpo_table_rows_are_whole(capsys: pytest.CaptureFixture[str]) -> None:
    row = {
        "step": 7,
        "mode": "R3",
        "reward_mean": 0.84,
        "rollout_routing_disagreement": 0.0,
        "rollout_disagreement_per_mini_step": [0.0, 0.0],
        "k3_kl": 1.5e-4,
        "max_drift": 0.0,
        "ppo_kl": 2.5e-3,
        "clip_frac": 0.07,
        "grad_norm": 2.621,
        "fallback_rows": 12345,
        "seconds": {"rollout": 1000.25, "update": 2000.5},
    }
    render([row])
    out = capsys.readouterr().out
    _no_trailing_spaces(out)
    (line,) = [line for line in out.splitlines() if "12345" in line]
    assert "84.0%" in line and "2.621" in line and "3000.8" in line


def test_piped_text_is_not_wrapped_at_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    text = "[bold]qwen3_moe[/bold] " + "word " * 60 + "end of the phrase"
    show(text)
    out = capsys.readouterr().out
    assert out == "qwen3_moe " + "word " * 60 + "end of the phrase\n", "one line, no markup, no padding"


# -- issue 38 item 20: the notes under the train and async tables -------------------------------------------------


def test_piped_table_notes_are_left_aligned_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """The notes under the train and async tables were a rich caption: centred under the table and wrapped at its
    width, so piped they came out ragged (` ≠eng: ...` then `          drift: ...`). Each note is now one line,
    starting at the first column."""
    from routereplay.cli.step_tables import ASYNC_NOTES, TRAIN_NOTES, render_async

    row = {
        "step": 0,
        "mode": "R3",
        "reward_mean": 0.5,
        "rollout_routing_disagreement": 0.0,
        "rollout_disagreement_per_mini_step": [0.0],
        "k3_kl": 1e-4,
        "max_drift": 0.0,
        "ppo_kl": 1e-3,
        "clip_frac": 0.1,
        "grad_norm": 1.0,
        "fallback_rows": 3,
        "seconds": {"rollout": 1.0},
    }
    render([row])
    assert capsys.readouterr().out.splitlines()[-len(TRAIN_NOTES) :] == list(TRAIN_NOTES)
    fully = {
        **row,
        "resume_routes": "prefix-replay",
        "policy_version": 1,
        "stale_row_fraction": 0.0,
        "aborts": 2,
        "resumed_samples": 1,
        "resumed_row_fraction": 0.1,
        "prefix_conflicts": 0,
        "dropped_stale_groups": 0,
        "samples_per_second": 12.5,
    }
    render_async([fully])
    assert capsys.readouterr().out.splitlines()[-len(ASYNC_NOTES) :] == list(ASYNC_NOTES)
