"""How many intra-op threads torch uses on routereplay's CPU paths: chosen on purpose, never by accident.

The demo model, the GRPO steps and the built-in engine multiply tiny matrices (hidden size 64):
intra-op threads gain nothing there. When other processes share the cores, OpenMP's workers spin
at every barrier while they wait for a descheduled sibling, and throughput collapses (issue 11
item 25: 20 supervised steps of the demo model took 250 s with torch's default 2 threads and 20 s
with 1 thread, two other processes running on the 2 cores). So these paths run with
`DEFAULT_THREADS` (1) intra-op thread unless the user chose a count:

1. an explicit count (`threads=` of the library calls, `--threads N` on the command line) wins;
2. else `OMP_NUM_THREADS` or `MKL_NUM_THREADS` set in the environment: torch honoured it when it
   started, and the current count is kept as it is;
3. else `DEFAULT_THREADS`.

A `torch.set_num_threads` call made earlier by the caller cannot be told apart from torch's own
default, so a caller who wants more threads passes `threads=`. `ThreadPolicy.applied()` sets the
count for one block and restores the caller's count afterwards: a library call leaves torch as it
found it. `ThreadPolicy.per_worker` is the share of the cores each of several parallel processes
(pytest-xdist workers) should use so that together they do not oversubscribe the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from routereplay.enums import StrEnum
from routereplay.errors import ConfigError

DEFAULT_THREADS = 1  # intra-op threads for the tiny-model CPU paths when the user chose none
THREAD_ENVIRONMENT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user's choice, as torch reads it


class ThreadSource(StrEnum):
    """Where a thread count came from."""

    EXPLICIT = "explicit"  # threads= / --threads
    ENVIRONMENT = "environment"  # OMP_NUM_THREADS / MKL_NUM_THREADS: torch's current count is kept
    DEFAULT = "default"  # DEFAULT_THREADS


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The intra-op thread count a policy picked, and why (recorded in benchmark records)."""

    threads: int
    source: ThreadSource
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"threads": self.threads, "source": self.source.value, "reason": self.reason}


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else the CPU count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadPolicy:
    """The rule above, as an object: `threads=None` means "the user's environment, else the default"."""

    threads: int | None = None
    default_threads: int = DEFAULT_THREADS
    environment_variables: tuple[str, ...] = THREAD_ENVIRONMENT_VARIABLES

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ConfigError(
                f"threads={self.threads!r}: the intra-op thread count must be an integer >= 1 "
                "(or None to keep OMP_NUM_THREADS / the default of 1)"
            )
        if self.default_threads < 1:
            raise ConfigError(f"default_threads={self.default_threads!r} must be >= 1")

    def user_environment(self, environ: Mapping[str, str] | None = None) -> str | None:
        """`NAME=value` of the first thread variable the user set, or None."""
        values = os.environ if environ is None else environ
        for name in self.environment_variables:
            value = values.get(name, "").strip()
            if value:
                return f"{name}={value}"
        return None

    def choose(self, current: int, environ: Mapping[str, str] | None = None) -> ThreadChoice:
        """The count to run with, given torch's `current` count and the environment."""
        if self.threads is not None:
            return ThreadChoice(self.threads, ThreadSource.EXPLICIT, f"threads={self.threads}")
        chosen = self.user_environment(environ)
        if chosen is not None:
            return ThreadChoice(current, ThreadSource.ENVIRONMENT, f"{chosen} (kept torch's {current})")
        return ThreadChoice(
            self.default_threads,
            ThreadSource.DEFAULT,
            f"default for tiny models ({self.default_threads}); set --threads N or OMP_NUM_THREADS to change it",
        )

    def apply(self) -> ThreadChoice:
        """Set torch's intra-op thread count for the rest of the process (the CLI's choice)."""
        import torch

        choice = self.choose(torch.get_num_threads())
        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
        return choice

    @contextmanager
    def applied(self) -> Iterator[ThreadChoice]:
        """Run a block with the chosen count, then restore the caller's count."""
        import torch

        previous = torch.get_num_threads()
        choice = self.apply()
        try:
            yield choice
        finally:
            if torch.get_num_threads() != previous:
                torch.set_num_threads(previous)

    @staticmethod
    def per_worker(workers: int, cores: int | None = None) -> int:
        """Intra-op threads for each of `workers` parallel processes sharing `cores` cores."""
        total = available_cores() if cores is None else cores
        return max(1, total // max(1, workers))


__all__ = [
    "DEFAULT_THREADS",
    "THREAD_ENVIRONMENT_VARIABLES",
    "ThreadChoice",
    "ThreadPolicy",
    "ThreadSource",
    "available_cores",
]
