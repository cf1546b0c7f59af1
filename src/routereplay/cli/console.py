"""Where the CLI's rich tables and text go: a terminal at its own width, a pipe or file never hard-wrapped.

rich lays a renderable out at the console's width, and a console that is not a terminal is 80 columns
wide: piped into a file or `less`, the demo's summary line broke mid-phrase and a GRPO table row split
over two lines, each padded with trailing spaces. So `show` prints at the terminal's width (at least
`min_width`) on a TTY, and otherwise lays out at `PIPE_WIDTH` columns (no row is that wide), without
colour codes, with each line's trailing spaces removed. Notes under a table are `footnotes(...)`, one
left-aligned line each, never a rich caption (centred under the table and wrapped at its width: ragged).
"""

from __future__ import annotations

import io
import sys
from typing import Any

PIPE_WIDTH = 1000  # columns a piped renderable is laid out in: wider than any table the CLI prints


def show(*renderables: Any, min_width: int = 0) -> None:
    """Print each renderable (a rich Table, or text with rich markup) on stdout, one after the other."""
    from rich.console import Console

    if sys.stdout.isatty():
        console = Console()
        if console.width < min_width:
            console = Console(width=min_width)  # wider than the window: the terminal wraps, rows stay whole
        for renderable in renderables:
            console.print(renderable)
        return
    buffer = io.StringIO()
    piped = Console(file=buffer, width=PIPE_WIDTH, color_system=None, highlight=False, emoji=False)
    for renderable in renderables:
        piped.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))
    sys.stdout.flush()


def footnotes(*lines: str) -> Any:
    """Notes to `show` after a table: each a line of its own, left-aligned, taken literally (no rich markup)."""
    from rich.text import Text

    return Text("\n".join(lines), justify="left")


__all__ = ["PIPE_WIDTH", "footnotes", "show"]
