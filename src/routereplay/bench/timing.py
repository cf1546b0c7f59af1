"""Repeated timing with median and spread: the only way figures in BENCHMARKS.md are measured."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call over `repeats` timed calls (after `warmup` untimed ones)."""

    median: float
    low: float
    high: float
    repeats: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rate(self, items: int) -> float:
        """Items per second at the median."""
        return items / self.median if self.median > 0 else float("inf")


def measure(function: Callable[[], Any], repeats: int, warmup: int = 1) -> Timing:
    for _ in range(warmup):
        function()
    seconds: list[float] = []
    for _ in range(repeats):
        begin = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - begin)
    return Timing(statistics.median(seconds), min(seconds), max(seconds), repeats)


def interleave(
    functions: dict[str, Callable[[], Any]], repeats: int, report: Callable[[str], None] | None = None
) -> dict[str, list[float]]:
    """Seconds of each function per repeat, run in turn inside every repeat (after one warm-up each),
    so drift in machine speed hits all of them alike. The order rotates from repeat to repeat, so no
    function always runs right after the same neighbour, and garbage is collected (untimed) before
    every call. Ratios should be taken per repeat."""
    for function in functions.values():
        function()
    names = list(functions)
    seconds: dict[str, list[float]] = {name: [] for name in functions}
    for repeat in range(repeats):
        if report is not None:
            report(f"repeat {repeat + 1}/{repeats}")
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            begin = time.perf_counter()
            functions[name]()
            seconds[name].append(time.perf_counter() - begin)
    return seconds


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-repeat ratios (robust to a slow repeat hitting both sides)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def spread(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{name: {median, low, high}} of interleaved timings."""
    return {name: {"median": statistics.median(v), "low": min(v), "high": max(v)} for name, v in seconds.items()}


def check_device(suite: str, device: str) -> None:
    """ValueError unless `device` is a torch device this machine has (cpu, or an existing CUDA index)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{suite} bench: {device!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ValueError(f"{suite} bench: device {device!r} asked for but this machine has {count} CUDA devices")
    elif parsed.type != "cpu":
        raise ValueError(f"{suite} bench: device type {parsed.type!r} is not supported (use cpu or cuda)")


def synchronizer(device: str) -> Callable[[], None]:
    """What makes a timed call wait for its device work: CUDA runs asynchronously."""
    import torch

    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def target(value: float, goal: float, *, higher_is_better: bool = False, rate: bool = False) -> dict[str, Any]:
    """A benchmark target as recorded in --json: the value, the goal, the direction, met or not, and whether it
    is an absolute rate (rows/s, seconds: it moves with the machine's load) rather than a side-by-side ratio."""
    met = value >= goal if higher_is_better else value <= goal
    direction = ">=" if higher_is_better else "<="
    return {"value": value, "target": goal, "direction": direction, "met": bool(met), "rate": rate}


__all__ = ["Timing", "check_device", "interleave", "measure", "median_ratio", "spread", "synchronizer", "target"]
