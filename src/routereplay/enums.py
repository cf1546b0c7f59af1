"""Enumerations shared across routereplay (string-valued, so they print and serialise as text)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised only on Python 3.10

    class StrEnum(str, Enum):
        """Backport of `enum.StrEnum` (Python 3.11) for Python 3.10."""

        def __str__(self) -> str:
            return str(self.value)


class Source(StrEnum):
    """Which engine produced a range of routes (provenance of a trace segment)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    MEGATRON = "megatron"
    HF = "hf"  # the built-in HF transformers engine
    TRAINER = "trainer"  # recorded by the training engine itself (R2)
    UNKNOWN = "unknown"


class CodecMode(StrEnum):
    """What the compact codec preserves: the expert SET of each row, or the exact ORDER too."""

    SET = "set"
    ORDERED = "ordered"


class ReplayMode(StrEnum):
    """What a `Replayer` does to its routers right now."""

    OFF = "off"  # routers run untouched
    RECORD = "record"  # routers run naturally; their top-k choice is kept
    REPLAY = "replay"  # the top-k choice is forced from given routes; weights stay the router's own


class ReplayOrder(StrEnum):
    """Which top-k order a replay forces into the model's combine (it changes bf16 accumulation)."""

    SET = "set"  # the expert SET is forced; its order is the one the live router gives that set
    ENGINE = "engine"  # the routes' own order (ordered codec, engines returning unsorted top-k)


__all__ = ["CodecMode", "ReplayMode", "ReplayOrder", "Source", "StrEnum"]
