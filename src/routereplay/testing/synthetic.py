"""Synthetic routes for tests, benchmarks and the bundled example (seeded, vectorised).

Legend: T = tokens, L = layers, K = top-k, E = experts, N = T * L rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from routereplay.enums import Source
from routereplay.errors import ConfigError
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype


def distinct_experts(
    rng: np.random.Generator, num_rows: int, top_k: int, num_experts: int, skew: float = 0.0
) -> np.ndarray:
    """(N, K) ids, each row K distinct experts. `skew` > 0 draws experts from a Zipf-like law
    (p_e ~ 1 / (e + 1) ** skew, over a random permutation per call) like real, imbalanced routers."""
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"need 1 <= top_k ({top_k}) <= num_experts ({num_experts})")
    if 2 * top_k > num_experts:  # dense draws: rejection would loop; take a random K-prefix per row
        keys_NE = rng.random((num_rows, num_experts))
        return np.argsort(keys_NE, axis=1)[:, :top_k].astype(np.int64)
    weights_E = 1.0 / np.arange(1, num_experts + 1) ** skew
    probs_E = (weights_E / weights_E.sum())[rng.permutation(num_experts)]
    experts_NK = rng.choice(num_experts, size=(num_rows, top_k), p=probs_E)
    while True:  # resample rows holding a duplicate until none is left (geometric, few rounds)
        ordered = np.sort(experts_NK, axis=1)
        bad_N = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if not bad_N.any():
            return experts_NK
        experts_NK[bad_N] = rng.choice(num_experts, size=(int(bad_N.sum()), top_k), p=probs_E)


def random_trace(
    rng: np.random.Generator,
    *,
    num_tokens: int,
    num_layers: int,
    top_k: int,
    num_experts: int,
    layers: Sequence[int] | None = None,
    start: int = 0,
    unrouted_fraction: float = 0.0,
    skew: float = 0.0,
    source: Source | str = Source.UNKNOWN,
    policy_version: int | None = None,
) -> RouteTrace:
    """A valid random trace; `unrouted_fraction` of (token, layer) rows are -1."""
    rows = num_tokens * num_layers
    experts_NK = distinct_experts(rng, rows, top_k, num_experts, skew).astype(canonical_dtype(num_experts))
    if unrouted_fraction > 0:
        experts_NK[rng.random(rows) < unrouted_fraction] = -1
    segments = (Segment(start, start + num_tokens, source, policy_version),) if num_tokens else ()
    return RouteTrace(experts_NK.reshape(num_tokens, num_layers, top_k), num_experts, layers, start, segments)


__all__ = ["distinct_experts", "random_trace"]
