"""Progress on stderr: plain rate-limited lines when stderr is not a terminal, and every phase reaching its total."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from routereplay.cli.progress import LineProgress, phase_progress

SRC = Path(__file__).resolve().parents[2] / "src"


class Clock:
    """A clock the test advances by hand (the rate limit is about seconds, and tests must not sleep)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_are_rate_limited_per_phase() -> None:
    """Resource exhaustion of a log (issue 11 item 32): plain progress prints a start line, at most one line per
    interval per phase, and an end line, however often the work reports."""
    stream, clock = io.StringIO(), Clock()
    lines = LineProgress(stream, interval_s=30.0, clock=clock)
    for step in range(1, 1001):  # 1000 reports over 100 s: 0.1 s apart
        clock.now += 0.1
        lines("training", step - 1, 1000)
        if step == 500:
            lines("sampling", 0, 4)  # a second phase keeps its own rate limit
    lines("training", 1000, 1000)
    lines("training", 1000, 1000)  # reports after the end print nothing more
    out = stream.getvalue().splitlines()
    training = [line for line in out if line.startswith("training:")]
    assert training[0] == "training: started 0/1000 (0%)"
    assert training[-1].startswith("training: done 1000/1000 (100%)")
    assert len(training) == 2 + 3, "start, one line per 30 s over 100 s, and the end"
    assert all("left" in line for line in training[1:-1]), "progress lines estimate the time left"
    assert [line for line in out if line.startswith("sampling:")] == ["sampling: started 0/4 (0%)"]
    lines.close()
    assert stream.getvalue().splitlines()[-1].startswith("sampling: stopped 0/4"), "an unfinished phase says so"


def test_phase_progress_uses_lines_when_the_stream_is_not_a_terminal() -> None:
    """Resource exhaustion of a log (issue 11 item 32): a pipe or a file gets lines, not a live display."""
    stream = io.StringIO()
    with phase_progress(stream=stream) as report:
        report("bench codec", 0, None, "encode")
        report.end("bench codec")
        report("scoring", 0, 2)
        report("scoring", 2, 2)
    out = stream.getvalue().splitlines()
    assert out[0] == "bench codec: started encode"
    assert out[1].startswith("bench codec: done ")
    assert out[2:3] == ["scoring: started 0/2 (0%)"] and out[3].startswith("scoring: done 2/2 (100%)")
    assert "\x1b[" not in stream.getvalue(), "no terminal control codes in a log"


def test_phase_progress_reports_where_work_stopped_on_an_error() -> None:
    """Misleading message (issue 11 item 32): a log that ends mid-phase says where the phase stopped."""
    stream = io.StringIO()
    with pytest.raises(KeyError), phase_progress(stream=stream) as report:
        report("training", 3, 10)
        raise KeyError("boom")
    assert stream.getvalue().splitlines()[-1].startswith("training: stopped 3/10 (30%)")


def _run_cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "routereplay.cli.main", *args],
        capture_output=True,  # stderr is a pipe, not a terminal: as in a CI log, under nohup, or piped
        text=True,
        env=environment,
        timeout=900,
    )


def test_bench_prints_progress_lines_into_a_pipe() -> None:
    """Resource exhaustion of patience (issue 11 item 32): with stderr a pipe, long work printed nothing;
    it now prints plain start and end lines for each suite."""
    result = _run_cli(["bench", "codec", "--tokens", "64", "--layers", "4", "--repeats", "1", "--json"])
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("bench codec: started") for line in lines), result.stderr
    assert any(re.fullmatch(r"bench codec: done \d+s elapsed", line) for line in lines), result.stderr
    assert "\x1b[" not in result.stderr


@pytest.mark.hf
def test_demo_phases_each_reach_their_total_in_a_pipe(tmp_path: Path) -> None:
    """Misleading message (issue 11 item 32): the demo printed nothing when stderr was not a terminal, and its
    "scoring (trainer, off)" bar stayed at 0/2; every phase now starts and ends with done N/N."""
    args = ["demo", "--prompts", "8", "--train-steps", "4", "--max-new-tokens", "2", "--rl-steps", "1"]
    result = _run_cli([*args, "--no-report", "--json"], ROUTEREPLAY_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    phases = {line.split(": ", 1)[0] for line in lines if ": started" in line}
    assert {
        "training the demo model (cached after this run)",
        "sampling (engine)",
        "scoring (trainer, off then R3)",
    } <= phases
    assert {"GRPO steps (off)", "GRPO steps (R2)", "GRPO steps (R3)"} <= phases
    for phase in phases:
        done = [line for line in lines if line.startswith(f"{phase}: done ")]
        assert len(done) == 1, f"{phase} never reached its total:\n{result.stderr}"
        total = re.match(r".*: done (\d+)/(\d+)", done[0])
        assert total is not None and total.group(1) == total.group(2)
    assert not [line for line in lines if ": stopped" in line]
    assert any(line.startswith("scoring (trainer, off then R3): done 2/2") for line in lines)


def test_terminal_bars_each_reach_their_total() -> None:
    """Misleading message (issue 11 item 32): on a terminal each phase is one bar; reported to its total, every
    bar ends complete (the demo's "scoring (trainer, off)" bar used to stay at 0/2 beside an R3 bar)."""
    stream = io.StringIO()
    with phase_progress(stream=stream, tty=True) as report:
        report("scoring (trainer, off then R3)", 0, 2)
        report("scoring (trainer, off then R3)", 1, 2)
        report("scoring (trainer, off then R3)", 2, 2)
        report("bench codec", 0, None, "encode")
        report.end("bench codec")
        tasks = report.progress.tasks  # type: ignore[attr-defined]
        assert [task.description for task in tasks] == ["scoring (trainer, off then R3)", "bench codec"]
        assert all(task.finished for task in tasks)


def test_counted_steps_say_the_time_left() -> None:
    """Issue 38 item 12: `bench replay` printed "repeat 6/21 8m19s elapsed" and no time left. A counted step gets
    the mean time of the counts done so far times the ones left, less the time the current one has run."""
    from routereplay.cli.progress import RepeatClock

    clock = Clock()
    repeats = RepeatClock(clock=clock)
    assert repeats.annotate("bench replay", "building the model") == "building the model"
    assert repeats.annotate("bench replay", "repeat 1/21") == "repeat 1/21"  # nothing finished yet: no guess
    clock.now += 25.0
    assert repeats.annotate("bench replay", "repeat 2/21") == "repeat 2/21, ~8m20s left"  # 25 s x 20
    clock.now += 10.0  # within repeat 2: its 10 s are taken off
    assert repeats.annotate("bench replay", "repeat 2/21") == "repeat 2/21, ~8m10s left"
    clock.now += 15.0
    assert repeats.annotate("bench replay", "repeat 3/21") == "repeat 3/21, ~7m55s left"  # 25 s x 19
    # another count of the same phase (the load bench's halves) and another phase keep their own clocks
    assert repeats.annotate("bench load", "repeat 1/3, quiet: train") == "repeat 1/3, quiet: train"
    clock.now += 60.0
    assert repeats.annotate("bench load", "repeat 2/3, loaded: demo") == "repeat 2/3, loaded: demo, ~2m00s left"
    assert repeats.annotate("bench load", "sample 1/4") == "sample 1/4"
