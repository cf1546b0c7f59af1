"""`RouteTrace`: the routes of one sequence, with provenance and validation.

Legend: T = rows (tokens fed as input), L = MoE layers, K = top-k, E = experts.
`experts_TLK[t, l]` is the set of K expert ids that the router of global layer `layers[l]` chose
when token `start + t` was the input position (in the router's top-k order when `ordered`: a set
codec or `sorted_rows` keeps the set only, and `ordered` is then False). A layer holding two
routers (JetMoE's attention and MLP experts, Ernie-4.5-VL's text and vision routers) has a column
per router: column `l` is `(layers[l], slots[l])`, the slot named by the router's path inside its
layer ("mlp.router"); `slots` is None when every layer has one router (engines' traces).
`-1` everywhere in that (t, l) row means "no route"
(never routed, padding, a cached prefix the engine did not report). Engines return
`num_tokens - 1` rows: the last sampled token is never fed back. `token_ids_T[t]` (optional) is the
token id at position `start + t`, the input whose routes row `t` holds (-1 = id unknown); replay
checks it against the batch it is applied to.

`RouteTrace` itself holds the rows and their transforms; what the rows may hold (coercion and the
validation catalogue) is `routereplay.trace.validation`, provenance segments and merging
`routereplay.trace.provenance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.enums import Source
from routereplay.errors import ConfigError, LayerCountError, TopKMismatchError
from routereplay.indexer.trace import IndexerTrace, check_indexer, merged_indexer
from routereplay.trace.provenance import MergePolicy, Segment, check_segments, merge_rows
from routereplay.trace.validation import (
    as_route_array,
    as_token_ids,
    as_weights,
    check_slots,
    validate_routes,
)

if TYPE_CHECKING:
    import torch


class RouteTrace:
    """Routes of one sequence: `experts` (T, L, K) signed ints with -1 = no route.

    Construct with `RouteTrace(experts=..., num_experts=..., layers=...)`; `layers` defaults to
    0..L-1, `start` (token position of row 0) to 0, and `segments` to one segment of unknown
    provenance covering every row. `token_ids` (optional, one id per row, -1 = unknown) names the
    tokens the rows route, so replay can refuse a batch whose tokens differ (a shifted BOS).
    Construction checks dtype and shape cheaply; call `validate()`
    for the full content checks (ids in range, no duplicates, no partial rows, no all-zero layer).
    """

    __slots__ = (
        "experts",
        "indexer",
        "layers",
        "num_experts",
        "ordered",
        "segments",
        "slots",
        "start",
        "token_ids",
        "weights",
    )

    experts: np.ndarray
    num_experts: int
    layers: tuple[int, ...]
    start: int
    segments: tuple[Segment, ...]
    token_ids: np.ndarray | None  # (T,) int64: token id at position start + t, -1 = unknown; None = not known
    slots: tuple[str, ...] | None  # router slot of each column within its layer; None = one router per layer
    ordered: bool  # rows keep the router's top-k order (False: only the set is known, e.g. a set codec)
    indexer: IndexerTrace | None  # DSA models: the sparse-attention indexer's key choices of the same rows
    weights: np.ndarray | None  # (T, L, K) float32: the combine weight of each expert of `experts` (0 on -1 rows)

    def __init__(
        self,
        experts: Any,
        num_experts: int,
        layers: Sequence[int] | None = None,
        start: int = 0,
        segments: Sequence[Segment] = (),
        token_ids: Any = None,
        *,
        slots: Sequence[str] | None = None,
        ordered: bool = True,
        indexer: IndexerTrace | None = None,
        weights: Any = None,
    ) -> None:
        if not isinstance(num_experts, (int, np.integer)) or isinstance(num_experts, bool) or num_experts < 1:
            raise ConfigError(f"num_experts={num_experts!r} must be a positive int")
        self.num_experts = int(num_experts)
        self.experts = as_route_array(experts, self.num_experts)
        num_rows, num_layers, _ = self.experts.shape
        self.layers = tuple(range(num_layers)) if layers is None else tuple(int(x) for x in layers)
        if len(self.layers) != num_layers:
            raise LayerCountError(
                f"layers has {len(self.layers)} entries but experts has {num_layers} layers (shape "
                f"{self.experts.shape}); pass one global layer number per layer of the array"
            )
        self.slots = check_slots(slots, self.layers)
        self.ordered = bool(ordered)
        if not isinstance(start, (int, np.integer)) or start < 0:
            raise ConfigError(f"start={start!r} must be a non-negative int (token position of row 0)")
        self.start = int(start)
        if not segments and num_rows:
            segments = (Segment(self.start, self.start + num_rows),)
        self.segments = tuple(segments)
        check_segments(self.segments, self.start, self.start + num_rows)
        self.token_ids = None if token_ids is None else as_token_ids(token_ids, num_rows)
        self.indexer = check_indexer(indexer, self.start, num_rows)
        self.weights = None if weights is None else as_weights(weights, self.experts)

    # --- shape ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Number of rows T (token positions covered, from `start`)."""
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def stop(self) -> int:
        """Token position one past the last row."""
        return self.start + self.num_tokens

    @property
    def routed_mask(self) -> np.ndarray:
        """(T, L) bool: True where the (token, layer) row holds real ids (not -1)."""
        return np.asarray(self.experts[..., 0] >= 0)

    @property
    def num_routed(self) -> int:
        """Rows (tokens) with a route in every layer, i.e. without any -1."""
        return int(self.routed_mask.all(axis=1).sum())

    @property
    def coverage(self) -> float:
        """Fraction of (token, layer) rows that are routed; 1.0 for an empty trace."""
        mask = self.routed_mask
        return float(mask.mean()) if mask.size else 1.0

    # --- checks --------------------------------------------------------------------------------
    def validate(
        self,
        sequence: str | int | None = None,
        *,
        top_k: int | None = None,
        num_layers: int | None = None,
    ) -> RouteTrace:
        """Run the whole validation catalogue; return self, or raise a named `RouteReplayError`.

        Checks: top-k and layer count against expectations (when given), ids in [-1, E), no row
        mixing -1 with ids, no duplicate id in a row, no MoE layer whose routed rows are all zeros
        (an engine capture failure; with top-1 only over >= 32 rows, where it cannot be chance).
        """
        validate_routes(self, sequence, top_k=top_k, num_layers=num_layers)
        return self

    # --- transforms ----------------------------------------------------------------------------
    def slice(self, begin: int | None = None, end: int | None = None) -> RouteTrace:
        """Rows of token positions [begin, end) (absolute positions, like `start`), as a copy."""
        begin = self.start if begin is None else int(begin)
        end = self.stop if end is None else int(end)
        if not self.start <= begin <= end <= self.stop:
            raise ConfigError(f"slice [{begin}, {end}) is outside this trace's token range [{self.start}, {self.stop})")
        segments = tuple(
            replace(s, begin=max(s.begin, begin), end=min(s.end, end))
            for s in self.segments
            if max(s.begin, begin) < min(s.end, end)
        )
        rows = self.experts[begin - self.start : end - self.start].copy()
        ids = None if self.token_ids is None else self.token_ids[begin - self.start : end - self.start].copy()
        indexer = None if self.indexer is None else self.indexer.slice(begin - self.start, end - self.start)
        weights = None if self.weights is None else self.weights[begin - self.start : end - self.start].copy()
        return self._like(rows, start=begin, segments=segments, token_ids=ids, indexer=indexer, weights=weights)

    @property
    def columns(self) -> tuple[tuple[int, str], ...]:
        """(global layer, router slot) of each column; the slot is "" where a layer has one router."""
        return tuple(zip(self.layers, self.slots or ("",) * len(self.layers), strict=True))

    def select_layers(self, layers: Sequence[int]) -> RouteTrace:
        """A copy holding only the given global layer numbers (every router slot of each), in the given order."""
        missing = [x for x in layers if x not in self.layers]
        if missing:
            raise ConfigError(f"layers {missing} are not in this trace (it has {list(self.layers)})")
        return self.select_columns([c for layer in layers for c in self.columns if c[0] == layer])

    def select_columns(self, columns: Sequence[tuple[int, str]]) -> RouteTrace:
        """A copy holding only the given (layer, slot) columns, in the given order."""
        index = {column: i for i, column in enumerate(self.columns)}
        wanted = [(int(layer), str(slot)) for layer, slot in columns]
        missing = [c for c in wanted if c not in index]
        if missing:
            raise ConfigError(f"(layer, slot) columns {missing} are not in this trace (it has {list(self.columns)})")
        rows = self.experts[:, [index[c] for c in wanted]].copy()
        weights = None if self.weights is None else self.weights[:, [index[c] for c in wanted]].copy()
        return self._like(rows, layers=tuple(c[0] for c in wanted), slots=tuple(c[1] for c in wanted), weights=weights)

    def sorted_rows(self) -> RouteTrace:
        """A copy with each row's ids in ascending order (the canonical form of a route set; order is lost)."""
        if self.weights is None:
            return self._like(np.sort(self.experts, axis=2), ordered=False)
        by_id = np.argsort(self.experts, axis=2, kind="stable")  # weights follow their ids
        rows = np.take_along_axis(self.experts, by_id, axis=2)
        return self._like(rows, ordered=False, weights=np.take_along_axis(self.weights, by_id, axis=2))

    def _like(self, experts: np.ndarray, **changes: Any) -> RouteTrace:
        """A trace like this one with `experts` and the given fields changed (slots and order carried)."""
        fields: dict[str, Any] = {
            "layers": self.layers,
            "start": self.start,
            "segments": self.segments,
            "token_ids": self.token_ids,
            "slots": self.slots,
            "ordered": self.ordered,
            "indexer": self.indexer,
            "weights": self.weights,
        }
        fields.update(changes)
        return RouteTrace(experts, self.num_experts, **fields)

    def with_provenance(self, source: Source | str, policy_version: int | None = None) -> RouteTrace:
        """A shallow copy whose rows are all attributed to one engine and policy version."""
        segments = (Segment(self.start, self.stop, source, policy_version),) if self.num_tokens else ()
        return self._like(self.experts, segments=segments)

    def with_token_ids(self, token_ids: Any) -> RouteTrace:
        """A shallow copy that names the token of every row (`token_ids[t]` at position start + t; -1 = unknown).

        A sequence of `num_tokens + 1` ids (prompt + response, whose last token has no row) is cut to
        `num_tokens`."""
        ids = np.asarray(token_ids)
        if ids.ndim == 1 and ids.shape[0] == self.num_tokens + 1:
            ids = ids[:-1]
        return self._like(self.experts, token_ids=ids)

    def with_weights(self, weights: Any) -> RouteTrace:
        """A shallow copy carrying the combine weights of its rows ((T, L, K) float, aligned with `experts`)."""
        return self._like(self.experts, weights=weights)

    def with_indexer(self, indexer: IndexerTrace | None) -> RouteTrace:
        """A shallow copy carrying the DSA indexer's choices of the same rows (`IndexerTrace`, same start and rows)."""
        return self._like(self.experts, indexer=indexer)

    def merge(self, other: RouteTrace, *, policy: MergePolicy | str = MergePolicy.KEEP) -> RouteTrace:
        """Merge another trace of the same sequence by absolute token position, into a new trace.

        The result covers [min start, max stop); positions neither trace covers are -1 rows under a
        segment of source `UNROUTED_SOURCE` ("none"). Each token's (L, K) row comes whole from one
        trace, so no token mixes two forward passes: a routed row (ids in some layer) beats an all -1
        row or a position the other trace does not cover; where both route a token, `keep` takes this
        trace's row (the routes used when the token was sampled) and `replace` takes `other`'s.
        Provenance follows the rows; adjacent segments of equal source and version are coalesced.
        Token ids follow the rows too (-1 where neither trace knows one); two traces that name
        different tokens at one position are not the same sequence: `TokenMismatchError`. Indexer
        choices merge by the same policy, per row (an unknown row never beats a known one).
        """
        try:
            policy = MergePolicy(policy)
        except ValueError:
            raise ConfigError(f"policy={policy!r} is not a merge policy; use 'keep' or 'replace'") from None
        if other.num_experts != self.num_experts:
            raise ConfigError(f"cannot merge traces of {self.num_experts} and {other.num_experts} experts")
        if other.top_k != self.top_k:
            raise TopKMismatchError(f"cannot merge traces of top-k {self.top_k} and {other.top_k}")
        if other.columns != self.columns:
            raise LayerCountError(
                f"cannot merge traces of layers {list(self.layers)} and {list(other.layers)}; select the same "
                "global layers first (select_layers / moe_layers=)"
                + ("" if self.slots == other.slots else f" (router slots {self.slots} and {other.slots})")
            )
        ordered = self.ordered and other.ordered
        if not (self.num_tokens and other.num_tokens):
            kept = self if self.num_tokens or not other.num_tokens else other
            ids = None if kept.token_ids is None else kept.token_ids.copy()
            return kept._like(kept.experts.copy(), token_ids=ids, ordered=ordered, weights=None)
        first, second = (self, other) if policy is MergePolicy.KEEP else (other, self)
        experts, start, segments, token_ids = merge_rows(first, second)
        indexer = merged_indexer(first.indexer, second.indexer, start, len(experts))
        return self._like(
            experts, start=start, segments=segments, token_ids=token_ids, ordered=ordered, indexer=indexer, weights=None
        )  # weights are not merged: replay the merged ids without them

    def to_torch(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ids as a (T, L, K) tensor (shares memory on CPU unless `dtype` differs)."""
        import torch

        tensor = torch.from_numpy(self.experts)
        if dtype is not None or device is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def expert_load(self) -> np.ndarray:
        """(L, E) int64 counts: how many routed rows picked each expert in each layer.

        Ids outside [0, E) are not counted in any layer (`validate()` names them: `ExpertIdRangeError`), so a
        trace that fails validation still has a load table, and no bad id lands in another layer's count."""
        num_layers, num_experts = self.num_layers, self.num_experts
        ids = self.experts.astype(np.int64)
        offsets = (np.arange(num_layers, dtype=np.int64) * num_experts)[None, :, None]
        flat = (ids + offsets)[(ids >= 0) & (ids < num_experts)]
        return np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)

    # --- comparison ----------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteTrace):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.layers == other.layers
            and self.slots == other.slots
            and self.start == other.start
            and self.segments == other.segments
            and self.experts.shape == other.experts.shape
            and bool(np.array_equal(self.experts, other.experts))
            and _same_token_ids(self.token_ids, other.token_ids)
            and self.indexer == other.indexer
            and _same_weights(self.weights, other.weights)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable array inside: not hashable

    def equal_sets(self, other: RouteTrace) -> bool:
        """Equal as route SETS: like `==` but the order of ids inside a row is ignored."""
        return self.sorted_rows() == other.sorted_rows()

    def __repr__(self) -> str:
        layers = list(self.layers)
        shown = f"{layers}" if len(layers) <= 6 else f"[{layers[0]}..{layers[-1]}]"
        slots = f", slots {list(self.slots)}" if self.slots else ""
        sources = ", ".join(s.describe() for s in self.segments[:3])
        if len(self.segments) > 3:
            sources += f", +{len(self.segments) - 3} more"
        return (
            f"RouteTrace(tokens {self.start}..{self.stop} ({self.num_tokens} rows), "
            f"{self.num_layers} layers {shown}{slots}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"routed {self.num_routed}/{self.num_tokens} rows, {self.experts.dtype}, "
            f"{'token ids, ' if self.token_ids is not None else ''}"
            f"sources [{sources}])"
        )


def _same_weights(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


def _same_token_ids(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


__all__ = ["RouteTrace"]
