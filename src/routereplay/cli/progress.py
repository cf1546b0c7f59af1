"""Progress bars for long CLI work: one bar per named phase, drawn on stderr and cleared after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Report = Callable[[str, int, int], None]  # (phase, done, total)


@contextmanager
def phase_progress() -> Iterator[Report]:
    """Yields `report(phase, done, total)`; each new phase name gets its own bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        tasks: dict[str, Any] = {}

        def report(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total)
            progress.update(tasks[phase], completed=done, total=total)

        yield report


__all__ = ["Report", "phase_progress"]
