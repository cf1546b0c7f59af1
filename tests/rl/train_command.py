"""The short `routereplay train` command line the rl CLI tests extend: 2 steps of 4 prompts x 2, on a
demo model trained for 25 steps."""

from __future__ import annotations


def short_train(*extra: str) -> list[str]:
    """`routereplay train`'s arguments for a two-step run, then `extra`."""
    return [
        "train",
        "--steps",
        "2",
        "--train-steps",
        "25",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--mini-steps",
        "2",
        *extra,
    ]
