"""Canonical indexer choices for the tests: random rows, with unknown rows and a start offset."""

from __future__ import annotations

import numpy as np


def random_choices(
    num_tokens: int, num_layers: int, index_topk: int, *, start: int = 0, unknown: float = 0.0, seed: int = 0
) -> np.ndarray:
    """A canonical (T, L, I) int32 array: each row picks min(I, p + 1) distinct keys of 0..p, sorted."""
    rng = np.random.default_rng(seed)
    out_TLI = np.full((num_tokens, num_layers, index_topk), -1, np.int32)
    for t in range(num_tokens):
        visible = start + t + 1
        for layer in range(num_layers):
            if rng.random() < unknown:
                continue
            count = min(index_topk, visible)
            out_TLI[t, layer, :count] = np.sort(rng.choice(visible, count, replace=False))
    return out_TLI
