"""The fields every benchmark config starts with, and the size checks the suites share.

Each suite's `*BenchConfig` derives from `BenchConfig` (timed repeats, the seed of its synthetic data)
or from `RoutedBenchConfig`, which adds the routing of the suite's synthetic routes (by default
Qwen3-30B-A3B's: 48 MoE layers, top-8 of 128 experts), or from `SampledBenchConfig`, which adds a
batch of samples of drawn lengths. A suite's own fields follow these, in the
same order, in the `config` object of its JSON record; a suite redeclares a field only to change its
default. The checks raise `ValueError` naming the suite, the field and its value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    repeats: int = 5
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutedBenchConfig(BenchConfig):
    layers: int = 48
    top_k: int = 8
    experts: int = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledBenchConfig(RoutedBenchConfig):
    """A batch of `samples` samples, each `min_len` to `seq` tokens long (`bench.store.source_of`)."""

    samples: int = 64
    seq: int = 8192
    min_len: int = 1024


def require_positive(config: BenchConfig, suite: str, *names: str) -> None:
    """Refuse a size below 1 (or not an int) among `names`, naming the first one."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{suite} bench: {name}={value!r} must be an int >= 1")


def require_routing(config: RoutedBenchConfig, suite: str) -> None:
    """Refuse a routing no MoE layer has: a size below 1, or more picks than experts."""
    require_positive(config, suite, "repeats", "layers", "top_k", "experts")
    if config.top_k > config.experts:
        raise ValueError(f"{suite} bench: top_k {config.top_k} exceeds experts {config.experts}")


__all__ = ["BenchConfig", "RoutedBenchConfig", "SampledBenchConfig", "require_positive", "require_routing"]
