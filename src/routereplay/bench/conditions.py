"""What a benchmark suite ran under: torch's thread count, the machine's load, how long it took.

Every suite of `routereplay bench` runs through `run_suite`, which
- applies the thread policy of the CPU commands (`routereplay.threads.ThreadPolicy`: `--threads N`, else
  OMP_NUM_THREADS / MKL_NUM_THREADS, else 1) for the suite and restores the caller's count afterwards, so a
  suite never runs on torch's default of one thread per core by accident (issue 38 item 11: `bench replay` took
  ~100 s a repeat on torch's 2 threads under load, 25 s on one);
- samples the load before and after: the load average (1, 5, 15 min) and, where `/proc` exists, the CPU
  time the whole machine spent busy (`/proc/stat`) minus that of this process's group (this process and
  every process it started: gloo ranks behind a forkserver, the load suite's busy processes, children
  already reaped), which over the wall time is the mean number of cores *other* processes kept busy
  during the suite (`other_cores`);
- records both in the suite's record as `conditions`, and notes `machine_busy` on a missed absolute-rate
  target (rows/s, seconds; `target(..., rate=True)`) when other processes kept at least `BUSY_OTHER_CORES`
  cores busy (or, without /proc/stat, the load average exceeded the cores): such a miss says more about the
  machine than about the code. Ratios measured side by side are never excused.

`SuiteConditions.header()` is the line printed above each suite's tables and in BENCHMARKS.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from routereplay.threads import ThreadChoice, ThreadPolicy, ThreadSource, available_cores

BUSY_OTHER_CORES = 0.5  # other processes kept at least this many cores busy on average: the machine was busy
PROC = "/proc"
PROC_STAT = "/proc/stat"
LoadAverage = tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One reading of the machine's load: load average, the whole machine's busy CPU seconds since boot
    (None without /proc/stat), this process group's CPU seconds (`group_cpu_seconds`), and the clock."""

    load_average: LoadAverage | None
    machine_busy_s: float | None
    own_cpu_s: float
    clock_s: float


def machine_busy_seconds(path: str = PROC_STAT) -> float | None:
    """CPU seconds all cores spent outside idle and iowait since boot (`/proc/stat`'s first line), or None."""
    try:
        with open(path, encoding="ascii") as stream:
            fields = stream.readline().split()
        ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if fields[:1] != ["cpu"] or len(ticks) < 8:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(proc: str = PROC) -> float | None:
    """CPU seconds of every process in this process's group (`/proc/<pid>/stat`: utime, stime and the reaped
    children's cutime, cstime), or None without /proc."""
    group, ticks = os.getpgrp(), 0
    try:
        entries = [entry.name for entry in os.scandir(proc) if entry.name.isdigit()]
    except OSError:
        return None
    for pid in entries:
        try:
            with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as stream:
                fields = stream.read().rsplit(")", 1)[1].split()  # after `pid (comm)`: state is field 3
        except (OSError, IndexError):
            continue  # ended meanwhile
        if len(fields) > 14 and fields[2] == str(group):  # pgrp (field 5); utime..cstime are fields 14-17
            ticks += sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def sample_load() -> LoadSample:
    own = group_cpu_seconds()
    if own is None:  # this process and its reaped children only
        times = os.times()
        own = times.user + times.system + times.children_user + times.children_system
    average: LoadAverage | None = None
    if hasattr(os, "getloadavg"):
        one, five, fifteen = os.getloadavg()
        average = (round(one, 2), round(five, 2), round(fifteen, 2))
    return LoadSample(average, machine_busy_seconds(), own, time.monotonic())


@dataclass(frozen=True, slots=True, kw_only=True)
class SuiteConditions:
    """The thread choice, the cores, the load at start and end, other processes' mean busy cores, wall seconds."""

    threads: ThreadChoice
    cores: int
    load_start: LoadAverage | None
    load_end: LoadAverage | None
    other_cores: float | None
    seconds: float

    @classmethod
    def between(cls, threads: ThreadChoice, start: LoadSample, end: LoadSample, cores: int) -> SuiteConditions:
        wall = max(end.clock_s - start.clock_s, 1e-9)
        other = None
        if start.machine_busy_s is not None and end.machine_busy_s is not None:
            others_s = (end.machine_busy_s - start.machine_busy_s) - (end.own_cpu_s - start.own_cpu_s)
            other = round(max(others_s, 0.0) / wall, 2)
        return cls(
            threads=threads,
            cores=cores,
            load_start=start.load_average,
            load_end=end.load_average,
            other_cores=other,
            seconds=round(wall, 1),
        )

    @property
    def busy(self) -> bool:
        """Other processes kept `BUSY_OTHER_CORES` busy; without /proc/stat, a load average above the cores."""
        if self.other_cores is not None:
            return self.other_cores >= BUSY_OTHER_CORES
        loads = [load[0] for load in (self.load_start, self.load_end) if load is not None]
        return bool(loads) and max(loads) > self.cores

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads.to_dict(),
            "cores": self.cores,
            "load_average_start": list(self.load_start) if self.load_start is not None else None,
            "load_average_end": list(self.load_end) if self.load_end is not None else None,
            "other_cores": self.other_cores,
            "machine_busy": self.busy,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> SuiteConditions:
        threads = record["threads"]
        start, end = record.get("load_average_start"), record.get("load_average_end")
        return cls(
            threads=ThreadChoice(threads["threads"], ThreadSource(threads["source"]), threads["reason"]),
            cores=record["cores"],
            load_start=tuple(start) if start is not None else None,
            load_end=tuple(end) if end is not None else None,
            other_cores=record.get("other_cores"),
            seconds=record["seconds"],
        )

    def header(self) -> str:
        """One line: "Ran with 1 torch intra-op thread (default); load average (1, 5, 15 min) ... at start, ... at
        end; other processes kept 0.03 of 2 cores busy (quiet); 41 s." """
        count = self.threads.threads
        threads = f"{count} torch intra-op thread{'s' if count != 1 else ''} ({self.threads.source})"
        if self.load_start is None or self.load_end is None:
            load = "load average not available"
        else:
            load = f"load average (1, 5, 15 min) {_triple(self.load_start)} at start, {_triple(self.load_end)} at end"
        verdict = "machine busy" if self.busy else "quiet"
        if self.other_cores is not None:
            load += f"; other processes kept {self.other_cores:.2f} of {self.cores} cores busy ({verdict})"
        else:
            load += f" on {self.cores} cores ({verdict})"
        return f"Ran with {threads}; {load}; {_duration(self.seconds)}."


def run_suite(
    module: ModuleType, config: Any, report: Callable[[str], None], threads: int | None = None
) -> dict[str, Any]:
    """`module.run(config, report)` under the thread policy, its record with `conditions` added, and
    `machine_busy` noted on every missed rate target when the machine was busy."""
    start = sample_load()
    with ThreadPolicy(threads=threads).applied() as choice:
        result: dict[str, Any] = module.run(config, report)
    conditions = SuiteConditions.between(choice, start, sample_load(), available_cores())
    result["conditions"] = conditions.to_dict()
    if conditions.busy:
        for goal in result.get("targets", {}).values():
            if goal.get("rate") and goal.get("met") is False:
                goal["machine_busy"] = True
    return result


def _triple(load: LoadAverage) -> str:
    return "/".join(f"{value:.2f}" for value in load)


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


__all__ = [
    "BUSY_OTHER_CORES",
    "LoadSample",
    "SuiteConditions",
    "group_cpu_seconds",
    "machine_busy_seconds",
    "run_suite",
    "sample_load",
]
