"""`RouteTrace`: the routes of one sequence, with provenance and validation.

Legend: T = rows (tokens fed as input), L = MoE layers, K = top-k, E = experts.
`experts_TLK[t, l]` is the set of K expert ids that the router of global layer `layers[l]` chose
when token `start + t` was the input position; `-1` everywhere in that (t, l) row means "no route"
(never routed, padding, a cached prefix the engine did not report). Engines return
`num_tokens - 1` rows: the last sampled token is never fed back. `token_ids_T[t]` (optional) is the
token id at position `start + t`, the input whose routes row `t` holds (-1 = id unknown); replay
checks it against the batch it is applied to.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.enums import Source, StrEnum
from routereplay.errors import (
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    PartialRowError,
    TokenMismatchError,
    TopKMismatchError,
    TraceShapeError,
    ZeroLayerError,
    location,
)

if TYPE_CHECKING:
    import torch

INT16_MAX_EXPERTS = 32767  # ids up to 32766 and the -1 sentinel fit in int16
ZERO_LAYER_MIN_ROWS_K1 = 32  # with top-1, an all-zero layer is flagged only over this many rows
UNROUTED_SOURCE = "none"  # provenance of positions no engine call covered (set by `RouteTrace.merge`)


class MergePolicy(StrEnum):
    """Which rows win where two traces of one sequence both route a token (`RouteTrace.merge`)."""

    KEEP = "keep"  # the existing rows: the routes used when the token was sampled
    REPLACE = "replace"  # the newer rows (e.g. a re-prefill after a weight update)


def canonical_dtype(num_experts: int) -> np.dtype[Any]:
    """The dtype a trace stores its ids in: int16 when E <= 32767, else int32."""
    return np.dtype(np.int16) if num_experts <= INT16_MAX_EXPERTS else np.dtype(np.int32)


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


class RouteTrace:
    """Routes of one sequence: `experts` (T, L, K) signed ints with -1 = no route.

    Construct with `RouteTrace(experts=..., num_experts=..., layers=...)`; `layers` defaults to
    0..L-1, `start` (token position of row 0) to 0, and `segments` to one segment of unknown
    provenance covering every row. `token_ids` (optional, one id per row, -1 = unknown) names the
    tokens the rows route, so replay can refuse a batch whose tokens differ (a shifted BOS).
    Construction checks dtype and shape cheaply; call `validate()`
    for the full content checks (ids in range, no duplicates, no partial rows, no all-zero layer).
    """

    __slots__ = ("experts", "layers", "num_experts", "segments", "start", "token_ids")

    experts: np.ndarray
    num_experts: int
    layers: tuple[int, ...]
    start: int
    segments: tuple[Segment, ...]
    token_ids: np.ndarray | None  # (T,) int64: token id at position start + t, -1 = unknown; None = not known

    def __init__(
        self,
        experts: Any,
        num_experts: int,
        layers: Sequence[int] | None = None,
        start: int = 0,
        segments: Sequence[Segment] = (),
        token_ids: Any = None,
    ) -> None:
        if not isinstance(num_experts, (int, np.integer)) or isinstance(num_experts, bool) or num_experts < 1:
            raise ConfigError(f"num_experts={num_experts!r} must be a positive int")
        self.num_experts = int(num_experts)
        self.experts = _as_route_array(experts, self.num_experts)
        num_rows, num_layers, _ = self.experts.shape
        self.layers = tuple(range(num_layers)) if layers is None else tuple(int(x) for x in layers)
        if len(self.layers) != num_layers:
            raise LayerCountError(
                f"layers has {len(self.layers)} entries but experts has {num_layers} layers (shape "
                f"{self.experts.shape}); pass one global layer number per layer of the array"
            )
        if len(set(self.layers)) != num_layers or any(x < 0 for x in self.layers):
            raise ConfigError(f"layers={self.layers} must be distinct non-negative global layer numbers")
        if not isinstance(start, (int, np.integer)) or start < 0:
            raise ConfigError(f"start={start!r} must be a non-negative int (token position of row 0)")
        self.start = int(start)
        if not segments and num_rows:
            segments = (Segment(self.start, self.start + num_rows),)
        self.segments = tuple(segments)
        _check_segments(self.segments, self.start, self.start + num_rows)
        self.token_ids = None if token_ids is None else _as_token_ids(token_ids, num_rows)

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
        where = sequence
        if top_k is not None and top_k != self.top_k:
            raise TopKMismatchError(
                f"{location(where)}: routes have top-k {self.top_k} but the model routes to "
                f"{top_k} experts per token; check the payload's last axis / the top_k you passed"
            )
        if num_layers is not None and num_layers != self.num_layers:
            raise LayerCountError(
                f"{location(where)}: routes cover {self.num_layers} layers, expected {num_layers}; an "
                "all-layer payload needs moe_layers= to select the MoE layers"
            )
        x = self.experts
        if x.size == 0:
            return self
        num_rows, num_layers, top_k = x.shape
        low, high = int(x.min()), int(x.max())
        if low < -1 or high >= self.num_experts:
            bad = (x < -1) | (x >= self.num_experts)
            t, l, k = np.unravel_index(int(np.flatnonzero(bad)[0]), x.shape)
            raise ExpertIdRangeError(
                f"{location(where, row=int(t), layer=self.layers[l], start=self.start)}: expert id "
                f"{int(x[t, l, k])} is outside [0, {self.num_experts}) ({int(bad.sum())} such ids); "
                "check num_experts, and that the engine reports logical (not EPLB physical) ids"
            )
        columns_KR = np.ascontiguousarray(x.reshape(-1, top_k).T)  # one contiguous row per top-k slot
        routed_R: np.ndarray | None = None  # None: every row routed (no -1 anywhere)
        if low == -1:
            negative_KR = columns_KR == -1
            all_negative_R = np.logical_and.reduce(negative_KR, axis=0)
            partial_R = np.logical_or.reduce(negative_KR, axis=0) & ~all_negative_R
            if partial_R.any():
                row, index = divmod(int(np.flatnonzero(partial_R)[0]), num_layers)
                raise PartialRowError(
                    f"{location(where, row=row, layer=self.layers[index], start=self.start)}: row "
                    f"{x[row, index].tolist()} mixes -1 with expert ids; a row is either fully routed or fully "
                    "-1 (no route). The payload was padded or truncated inside the top-k axis"
                )
            routed_R = ~all_negative_R
        routed_TL = (
            np.ones((num_rows, num_layers), bool) if routed_R is None else routed_R.reshape(num_rows, num_layers)
        )
        self._check_zero_layers(where, routed_TL)
        if top_k > 1:
            duplicate_R = _duplicate_rows(columns_KR)
            if routed_R is not None:
                duplicate_R &= routed_R
            if duplicate_R.any():
                row, index = divmod(int(np.flatnonzero(duplicate_R)[0]), num_layers)
                raise DuplicateExpertError(
                    f"{location(where, row=row, layer=self.layers[index], start=self.start)}: row "
                    f"{x[row, index].tolist()} names an expert twice ({int(duplicate_R.sum())} such rows); zero "
                    "padding was probably used for 'no route' - use -1 instead"
                )
        return self

    def _check_zero_layers(self, where: str | int | None, routed_TL: np.ndarray) -> None:
        # ids are in [-1, E) and no row mixes -1 with ids, so a layer whose largest id is 0 holds
        # only all-zero and all-(-1) rows
        num_rows, num_layers, top_k = self.experts.shape
        layer_max_L = (
            self.experts.reshape(num_rows, num_layers * top_k).max(axis=0).reshape(num_layers, top_k).max(axis=1)
        )
        if not (layer_max_L == 0).any():
            return
        routed_rows_L = routed_TL.sum(axis=0)
        threshold = 1 if top_k > 1 else ZERO_LAYER_MIN_ROWS_K1
        all_zero_L = (layer_max_L == 0) & (routed_rows_L >= threshold)
        if all_zero_L.any():
            layer_numbers = [self.layers[i] for i in np.flatnonzero(all_zero_L)]
            raise ZeroLayerError(
                f"{location(where)}: MoE layer(s) {layer_numbers} are all zeros over "
                f"{int(routed_rows_L[all_zero_L].max())} routed rows: the engine's capture failed "
                "there (known: vLLM FlashInfer TRT-LLM/NVFP4, SGLang pipeline stages). If these are "
                "dense layers of an all-layer payload, pass moe_layers= (CLI: --moe-layers) to drop them"
            )

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
        return RouteTrace(rows, self.num_experts, self.layers, begin, segments, ids)

    def select_layers(self, layers: Sequence[int]) -> RouteTrace:
        """A copy holding only the given global layer numbers, in the given order."""
        index = {layer: i for i, layer in enumerate(self.layers)}
        missing = [x for x in layers if x not in index]
        if missing:
            raise ConfigError(f"layers {missing} are not in this trace (it has {list(self.layers)})")
        rows = self.experts[:, [index[x] for x in layers]].copy()
        return RouteTrace(rows, self.num_experts, tuple(layers), self.start, self.segments, self.token_ids)

    def sorted_rows(self) -> RouteTrace:
        """A copy with each row's ids in ascending order (the canonical form of a route set)."""
        return RouteTrace(
            np.sort(self.experts, axis=2), self.num_experts, self.layers, self.start, self.segments, self.token_ids
        )

    def with_provenance(self, source: Source | str, policy_version: int | None = None) -> RouteTrace:
        """A shallow copy whose rows are all attributed to one engine and policy version."""
        segments = (Segment(self.start, self.stop, source, policy_version),) if self.num_tokens else ()
        return RouteTrace(self.experts, self.num_experts, self.layers, self.start, segments, self.token_ids)

    def with_token_ids(self, token_ids: Any) -> RouteTrace:
        """A shallow copy that names the token of every row (`token_ids[t]` at position start + t; -1 = unknown).

        A sequence of `num_tokens + 1` ids (prompt + response, whose last token has no row) is cut to
        `num_tokens`."""
        ids = np.asarray(token_ids)
        if ids.ndim == 1 and ids.shape[0] == self.num_tokens + 1:
            ids = ids[:-1]
        return RouteTrace(self.experts, self.num_experts, self.layers, self.start, self.segments, ids)

    def merge(self, other: RouteTrace, *, policy: MergePolicy | str = MergePolicy.KEEP) -> RouteTrace:
        """Merge another trace of the same sequence by absolute token position, into a new trace.

        The result covers [min start, max stop); positions neither trace covers are -1 rows under a
        segment of source `UNROUTED_SOURCE` ("none"). Each token's (L, K) row comes whole from one
        trace, so no token mixes two forward passes: a routed row (ids in some layer) beats an all -1
        row or a position the other trace does not cover; where both route a token, `keep` takes this
        trace's row (the routes used when the token was sampled) and `replace` takes `other`'s.
        Provenance follows the rows; adjacent segments of equal source and version are coalesced.
        Token ids follow the rows too (-1 where neither trace knows one); two traces that name
        different tokens at one position are not the same sequence: `TokenMismatchError`.
        """
        try:
            policy = MergePolicy(policy)
        except ValueError:
            raise ConfigError(f"policy={policy!r} is not a merge policy; use 'keep' or 'replace'") from None
        if other.num_experts != self.num_experts:
            raise ConfigError(f"cannot merge traces of {self.num_experts} and {other.num_experts} experts")
        if other.top_k != self.top_k:
            raise TopKMismatchError(f"cannot merge traces of top-k {self.top_k} and {other.top_k}")
        if other.layers != self.layers:
            raise LayerCountError(
                f"cannot merge traces of layers {list(self.layers)} and {list(other.layers)}; select the same "
                "global layers first (select_layers / moe_layers=)"
            )
        if not (self.num_tokens and other.num_tokens):
            kept = self if self.num_tokens or not other.num_tokens else other
            ids = None if kept.token_ids is None else kept.token_ids.copy()
            return RouteTrace(kept.experts.copy(), kept.num_experts, kept.layers, kept.start, kept.segments, ids)
        first, second = (self, other) if policy is MergePolicy.KEEP else (other, self)
        start = min(self.start, other.start)
        span = max(self.stop, other.stop) - start
        covered_2T = np.zeros((2, span), bool)
        routed_2T = np.zeros((2, span), bool)
        for i, trace in enumerate((first, second)):
            lo = trace.start - start
            covered_2T[i, lo : lo + trace.num_tokens] = True
            routed_2T[i, lo : lo + trace.num_tokens] = (trace.experts[..., 0] >= 0).any(axis=1)
        use_second_T = covered_2T[1] & (~covered_2T[0] | (routed_2T[1] & ~routed_2T[0]))
        use_first_T = covered_2T[0] & ~use_second_T
        experts = np.full((span, self.num_layers, self.top_k), -1, self.experts.dtype)
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
        return RouteTrace(experts, self.num_experts, self.layers, start, segments, token_ids)

    def to_torch(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ids as a (T, L, K) tensor (shares memory on CPU unless `dtype` differs)."""
        import torch

        tensor = torch.from_numpy(self.experts)
        if dtype is not None or device is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def expert_load(self) -> np.ndarray:
        """(L, E) int64 counts: how many routed rows picked each expert in each layer."""
        num_layers, num_experts = self.num_layers, self.num_experts
        ids = self.experts.astype(np.int64)
        offsets = (np.arange(num_layers, dtype=np.int64) * num_experts)[None, :, None]
        flat = (ids + offsets)[ids >= 0]
        return np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)

    # --- comparison ----------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteTrace):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.layers == other.layers
            and self.start == other.start
            and self.segments == other.segments
            and self.experts.shape == other.experts.shape
            and bool(np.array_equal(self.experts, other.experts))
            and _same_token_ids(self.token_ids, other.token_ids)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable array inside: not hashable

    def equal_sets(self, other: RouteTrace) -> bool:
        """Equal as route SETS: like `==` but the order of ids inside a row is ignored."""
        return self.sorted_rows() == other.sorted_rows()

    def __repr__(self) -> str:
        layers = list(self.layers)
        shown = f"{layers}" if len(layers) <= 6 else f"[{layers[0]}..{layers[-1]}]"
        sources = ", ".join(s.describe() for s in self.segments[:3])
        if len(self.segments) > 3:
            sources += f", +{len(self.segments) - 3} more"
        return (
            f"RouteTrace(tokens {self.start}..{self.stop} ({self.num_tokens} rows), "
            f"{self.num_layers} layers {shown}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"routed {self.num_routed}/{self.num_tokens} rows, {self.experts.dtype}, "
            f"{'token ids, ' if self.token_ids is not None else ''}"
            f"sources [{sources}])"
        )


def _as_route_array(value: Any, num_experts: int) -> np.ndarray:
    """Coerce ids to a C-contiguous (T, L, K) array of the canonical dtype, refusing lossy casts."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch
        if getattr(getattr(value, "device", None), "type", None) == "meta":  # issue 11 item 15
            raise DtypeError(
                f"routes tensor of shape {tuple(value.shape)} is on the 'meta' device, which holds no values; "
                "materialise it first (build it on a real device, or .to('cpu') after loading real data)"
            )
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise DtypeError(
            f"routes must be an integer array, got dtype {array.dtype}; expert ids are never "
            "floats - decode the engine payload with decode_vllm / decode_sglang"
        )
    if array.ndim != 3:
        raise TraceShapeError(f"routes must have shape (tokens, layers, top_k), got shape {array.shape}")
    if array.shape[2] < 1:
        raise TraceShapeError(f"routes have top_k=0 (shape {array.shape}); a route names >= 1 expert")
    target = canonical_dtype(num_experts)
    if array.dtype != target and array.size:
        info = np.iinfo(target)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise ExpertIdRangeError(
                f"expert ids span [{low}, {high}], which cannot be ids of {num_experts} experts "
                "(nor -1); check num_experts and the payload dtype"
            )
    return np.ascontiguousarray(array, dtype=target)


def _as_token_ids(value: Any, num_rows: int) -> np.ndarray:
    """Token ids as a (T,) int64 array, one per row, -1 = unknown; refuse any other shape or value."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    ids = np.asarray(value)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise ConfigError(
            f"token_ids must be a 1-D integer sequence (one id per row), got dtype {ids.dtype} shape {ids.shape}"
        )
    if ids.shape[0] != num_rows:
        raise ConfigError(
            f"token_ids has {ids.shape[0]} ids but the trace has {num_rows} rows; give the id of each routed input "
            "position (prompt + response minus the last token: RouteTrace.with_token_ids cuts that one)"
        )
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) > np.iinfo(np.int32).max):
        raise ConfigError(f"token_ids span [{int(ids.min())}, {int(ids.max())}]; ids are in [0, 2^31) or -1 (unknown)")
    return np.ascontiguousarray(ids, dtype=np.int64)


def _same_token_ids(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


def _merged_token_ids(
    first: RouteTrace, second: RouteTrace, start: int, span: int, use_first_T: np.ndarray, use_second_T: np.ndarray
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


def _duplicate_rows(columns_KR: np.ndarray) -> np.ndarray:
    """(R,) bool: rows naming an expert twice. Pairwise compares of contiguous columns beat a sort
    along a short last axis up to K = 16 (28 compares for K = 8)."""
    top_k = columns_KR.shape[0]
    if top_k > 16:
        ordered_RK = np.sort(columns_KR.T, axis=1)
        return np.asarray((ordered_RK[:, 1:] == ordered_RK[:, :-1]).any(axis=1))
    duplicate_R = np.zeros(columns_KR.shape[1], bool)
    for i in range(top_k):
        for j in range(i + 1, top_k):
            duplicate_R |= columns_KR[i] == columns_KR[j]
    return duplicate_R


def _check_segments(segments: tuple[Segment, ...], start: int, stop: int) -> None:
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


__all__ = ["UNROUTED_SOURCE", "MergePolicy", "RouteTrace", "Segment", "canonical_dtype"]
