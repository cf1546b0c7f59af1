"""The `--threads N` option of the commands that run torch on the CPU (demo, train, every bench suite).

It feeds `routereplay.threads.ThreadPolicy`: N intra-op torch threads, or, when left out,
OMP_NUM_THREADS / MKL_NUM_THREADS if set, else 1 (the tiny demo model gains nothing from more,
and spinning threads collapse when other processes share the cores).
"""

from __future__ import annotations

import argparse
from typing import Any

MAX_THREADS = 4096  # far above any machine's core count; larger is a typo


def thread_count(text: str) -> int:
    """An argparse type: an integer in [1, MAX_THREADS]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_THREADS}], got {text!r}")
    return value


def add_threads_argument(parser: Any) -> None:
    """Add `--threads N` to `parser` (an ArgumentParser or one of its argument groups)."""
    parser.add_argument(
        "--threads",
        type=thread_count,
        metavar="N",
        help="torch intra-op threads (default: OMP_NUM_THREADS if set, else 1: the tiny model gains nothing from "
        "more threads, and spinning threads slow to a crawl when other processes share the cores)",
    )


__all__ = ["MAX_THREADS", "add_threads_argument", "thread_count"]
