"""Provenance of a trace's rows, and merging two traces of one sequence by token position.

`Segment` says which engine and policy version routed a token range; a trace's segments tile its
rows in order (`check_segments`). `merge_rows` is the body of `RouteTrace.merge`: each token's row
comes whole from one trace (`MergePolicy` says which wins where both route it), provenance and token
ids follow the rows, positions neither covers get `UNROUTED_SOURCE`.

Legend: T = token positions of the merged span, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from routereplay.enums import Source, StrEnum
from routereplay.errors import ConfigError, TokenMismatchError

UNROUTED_SOURCE = "none"  # provenance of positions no engine call covered (set by `RouteTrace.merge`)


class RoutedRows(Protocol):
    """What merging and validation read of a `RouteTrace` (`trace/route_trace.py`, which builds on both)."""

    @property
    def experts(self) -> np.ndarray: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def segments(self) -> tuple[Segment, ...]: ...
    @property
    def token_ids(self) -> np.ndarray | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def stop(self) -> int: ...


class MergePolicy(StrEnum):
    """Which rows win where two traces of one sequence both route a token (`RouteTrace.merge`)."""

    KEEP = "keep"  # the existing rows: the routes used when the token was sampled
    REPLACE = "replace"  # the newer rows (e.g. a re-prefill after a weight update)


@dataclass(frozen=True, slots=True)
class Segment:
    """Provenance of the token range [begin, end): which engine and policy version routed it."""

    begin: int
    end: int
    source: Source | str = Source.UNKNOWN
    policy_version: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.begin < self.end:
            raise ConfigError(f"Segment [{self.begin}, {self.end}) is empty or negative; need 0 <= begin < end")
        if self.policy_version is not None and self.policy_version < 0:
            raise ConfigError(f"Segment policy_version={self.policy_version} must be >= 0 or None")
        if not isinstance(self.source, Source):
            try:
                object.__setattr__(self, "source", Source(self.source))
            except ValueError:
                pass  # a free-form source name (e.g. a custom engine) is kept as given

    def describe(self) -> str:
        version = "" if self.policy_version is None else f"@v{self.policy_version}"
        return f"{self.source}{version}[{self.begin}:{self.end}]"


def check_segments(segments: tuple[Segment, ...], start: int, stop: int) -> None:
    """Refuse segments that do not tile the rows [start, stop) in order (none at all is allowed)."""
    position = start
    for segment in segments:
        if not isinstance(segment, Segment):
            raise ConfigError(f"segments must hold Segment objects, got {type(segment).__name__}")
        if segment.begin != position:
            raise ConfigError(
                f"provenance segments must tile rows [{start}, {stop}) in order; segment "
                f"{segment.describe()} starts at {segment.begin}, expected {position}"
            )
        position = segment.end
    if segments and position != stop:
        raise ConfigError(f"provenance segments end at {position} but the trace's rows end at {stop}")


def merge_rows(first: RoutedRows, second: RoutedRows) -> tuple[np.ndarray, int, list[Segment], np.ndarray | None]:
    """The rows, start, segments and token ids of `RouteTrace.merge`, `first` winning where both route a token.

    Both traces hold rows and share num_experts, layers and top-k (`merge` checked). Returns the ids over
    [min start, max stop) as (T, L, K), that start, the coalesced provenance segments and the token ids
    (None when neither trace has any).
    """
    start = min(first.start, second.start)
    span = max(first.stop, second.stop) - start
    covered_2T = np.zeros((2, span), bool)
    routed_2T = np.zeros((2, span), bool)
    for i, trace in enumerate((first, second)):
        lo = trace.start - start
        covered_2T[i, lo : lo + trace.num_tokens] = True
        routed_2T[i, lo : lo + trace.num_tokens] = (trace.experts[..., 0] >= 0).any(axis=1)
    use_second_T = covered_2T[1] & (~covered_2T[0] | (routed_2T[1] & ~routed_2T[0]))
    use_first_T = covered_2T[0] & ~use_second_T
    experts = np.full((span, first.num_layers, first.top_k), -1, first.experts.dtype)
    labels_T = np.full(span, -1, np.int64)  # index into `catalogue` of each token's segment, -1 = none
    catalogue = [*first.segments, *second.segments]
    offset = 0
    for trace, use_T in ((first, use_first_T), (second, use_second_T)):
        lo, hi = trace.start - start, trace.stop - start
        local = use_T[lo:hi]
        experts[lo:hi][local] = trace.experts[local]
        lengths = [s.end - s.begin for s in trace.segments]
        labels_T[lo:hi][local] = np.repeat(np.arange(len(lengths)) + offset, lengths)[local]
        offset += len(lengths)
    bounds = [0, *(np.flatnonzero(np.diff(labels_T)) + 1).tolist(), span]
    segments: list[Segment] = []
    for begin, end in itertools.pairwise(bounds):  # one step per run, not per token
        label = int(labels_T[begin])
        source, version = (
            (UNROUTED_SOURCE, None) if label < 0 else (catalogue[label].source, catalogue[label].policy_version)
        )
        if segments and (segments[-1].source, segments[-1].policy_version) == (source, version):
            segments[-1] = replace(segments[-1], end=start + end)
        else:
            segments.append(Segment(start + begin, start + end, source, version))
    token_ids = _merged_token_ids(first, second, start, span, use_first_T, use_second_T)
    return experts, start, segments, token_ids


def _merged_token_ids(
    first: RoutedRows, second: RoutedRows, start: int, span: int, use_first_T: np.ndarray, use_second_T: np.ndarray
) -> np.ndarray | None:
    """Token ids of a merge: each position's id from the trace whose row won, -1 where unknown."""
    if first.token_ids is None and second.token_ids is None:
        return None
    known_2T = np.full((2, span), -1, np.int64)
    for i, trace in enumerate((first, second)):
        if trace.token_ids is not None:
            known_2T[i, trace.start - start : trace.stop - start] = trace.token_ids
    conflict_T = (known_2T[0] >= 0) & (known_2T[1] >= 0) & (known_2T[0] != known_2T[1])
    if conflict_T.any():
        position = start + int(np.flatnonzero(conflict_T)[0])
        a, b = known_2T[:, position - start].tolist()
        raise TokenMismatchError(
            f"cannot merge: token {position} is id {a} in one trace and {b} in the other ({int(conflict_T.sum())} "
            "such positions); they are not routes of the same token sequence (a shifted or re-tokenised sequence?)"
        )
    merged_T = np.where(use_second_T, known_2T[1], np.where(use_first_T, known_2T[0], -1))
    return np.where(merged_T >= 0, merged_T, np.maximum(known_2T[0], known_2T[1]))
