"""A sample's routes inside a `RouteStore`: encoded pieces, merged by position, decoded on demand.

The store never holds decoded ids. Each engine call's rows become one `EncodedRoutes` piece (set
codec by default: 5.13 B per (token, layer) row for top-8 of 128 experts, against 16 B as int16);
pieces are disjoint and sorted by position. A call whose rows overlap stored ones (a re-sent prefix,
a resumed rollout) decodes only the pieces it overlaps, merges under the store's policy and replaces
them by one re-encoded piece; a call that extends the sample adds a piece without touching the
others. More than `MAX_PIECES` pieces are coalesced into one, so reads stay cheap.

`assemble(rows)` decodes a sample into the `RouteTrace` the store's `trace()` returns (exactly what
merging every call in order gave when the store held decoded rows); `rows(begin, end)` and the
pieces' `span` cuts read only the rows asked for.

Legend: T = token positions, L = layers, K = top-k.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np

from routereplay.codec.encoded import EncodedRoutes, UnrankerCache
from routereplay.enums import CodecMode
from routereplay.trace.provenance import UNROUTED_SOURCE, MergePolicy, Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype

MAX_PIECES = 64  # pieces per sample before they are coalesced into one


class SampleRoutes:
    """The encoded pieces of one sample's routes (see the module docstring); the store's lock guards it."""

    __slots__ = ("mode", "pieces", "unrankers")

    def __init__(self, mode: CodecMode, unrankers: UnrankerCache | None = None) -> None:
        self.mode = mode
        self.unrankers = unrankers or UnrankerCache()  # the store's: one unranker for every piece
        self.pieces: list[EncodedRoutes] = []

    def _encode(self, trace: RouteTrace) -> EncodedRoutes:
        return EncodedRoutes.encode(trace, mode=self.mode, unrankers=self.unrankers)

    def __bool__(self) -> bool:
        return bool(self.pieces)

    @property
    def stop(self) -> int | None:
        """One past the last routed position held, None when nothing is held."""
        return self.pieces[-1].stop if self.pieces else None

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def add(self, trace: RouteTrace, policy: MergePolicy, encoded: EncodedRoutes | None = None) -> int:
        """Merge `trace` (no token ids, validated) under `policy`; returns the conflicting rows it re-sent.

        `encoded`: `trace` already encoded (`EncodedRoutes.encode`, same mode), kept as the piece when nothing
        overlaps it."""
        starts = [p.start for p in self.pieces]
        lo = bisect.bisect_right([p.stop for p in self.pieces], trace.start)  # first piece ending after start
        hi = bisect.bisect_left(starts, trace.stop)  # pieces from hi on start at or after the trace's stop
        if lo >= hi:
            self.pieces.insert(lo, encoded if encoded is not None else self._encode(trace))
            conflicting = 0
        else:
            old = _joined([p.trace() for p in self.pieces[lo:hi]])
            conflicting = conflicts(old, trace)
            merged = old.merge(trace, policy=policy)
            self.pieces[lo:hi] = [self._encode(merged)]
        if len(self.pieces) > MAX_PIECES:
            self.pieces = [self._encode(_joined([p.trace() for p in self.pieces]))]
        return conflicting

    def assemble(self, rows: int, num_experts: int, layers: tuple[int, ...], top_k: int) -> np.ndarray:
        """(rows, L, K) ids of positions [0, rows), -1 where no piece routes."""
        experts_TLK = np.full((rows, len(layers), top_k), -1, canonical_dtype(num_experts))
        for piece in self.pieces:
            experts_TLK[piece.start : piece.stop] = piece.rows(piece.start, piece.stop)
        return experts_TLK

    def segments(self, rows: int) -> tuple[Segment, ...]:
        """Provenance of positions [0, rows): the pieces' segments, "none" between and after them."""
        runs: list[Segment] = []
        position = 0
        for piece in self.pieces:
            if piece.start > position:
                runs.append(Segment(position, piece.start, UNROUTED_SOURCE))
            runs += piece.segments
            position = piece.stop
        if rows > position:
            runs.append(Segment(position, rows, UNROUTED_SOURCE))
        return coalesced(runs)

    def rows(self, begin: int, end: int, num_experts: int, layers: tuple[int, ...], top_k: int) -> np.ndarray:
        """(end - begin, L, K) ids of positions [begin, end), decoding only the pieces' rows in range."""
        experts_TLK = np.full((end - begin, len(layers), top_k), -1, canonical_dtype(num_experts))
        for piece in self.pieces:
            a, b = max(begin, piece.start), min(end, piece.stop)
            if a < b:
                experts_TLK[a - begin : b - begin] = piece.rows(a, b)
        return experts_TLK

    def joined(self) -> RouteTrace | None:
        """All pieces as one trace over [first start, last stop), or None when nothing is held."""
        return _joined([p.trace() for p in self.pieces]) if self.pieces else None

    def one_blob(self) -> bytes | None:
        """The sample's routes as one codec blob (a single piece's own bytes when there is one)."""
        if not self.pieces:
            return None
        if len(self.pieces) > 1:
            joined = self.joined()
            assert joined is not None
            self.pieces = [self._encode(joined)]
        return self.pieces[0].blob


def coalesced(runs: list[Segment]) -> tuple[Segment, ...]:
    """Adjacent segments of equal source and policy version joined into one."""
    out: list[Segment] = []
    for segment in runs:
        if out and (out[-1].source, out[-1].policy_version) == (segment.source, segment.policy_version):
            out[-1] = replace(out[-1], end=segment.end)
        else:
            out.append(segment)
    return tuple(out)


def _joined(traces: list[RouteTrace]) -> RouteTrace:
    """Disjoint sorted traces as one, -1 rows under "none" in the gaps between them."""
    if len(traces) == 1:
        return traces[0]
    first = traces[0]
    start, stop = first.start, traces[-1].stop
    experts_TLK = np.full((stop - start, first.num_layers, first.top_k), -1, first.experts.dtype)
    runs: list[Segment] = []
    position = start
    for trace in traces:
        experts_TLK[trace.start - start : trace.stop - start] = trace.experts
        if trace.start > position:
            runs.append(Segment(position, trace.start, UNROUTED_SOURCE))
        runs += trace.segments
        position = trace.stop
    return RouteTrace(experts_TLK, first.num_experts, first.layers, start, coalesced(runs))


def conflicts(old: RouteTrace, new: RouteTrace) -> int:
    """Rows routed by both traces whose route sets differ in some layer."""
    begin, end = max(old.start, new.start), min(old.stop, new.stop)
    if begin >= end:
        return 0
    a = np.sort(old.experts[begin - old.start : end - old.start], axis=2)
    b = np.sort(new.experts[begin - new.start : end - new.start], axis=2)
    both_T = (a[..., 0] >= 0).any(axis=1) & (b[..., 0] >= 0).any(axis=1)
    return int(((a != b).any(axis=(1, 2)) & both_T).sum())


__all__ = ["MAX_PIECES", "SampleRoutes", "coalesced", "conflicts"]
