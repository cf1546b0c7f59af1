"""From a decoded (rows, layers, top_k) array to a validated `RouteTrace`.

Every engine decoder ends here, so the shape rules live in one place: the row-count contract
(`num_tokens - 1 - start` rows, with a diagnosis of the usual ways it breaks), layer selection
from all-layer payloads by global layer number (a dropped layer must hold only "no route" rows:
`DenseLayerRouteError` otherwise), the top-k check, provenance, and the content validation
catalogue of `RouteTrace.validate`.

Legend: T = rows, L = layers in the payload, K = top-k, E = experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from routereplay.enums import Source
from routereplay.errors import (
    ConfigError,
    DenseLayerRouteError,
    DtypeError,
    DuplicatedPrefixError,
    ExpertIdRangeError,
    LayerCountError,
    RouteValueError,
    RowCountError,
    TopKMismatchError,
    TraceShapeError,
    location,
)
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype
from routereplay.wire.diagnosis import Split, clean_alternatives, describe, split_hint_for_rows
from routereplay.wire.limits import (
    DEFAULT_LIMITS,
    WireLimits,
    checked_int,
    checked_layers,
    checked_optional_int,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectation:
    """What the caller knows about the sequence and the model; every field but num_experts is optional.

    Construction checks every field's type and range (a `None`, bool, float or string where an
    int belongs is a `ConfigError`), so a decoder builds one before touching the payload.
    `flat_layout` marks a payload that carried no shape of its own (SGLang's raw bytes): its
    (layers, top_k) split is the caller's guess, and a failure lists the splits that fit instead.
    """

    num_experts: int
    layers: Sequence[int] | None = None  # global layer numbers of the result
    moe_layers: Sequence[int] | None = None  # which payload layers to keep (all-layer payload)
    num_layers: int | None = None  # layer-axis length of the payload itself
    top_k: int | None = None
    start: int = 0  # token position of the first row
    num_tokens: int | None = None  # prompt + generated tokens of the sequence
    num_tokens_origin: str = "num_tokens"  # how num_tokens was obtained (named in errors)
    start_name: str = "start"  # the decoder's name for `start` (prompt_start, start_len), in errors
    flat_layout: bool = False
    limits: WireLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if not isinstance(self.limits, WireLimits):
            raise ConfigError(f"limits must be a WireLimits, got {type(self.limits).__name__}")
        fixed = {
            "num_experts": checked_int(self.num_experts, "num_experts", minimum=1),
            "layers": checked_layers(self.layers, "layers", self.limits),
            "moe_layers": checked_layers(self.moe_layers, "moe_layers", self.limits),
            "num_layers": checked_optional_int(self.num_layers, "num_layers", minimum=1),
            "top_k": checked_optional_int(self.top_k, "top_k", minimum=1),
            "start": checked_int(self.start, self.start_name),
            "num_tokens": checked_optional_int(self.num_tokens, "num_tokens", minimum=1),
        }
        for name, value in fixed.items():
            object.__setattr__(self, name, value)
        self.limits.check_model(self.num_layers, self.top_k)
        if self.moe_layers is not None and self.layers is not None and list(self.moe_layers) != list(self.layers):
            raise ConfigError(
                f"layers={list(self.layers)} and moe_layers={list(self.moe_layers)} disagree; pass "
                "moe_layers for an all-layer payload, or layers for a payload that is MoE-only"
            )

    @property
    def expected_rows(self) -> int | None:
        """Rows the payload must hold (`num_tokens - 1 - start`), when num_tokens is known."""
        return None if self.num_tokens is None else self.num_tokens - 1 - self.start


def assemble(
    experts_TLK: np.ndarray,
    expect: Expectation,
    *,
    source: Source,
    sequence: str | int | None,
    policy_version: int | None = None,
    validate: bool = True,
) -> RouteTrace:
    """Check shape against `expect`, select MoE layers, attach provenance, validate content.

    `validate=False` skips only the content catalogue (for tools that report it, like `inspect`).
    """
    if experts_TLK.dtype.kind not in "iu":
        raise DtypeError(f"{location(sequence)}: routes have dtype {experts_TLK.dtype}; expected integers")
    if np.iinfo(experts_TLK.dtype).max < expect.num_experts - 1:  # e.g. uint8 ids of a 300-expert model: wrapped
        raise DtypeError(
            f"{location(sequence)}: routes have dtype {experts_TLK.dtype}, whose largest value "
            f"{np.iinfo(experts_TLK.dtype).max} cannot hold expert ids up to {expect.num_experts - 1}: the ids were "
            "narrowed (and may have wrapped) on the way, or num_experts is not this model's (vLLM sends uint16 "
            "when E > 256)"
        )
    expect.limits.check_shape(experts_TLK.shape, f"{location(sequence)}: routes")
    rows, payload_layers, top_k = experts_TLK.shape
    if expect.num_layers is not None and payload_layers != expect.num_layers:
        raise LayerCountError(
            f"{location(sequence)}: payload has {payload_layers} layers, expected num_layers="
            f"{expect.num_layers} (the engine reports every hidden layer, dense ones included)"
        )
    if expect.top_k is not None and top_k != expect.top_k:
        raise TopKMismatchError(
            f"{location(sequence)}: payload has top-k {top_k}, the model routes to {expect.top_k} "
            "experts per token; a fused shared expert counted as routed, or the wrong model"
        )
    check_rows(experts_TLK, expect, sequence)
    try:
        return _finish(experts_TLK, expect, source, sequence, policy_version, validate)
    except RouteValueError as exc:
        if not expect.flat_layout:
            raise
        given = Split(payload_layers, top_k)
        fits = clean_alternatives(experts_TLK.reshape(-1), rows, given, expect.num_experts, expect.limits)
        if not fits:
            raise
        raise type(exc)(
            f"{exc}. But the payload carries no shape of its own and its {payload_layers * top_k} ids per row "
            f"read cleanly as {describe(fits)} (the widest clean split is the likely one): the (num_layers, "
            "top_k) split is probably wrong - pass the "
            "model's num_hidden_layers and num_experts_per_tok"
        ) from None


def _finish(
    experts_TLK: np.ndarray,
    expect: Expectation,
    source: Source,
    sequence: str | int | None,
    policy_version: int | None,
    validate: bool,
) -> RouteTrace:
    """Select layers, check id range before any narrowing cast, attach provenance, validate."""
    rows = experts_TLK.shape[0]
    experts_TLK, layers = _select_layers(experts_TLK, expect, sequence)
    if experts_TLK.dtype.kind == "u" and experts_TLK.size and int(experts_TLK.max()) >= expect.num_experts:
        # unsigned payloads cannot carry -1: report the range error before the cast can wrap
        bad = int(experts_TLK.max())
        raise ExpertIdRangeError(
            f"{location(sequence)}: expert id {bad} is outside [0, {expect.num_experts}); check "
            "num_experts and that the engine reports logical (not EPLB physical) ids"
        )
    if (
        experts_TLK.size
        and experts_TLK.dtype != canonical_dtype(expect.num_experts)
        and experts_TLK.dtype.itemsize >= 4
    ):
        columns = layers if expect.moe_layers is not None else range(experts_TLK.shape[1])  # payload layer numbers
        _check_castable(experts_TLK, expect.num_experts, sequence, expect.start, columns)
    segments = (Segment(expect.start, expect.start + rows, source, policy_version),) if rows else ()
    trace = RouteTrace(experts_TLK, expect.num_experts, layers, expect.start, segments)
    return trace.validate(sequence) if validate else trace


def check_rows(experts_TLK: np.ndarray, expect: Expectation, sequence: str | int | None) -> None:
    """Refuse a payload whose row count is not `expect.expected_rows`, naming the likely cause."""
    expected = expect.expected_rows
    if expected is None:
        return
    rows = experts_TLK.shape[0]
    if rows == expected:
        return
    head = (
        f"{location(sequence)}: {rows} route rows, expected {expected} = {expect.num_tokens_origin}"
        f"({expect.num_tokens}) - 1 - {expect.start_name}({expect.start})"
    )
    extra = rows - expected
    if extra > 0 and 2 * extra <= rows and np.array_equal(experts_TLK[:extra], experts_TLK[extra : 2 * extra]):
        cause = (
            f"the first {extra} rows repeat exactly: a duplicated prefix (a resumed or multi-turn "
            "rollout whose prompt routes were concatenated twice, verl #6029). Keep one copy"
        )
        raise DuplicatedPrefixError(f"{head}: {cause}")
    if expect.flat_layout:
        raise_wrong_split(experts_TLK.size, expect, experts_TLK.shape[1], experts_TLK.shape[2], sequence, head)
    if extra == 1:
        cause = "one row too many: the payload has a row for the last sampled token, or num_tokens misses a token"
    elif extra > 0 and rows == expect.num_tokens - 1:  # type: ignore[operator]  # known: expected is not None
        cause = (
            f"the payload starts at token 0, not {expect.start}: pass {expect.start_name}=0, or the engine "
            "ignored the start offset"
        )
    elif extra > 0:
        cause = "too many rows: routes of another sequence, or a stale capture buffer; check the request/choice index"
    else:
        cause = (
            "too few rows: a truncated capture (max_bytes limit, abort mid-generation, preemption) or "
            f"a start offset (routed_experts_start_len / prompt_start) that was not passed as {expect.start_name}="
        )
    raise RowCountError(f"{head}: {cause}")


def raise_wrong_split(
    num_ids: int, expect: Expectation, num_layers: int, top_k: int, sequence: str | int | None, head: str
) -> None:
    """For a flat payload: if its ids make exactly the expected rows under another split, say which.

    A wrong top-k (or num_layers) changes the row count of a flat payload; blaming the rows would
    send the user after a stale buffer. Raises TopKMismatchError when keeping num_layers fits,
    LayerCountError when keeping top_k fits, TraceShapeError otherwise; returns when nothing fits.
    """
    expected = expect.expected_rows
    if expected is None:
        return
    given = Split(num_layers, top_k)
    fits = split_hint_for_rows(num_ids, expected, given, expect.limits)
    if not fits:
        return
    width = num_ids // expected
    text = (
        f"{head}. The payload carries no shape of its own: its {num_ids} ids make exactly {expected} rows of "
        f"{width} ids, not of num_layers({num_layers}) x top_k({top_k}) = {num_layers * top_k}. It fits "
        f"{describe(fits)}; pass the model's num_hidden_layers (every layer, dense ones included) and "
        "num_experts_per_tok"
    )
    if any(s.num_layers == num_layers for s in fits):
        raise TopKMismatchError(text)
    if any(s.top_k == top_k for s in fits):
        raise LayerCountError(text)
    raise TraceShapeError(text)


def _select_layers(
    experts_TLK: np.ndarray, expect: Expectation, sequence: str | int | None
) -> tuple[np.ndarray, tuple[int, ...]]:
    payload_layers = experts_TLK.shape[1]
    if expect.moe_layers is not None:
        moe_layers = tuple(int(x) for x in expect.moe_layers)
        if not moe_layers:
            raise ConfigError("moe_layers is empty; pass the global layer numbers of the MoE layers")
        out_of_range = [x for x in moe_layers if not 0 <= x < payload_layers]
        if out_of_range:
            raise LayerCountError(
                f"{location(sequence)}: moe_layers names layers {out_of_range} but the payload has only "
                f"{payload_layers} layers; if the payload is MoE-only already pass layers= instead"
            )
        _check_dropped_layers(experts_TLK, moe_layers, expect.start, sequence)
        return experts_TLK[:, list(moe_layers)], moe_layers
    if expect.layers is not None:
        layers = tuple(int(x) for x in expect.layers)
        if len(layers) != payload_layers:
            hint = (
                "; the payload holds every hidden layer - pass moe_layers= to select the MoE ones"
                if payload_layers > len(layers)
                else "; the engine captured fewer layers (pipeline stage? wrong model?)"
            )
            raise LayerCountError(
                f"{location(sequence)}: payload has {payload_layers} layers but layers= names {len(layers)}{hint}"
            )
        return experts_TLK, layers
    return experts_TLK, tuple(range(payload_layers))


def _check_dropped_layers(
    experts_TLK: np.ndarray, moe_layers: tuple[int, ...], start: int, sequence: str | int | None
) -> None:
    """Refuse a payload layer that `moe_layers` drops but that holds routes.

    Engines fill a dense (router-less) layer's column with "no route": vLLM, SGLang and Megatron leave their
    zero-initialised capture buffers at 0, vLLM 0.21 and routereplay's own forms write -1. So every dropped
    (token, layer) row must be all 0 or all -1; anything else means `moe_layers` is not this model's (a
    shifted or missing layer) and dropping the column would discard real routes silently.
    """
    dropped = [layer for layer in range(experts_TLK.shape[1]) if layer not in set(moe_layers)]
    if not dropped or experts_TLK.size == 0:
        return
    dropped_TDK = experts_TLK[:, dropped]
    empty_TD = (dropped_TDK == 0).all(axis=-1)
    if experts_TLK.dtype.kind == "i":  # unsigned payloads cannot carry -1
        empty_TD |= (dropped_TDK == -1).all(axis=-1)
    if bool(empty_TD.all()):
        return
    t, d = (int(i) for i in np.argwhere(~empty_TD)[0])
    raise DenseLayerRouteError(
        f"{location(sequence, row=t, layer=dropped[d], start=start)}: moe_layers={list(moe_layers)} drops payload "
        f"layer {dropped[d]} as dense, but it holds expert ids {dropped_TDK[t, d].tolist()} ({int((~empty_TD).sum())} "
        "such (token, layer) rows); a dense layer's row is all 0 or all -1 (no route). Check moe_layers "
        "(CLI: --moe-layers) against the model's config (mlp_only_layers, first_k_dense_replace, "
        "decoder_sparse_step): a routed layer is being dropped"
    )


def _check_castable(
    experts_TLK: np.ndarray, num_experts: int, sequence: str | int | None, start: int, layers: Sequence[int]
) -> None:
    """Refuse ids outside [-1, E); `layers` are the payload layer numbers of `experts_TLK`'s columns (dense
    layers dropped), so the message names the layer the bad id sits in."""
    low, high = int(experts_TLK.min()), int(experts_TLK.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        t, l, _ = np.argwhere(experts_TLK == bad)[0]
        raise ExpertIdRangeError(
            f"{location(sequence, row=int(t), start=start)}, payload layer {int(layers[int(l)])}: expert id {bad} is "
            f"outside [0, {num_experts}) and is not -1; check num_experts and the payload dtype"
        )


__all__ = ["Expectation", "assemble", "check_rows", "raise_wrong_split"]
