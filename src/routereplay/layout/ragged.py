"""Ragged routes: every sequence's rows back to back, with `cu_seqlens` marking where each begins.

This is the layout the store holds and the hub every other layout converts through: padded
batches (`padding.py`), packed THD micro-batches (`packing.py`) and parallel shards
(`parallel.py`) are all index maps to and from it.

Legend: B = sequences, N = tokens of all sequences, L = layers, K = top-k.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic

import numpy as np
import torch

from routereplay.enums import Source
from routereplay.errors import BatchShapeError, ConfigError, LayerCountError, TopKMismatchError
from routereplay.layout.array import Array, as_tensor, index_tensor, like, select
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype


@dataclass(frozen=True, slots=True)
class Ragged(Generic[Array]):
    """`values` (N, ...) holds sequence b in rows `cu_seqlens[b]:cu_seqlens[b + 1]`."""

    values: Array
    cu_seqlens: torch.Tensor

    def __post_init__(self) -> None:
        cu = index_tensor(self.cu_seqlens, "cu_seqlens")
        object.__setattr__(self, "cu_seqlens", cu)
        if cu.numel() == 0 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ConfigError(f"cu_seqlens must start at 0 and never decrease, got {cu[:8].tolist()}...")
        if int(cu[-1]) != self.values.shape[0]:
            raise BatchShapeError(
                f"cu_seqlens ends at {int(cu[-1])} but values have {self.values.shape[0]} rows; "
                "they must describe the same tokens"
            )

    @classmethod
    def from_lengths(cls, values: Array, lengths: Sequence[int] | np.ndarray | torch.Tensor) -> Ragged[Array]:
        return cls(values, cu_seqlens_of(lengths))

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def sequence(self, b: int) -> Array:
        """Rows of sequence `b` (a view)."""
        begin, end = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
        return self.values[begin:end]

    def select(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Ragged[Array]:
        """The sequences `indices`, in that order (a micro-batch of a larger batch): one gather."""
        order_B = check_order(indices, self.num_sequences, allow_subset=True)
        lengths_B = self.lengths[order_B]
        source_N = token_starts(self.cu_seqlens[:-1][order_B], lengths_B)
        values = like(select(as_tensor(self.values), source_N), self.values)
        return Ragged(values, cu_seqlens_of(lengths_B))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        return bool(torch.equal(self.cu_seqlens, other.cu_seqlens)) and bool(
            torch.equal(as_tensor(self.values), as_tensor(other.values))
        )

    __hash__ = None  # type: ignore[assignment]


def cu_seqlens_of(lengths: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """(B + 1,) int64 offsets of sequences of `lengths`, starting at 0."""
    lengths_B = index_tensor(lengths, "lengths")
    if bool((lengths_B < 0).any()):
        raise ConfigError(f"sequence lengths must be >= 0, got {lengths_B.min().item()}")
    return torch.cat([lengths_B.new_zeros(1), torch.cumsum(lengths_B, 0)])


def sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N,) the sequence each token belongs to."""
    lengths_B = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths_B.numel()), lengths_B)


def positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N,) each token's position inside its own sequence (0 at every sequence start)."""
    lengths_B = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.arange(int(cu_seqlens[-1])) - torch.repeat_interleave(cu_seqlens[:-1], lengths_B)


def token_starts(starts_B: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """(N,) `starts_B[b] + i` for i < lengths_B[b], sequence after sequence: rows to gather."""
    cu = cu_seqlens_of(lengths_B)
    return torch.repeat_interleave(starts_B - cu[:-1], lengths_B) + torch.arange(int(cu[-1]))


def check_order(
    indices: Sequence[int] | np.ndarray | torch.Tensor, num_sequences: int, *, allow_subset: bool
) -> torch.Tensor:
    """`indices` as int64 if they name distinct sequences in range (all of them unless `allow_subset`)."""
    order_B = index_tensor(indices, "order")
    if order_B.numel() and (int(order_B.min()) < 0 or int(order_B.max()) >= num_sequences):
        raise ConfigError(
            f"order names sequence {int(order_B.max()) if int(order_B.max()) >= num_sequences else int(order_B.min())}"
            f" but there are {num_sequences} sequences (valid: 0..{num_sequences - 1})"
        )
    if torch.unique(order_B).numel() != order_B.numel():
        raise ConfigError("order names a sequence twice; each sequence is packed once")
    if not allow_subset and order_B.numel() != num_sequences:
        raise ConfigError(f"order has {order_B.numel()} entries for {num_sequences} sequences; give a permutation")
    return order_B


def from_traces(traces: Sequence[RouteTrace], layers: Sequence[int] | None = None) -> Ragged[np.ndarray]:
    """Traces as one ragged array of all their tokens: a trace that starts at token s gets s rows of -1
    first, so row i of sequence b is always token i (the engine's missing rows stay visibly missing)."""
    if not traces:
        raise ConfigError("from_traces needs at least one trace")
    # columns: (layer, router slot); `layers` selects every slot of each layer
    columns = traces[0].columns if layers is None else traces[0].select_layers(tuple(layers)).columns
    top_k = traces[0].top_k
    num_experts = max(t.num_experts for t in traces)
    lengths = [t.stop for t in traces]
    values_NLK = np.full((sum(lengths), len(columns), top_k), -1, dtype=canonical_dtype(num_experts))
    offset = 0
    for b, trace in enumerate(traces):  # one block copy per sequence: the data is already per sequence
        if trace.columns != columns:
            if not set(columns) <= set(trace.columns):
                raise LayerCountError(
                    f"sequence {b}: trace has layers {list(trace.layers)[:8]}..., not all of "
                    f"{[c[0] for c in columns][:8]}..."
                )
            trace = trace.select_columns(columns)
        if trace.top_k != top_k:
            raise TopKMismatchError(f"sequence {b}: top-k {trace.top_k}, sequence 0 has {top_k}")
        values_NLK[offset + trace.start : offset + trace.stop] = trace.experts
        offset += trace.stop
    return Ragged(values_NLK, cu_seqlens_of(lengths))


def to_traces(
    ragged: Ragged[Any],
    *,
    num_experts: int,
    layers: Sequence[int],
    source: Source | str = Source.TRAINER,
    policy_version: int | None = None,
    slots: Sequence[str] | None = None,
) -> list[RouteTrace]:
    """One trace per sequence (views of a numpy copy of the values)."""
    values_NLK = np.asarray(as_tensor(ragged.values).detach().cpu().numpy())
    if values_NLK.ndim != 3 or values_NLK.shape[1] != len(layers):
        raise LayerCountError(f"ragged values have shape {values_NLK.shape}; expected (N, {len(layers)}, K)")
    cu = ragged.cu_seqlens.tolist()
    traces = []
    for begin, end in itertools.pairwise(cu):
        segments = (Segment(0, end - begin, source, policy_version),) if end > begin else ()
        traces.append(RouteTrace(values_NLK[begin:end], num_experts, tuple(layers), 0, segments, slots=slots))
    return traces
