"""What `routereplay inspect` reports about a trace: shape, coverage, expert load, verdict.

Legend: T = rows, L = layers, K = top-k, E = experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from routereplay.errors import RouteReplayError
from routereplay.trace.route_trace import RouteTrace


@dataclass(frozen=True, slots=True)
class LayerLoad:
    """Expert load of one layer over its routed rows."""

    layer: int
    routed_rows: int
    max_over_mean: float  # load of the busiest expert / mean load (1.0 = perfectly balanced)
    unused_experts: int
    busiest_expert: int
    entropy: float  # normalised entropy of the load distribution, in [0, 1]


@dataclass(frozen=True, slots=True)
class TraceSummary:
    num_tokens: int
    num_layers: int
    top_k: int
    num_experts: int
    dtype: str
    start: int
    stop: int
    layers: list[int]
    routed_rows: int  # (token, layer) rows with ids
    unrouted_rows: int  # (token, layer) rows of -1
    fully_routed_tokens: int
    coverage: float
    segments: list[dict[str, Any]]
    layer_load: list[LayerLoad]
    valid: bool
    error_type: str | None
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(trace: RouteTrace, sequence: str | None = None) -> TraceSummary:
    """Summarise `trace` and run its validation; a failed check is reported, not raised."""
    try:
        trace.validate(sequence)
        error_type = error = None
    except RouteReplayError as exc:
        error_type, error = type(exc).__name__, str(exc)
    mask_TL = trace.routed_mask
    load_LE = trace.expert_load()
    layer_load = [_layer_load(layer, load_LE[i], int(mask_TL[:, i].sum())) for i, layer in enumerate(trace.layers)]
    routed = int(mask_TL.sum())
    return TraceSummary(
        num_tokens=trace.num_tokens,
        num_layers=trace.num_layers,
        top_k=trace.top_k,
        num_experts=trace.num_experts,
        dtype=str(trace.experts.dtype),
        start=trace.start,
        stop=trace.stop,
        layers=list(trace.layers),
        routed_rows=routed,
        unrouted_rows=int(mask_TL.size - routed),
        fully_routed_tokens=trace.num_routed,
        coverage=trace.coverage,
        segments=[
            {"begin": s.begin, "end": s.end, "source": str(s.source), "policy_version": s.policy_version}
            for s in trace.segments
        ],
        layer_load=layer_load,
        valid=error is None,
        error_type=error_type,
        error=error,
    )


def _layer_load(layer: int, load_E: np.ndarray, routed_rows: int) -> LayerLoad:
    total = int(load_E.sum())
    if total == 0:
        return LayerLoad(layer, routed_rows, 0.0, int(load_E.size), -1, 0.0)
    probs_E = load_E[load_E > 0] / total
    entropy = float(-(probs_E * np.log(probs_E)).sum() / np.log(load_E.size)) if load_E.size > 1 else 1.0
    return LayerLoad(
        layer=layer,
        routed_rows=routed_rows,
        max_over_mean=float(load_E.max() / (total / load_E.size)),
        unused_experts=int((load_E == 0).sum()),
        busiest_expert=int(load_E.argmax()),
        entropy=round(entropy, 6) + 0.0,  # + 0.0 turns -0.0 into 0.0
    )


def compact_ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts: list[str] = []
    index = 0
    while index < len(numbers):
        end = index
        while end + 1 < len(numbers) and numbers[end + 1] == numbers[end] + 1:
            end += 1
        parts.append(str(numbers[index]) if end == index else f"{numbers[index]}-{numbers[end]}")
        index = end + 1
    return ",".join(parts)


__all__ = ["LayerLoad", "TraceSummary", "compact_ranges", "summarize"]
