"""Hypothesis strategies shared by the layout tests: ragged routes in numpy or torch."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from routereplay.layout import Ragged


@st.composite
def raggeds(draw: st.DrawFn, max_sequences: int = 6, max_length: int = 24) -> Ragged:
    """Ragged (N, L, K) routes with distinct values per row, as numpy or torch at random."""
    lengths = draw(st.lists(st.integers(0, max_length), min_size=1, max_size=max_sequences))
    layers = draw(st.integers(1, 3))
    top_k = draw(st.integers(1, 2))
    total = sum(lengths)
    values_NLK = np.arange(total * layers * top_k, dtype=np.int32).reshape(total, layers, top_k)
    if draw(st.booleans()):
        return Ragged.from_lengths(torch.from_numpy(values_NLK), lengths)
    return Ragged.from_lengths(values_NLK, lengths)


def same_type(a: object, b: object) -> bool:
    return isinstance(a, np.ndarray) == isinstance(b, np.ndarray)
