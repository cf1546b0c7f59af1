"""`routereplay demo` from the shell: with --json and no matplotlib it fails at once, before training or
writing anything; with stderr on a pipe it prints plain progress lines, each phase's last reaching its total."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.test_convert_and_inspect import cli


def test_demo_json_without_matplotlib_fails_before_training(tmp_path: Path) -> None:
    """`routereplay demo --json` where matplotlib cannot be imported fails at
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


def test_demo_prints_progress_lines_that_reach_their_totals_on_a_pipe(tmp_path: Path) -> None:
    """Long work prints plain progress lines when stderr is a pipe
    (not silent until the end), and each phase's last line reaches its total."""
    result = cli(
        "demo", "--train-steps", "5", "--prompts", "8", "--rl-steps", "0", "--no-report",
        env={"ROUTEREPLAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr while working with stderr not a terminal"
    assert "\x1b[" not in result.stderr, "terminal control codes on a pipe"
    last: dict[str, tuple[int, int]] = {}
    for line in lines:
        match = re.search(r"^([^:]+):\D*?(\d+)/(\d+)\b", line)
        if match:
            last[match.group(1).strip()] = (int(match.group(2)), int(match.group(3)))
    assert last, lines[:10]
    stuck = {phase: dt for phase, dt in last.items() if dt[0] != dt[1]}
    assert not stuck, f"phases whose last progress line stops short of the total: {stuck}"


def test_the_demos_last_line_names_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 38 item 20: the demo ended at its report line, with no word on where R3 goes next, and the threshold
    mode's column did not name its margin. A recorded result stands in for the demo's run."""
    import routereplay.rl.demo
    from routereplay.cli.main import main
    from routereplay.report.table import NEXT_STEPS
    from tests.report.test_page import fake_result

    result = fake_result(steps=False)
    result["config"]["threshold"] = 0.003
    result["modes"]["R3-threshold"] = {**result["modes"]["R3"], "replace_rate": 0.002}
    monkeypatch.setattr(routereplay.rl.demo, "run_demo", lambda *_args, **_kwargs: result)
    assert main(["demo", "--report", str(tmp_path / "report")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == f"report: {tmp_path / 'report'}/report.html (4 files)" and lines[-1] == NEXT_STEPS
    assert "R3-threshold (margin 0.003)" in "\n".join(lines)
    for guide in ("replay", "trl", "verl", "skyrl", "megatron"):
        assert f"docs/{guide}.md" in NEXT_STEPS
