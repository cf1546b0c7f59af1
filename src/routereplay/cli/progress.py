"""Progress of long CLI work on stderr: rich bars on a terminal, plain rate-limited lines elsewhere.

When stderr is a terminal, each named phase gets a live bar (cleared when the command ends). When it
is not (a CI log, `nohup`, a pipe, a file), bars would print nothing until the end, so each phase
prints plain lines instead: one when it starts, at most one every `interval_s` seconds while it runs
(done/total, elapsed, estimated time left), and one when it reaches its total. A phase still short
of its total when the work ends says where it stopped, so a log never ends silently mid-phase.

Work reports through one callable, `report(phase, done, total)`; `total=None` means the phase has no
known length (benchmark steps): then `step` names what runs now, and `report.end(phase)` ends it.
A step that counts (`repeat 6/21`, `sample 5/64`: the benchmarks' timed repeats) gets the time left from
`RepeatClock`: the mean time of the counts done so far times the ones left (`repeat 6/21, ~7m30s left`).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

Report = Callable[[str, int, int], None]  # (phase, done, total)
PLAIN_INTERVAL_S = 30.0  # plain lines: at most one progress line per phase in this many seconds


COUNTED_STEP = re.compile(r"\b(\d+)/(\d+)\b")  # `repeat 6/21`, `sample 5/64`: the step's count of its total


@dataclass(slots=True)
class RepeatClock:
    """Time left of a phase's counted steps (`repeat i/n`): when each count started, the mean so far, the rest.
    Counts are told apart by their phase, the text before the count and the total."""

    clock: Callable[[], float] = time.monotonic
    started: dict[tuple[str, str, int], dict[int, float]] = field(default_factory=dict)

    def annotate(self, phase: str, step: str) -> str:
        """`step`, with `, ~N left` once one of its counts has finished (`step` as is otherwise)."""
        found = COUNTED_STEP.search(step)
        if found is None:
            return step
        current, total = int(found[1]), int(found[2])
        now = self.clock()
        starts = self.started.setdefault((phase, step[: found.start()], total), {})
        starts.setdefault(current, now)
        first = min(starts)
        if current <= first:
            return step
        per_repeat = (starts[current] - starts[first]) / (current - first)
        left = per_repeat * (total - current + 1) - (now - starts[current])
        return f"{step}, ~{_duration(max(left, 0.0))} left"


class Sink(Protocol):
    def __call__(self, phase: str, done: int, total: int | None, step: str | None = None) -> None: ...

    def end(self, phase: str) -> None:
        """Mark a phase without a total as finished."""


@dataclass(slots=True)
class _Phase:
    started: float
    printed: float
    done: int = 0
    total: int | None = None
    step: str | None = None
    finished: bool = False


@dataclass(slots=True)
class LineProgress:
    """Plain progress lines on `stream`: start, at most one per `interval_s` per phase, and end."""

    stream: TextIO
    interval_s: float = PLAIN_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    phases: dict[str, _Phase] = field(default_factory=dict)

    def __call__(self, phase: str, done: int, total: int | None, step: str | None = None) -> None:
        now = self.clock()
        state = self.phases.get(phase)
        if state is None:
            state = self.phases[phase] = _Phase(started=now, printed=now, done=done, total=total, step=step)
            self._print(phase, state, now, "started")
        state.done, state.total, state.step = done, total, step
        if state.finished:
            return
        if total is not None and done >= total:
            state.finished = True
            self._print(phase, state, now, "done")
        elif now - state.printed >= self.interval_s:
            self._print(phase, state, now, None)

    def end(self, phase: str) -> None:
        state = self.phases.get(phase)
        if state is not None and not state.finished:
            state.finished = True
            self._print(phase, state, self.clock(), "done")

    def close(self, finished: bool = True) -> None:
        """End every open phase with a line: `done` for phases without a total, else where it stopped."""
        now = self.clock()
        for phase, state in self.phases.items():
            if state.finished:
                continue
            state.finished = True
            if state.total is None and finished:
                self._print(phase, state, now, "done")
            else:
                self._print(phase, state, now, "stopped")

    def _print(self, phase: str, state: _Phase, now: float, event: str | None) -> None:
        state.printed = now
        elapsed = now - state.started
        parts = [f"{phase}:"]
        if event is not None:
            parts.append(event)
        if state.total is not None:
            percent = f" ({state.done / state.total:.0%})" if state.total else ""
            parts.append(f"{state.done}/{state.total}{percent}")
        elif state.step and event != "done":
            parts.append(state.step)
        if event != "started":
            parts.append(f"{_duration(elapsed)} elapsed")
        if event is None and state.total and 0 < state.done < state.total:
            parts.append(f"~{_duration(elapsed / state.done * (state.total - state.done))} left")
        print(" ".join(parts), file=self.stream, flush=True)


@dataclass(slots=True)
class BarProgress:
    """Rich live bars, one per phase (a spinner for phases without a total)."""

    progress: Any
    tasks: dict[str, Any] = field(default_factory=dict)

    def __call__(self, phase: str, done: int, total: int | None, step: str | None = None) -> None:
        description = f"{phase}: {step}" if step else phase
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(description, total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total, description=description)

    def end(self, phase: str) -> None:
        if phase in self.tasks:
            self.progress.update(self.tasks[phase], total=1, completed=1, description=phase)


@contextmanager
def phase_progress(
    *, stream: TextIO | None = None, tty: bool | None = None, interval_s: float = PLAIN_INTERVAL_S
) -> Iterator[Sink]:
    """Yields `report(phase, done, total, step=None)`: bars when `stream` (stderr) is a terminal, else lines."""
    stream = stream if stream is not None else sys.stderr
    if tty is None:
        tty = _is_terminal(stream)
    if not tty:
        lines = LineProgress(stream, interval_s=interval_s)
        try:
            yield lines
        except BaseException:
            lines.close(finished=False)
            raise
        lines.close()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=stream), transient=True) as progress:
        yield BarProgress(progress)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


__all__ = [
    "COUNTED_STEP",
    "PLAIN_INTERVAL_S",
    "BarProgress",
    "LineProgress",
    "RepeatClock",
    "Report",
    "Sink",
    "phase_progress",
]
