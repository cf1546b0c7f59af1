"""What a `RouteTrace` may hold: its ids coerced at construction, and the validation catalogue.

Construction (`as_route_array`, `as_token_ids`) checks dtype and shape cheaply and stores ids in
`canonical_dtype`; `validate_routes` (behind `RouteTrace.validate`) checks the content: top-k and layer
count, ids in [-1, E), no row mixing -1 with ids, no duplicate id in a row, no all-zero MoE layer.

Legend: T = rows, L = MoE layers, K = top-k, R = T * L (token, layer) rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from routereplay.errors import (
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    PartialRowError,
    TopKMismatchError,
    TraceShapeError,
    WeightsShapeError,
    WeightsValueError,
    ZeroLayerError,
    location,
)
from routereplay.trace.provenance import RoutedRows

INT16_MAX_EXPERTS = 32767  # ids up to 32766 and the -1 sentinel fit in int16
ZERO_LAYER_MIN_ROWS_K1 = 32  # with top-1, an all-zero layer is flagged only over this many rows


def canonical_dtype(num_experts: int) -> np.dtype[Any]:
    """The dtype a trace stores its ids in: int16 when E <= 32767, else int32."""
    return np.dtype(np.int16) if num_experts <= INT16_MAX_EXPERTS else np.dtype(np.int32)


def as_route_array(value: Any, num_experts: int) -> np.ndarray:
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
    span = overflow_span(array, target) if array.dtype != target else None
    if span is not None:
        raise ExpertIdRangeError(
            f"expert ids span [{span[0]}, {span[1]}], which cannot be ids of {num_experts} experts "
            "(nor -1); check num_experts and the payload dtype"
        )
    return np.ascontiguousarray(array, dtype=target)


def overflow_span(array: np.ndarray, dtype: Any) -> tuple[int, int] | None:
    """(min, max) of an integer `array` when one of its values does not fit `dtype`, else None (also when empty)."""
    if not array.size:
        return None
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    return (low, high) if low < info.min or high > info.max else None


def as_weights(value: Any, experts_TLK: np.ndarray) -> np.ndarray:
    """Combine weights (T, L, K) as float32 (`RouteTrace.weights`): the shape of the ids, finite, >= 0, and 0
    on -1 rows (`WeightsShapeError`, `WeightsValueError`)."""
    array = np.asarray(value)
    if array.dtype.kind != "f" or array.shape != experts_TLK.shape:
        raise WeightsShapeError(
            f"weights must be floating point of the routes' shape {experts_TLK.shape} (T, L, K), got "
            f"{array.dtype} {array.shape}"
        )
    weights_TLK = array.astype(np.float32, copy=True)
    bad_TLK = ~np.isfinite(weights_TLK) | (weights_TLK < 0) | ((experts_TLK < 0) & (weights_TLK != 0))
    if bad_TLK.any():
        t, layer, k = (int(i) for i in np.argwhere(bad_TLK)[0])
        raise WeightsValueError(
            f"weight {k} of row {t}, layer column {layer} is {float(weights_TLK[t, layer, k])}: combine weights are "
            "finite, >= 0, and 0 where the route is -1"
        )
    return weights_TLK


def as_token_ids(value: Any, num_rows: int) -> np.ndarray:
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


MAX_SLOT_NAME = 64  # characters of a router slot name (a module path inside its layer, e.g. "mlp.router")


def check_slots(slots: Any, layers: tuple[int, ...]) -> tuple[str, ...] | None:
    """The router slot names of a trace's columns, checked: None when every layer has one router.

    Layers must be non-negative, and each (layer, slot) column distinct: a layer may repeat only
    under distinct slot names. Names are printable, at most `MAX_SLOT_NAME` characters."""
    if any(x < 0 for x in layers):
        raise ConfigError(f"layers={layers} must be non-negative global layer numbers")
    if slots is None:
        if len(set(layers)) != len(layers):
            raise ConfigError(
                f"layers={layers} must be distinct non-negative global layer numbers (a layer with two routers "
                "needs slots= naming each router)"
            )
        return None
    if isinstance(slots, (str, bytes)) or not all(isinstance(x, str) for x in slots):
        raise ConfigError(f"slots={slots!r} must be a sequence of router slot names (str), one per layer column")
    names = tuple(slots)
    if len(names) != len(layers):
        raise LayerCountError(f"slots has {len(names)} names but the trace has {len(layers)} layer columns")
    bad = [x for x in names if len(x) > MAX_SLOT_NAME or not x.isprintable()]
    if bad:
        raise ConfigError(f"slot names {bad[:3]!r} must be printable and at most {MAX_SLOT_NAME} characters")
    columns = list(zip(layers, names, strict=True))
    if len(set(columns)) != len(columns):
        raise ConfigError(f"(layer, slot) columns {columns} repeat: each router of a layer needs its own slot name")
    return None if not any(names) and len(set(layers)) == len(layers) else names


def validate_routes(
    trace: RoutedRows, sequence: str | int | None, *, top_k: int | None, num_layers: int | None
) -> None:
    """The validation catalogue of `RouteTrace.validate`: raise a named `RouteReplayError` at the first
    problem (see there for the list); `sequence` names the sequence in the message.
    """
    where = sequence
    if top_k is not None and top_k != trace.top_k:
        raise TopKMismatchError(
            f"{location(where)}: routes have top-k {trace.top_k} but the model routes to "
            f"{top_k} experts per token; check the payload's last axis / the top_k you passed"
        )
    if num_layers is not None and num_layers != trace.num_layers:
        raise LayerCountError(
            f"{location(where)}: routes cover {trace.num_layers} layers, expected {num_layers}; an "
            "all-layer payload needs moe_layers= to select the MoE layers"
        )
    x = trace.experts
    if x.size == 0:
        return
    num_rows, num_layers, top_k = x.shape
    low, high = int(x.min()), int(x.max())
    if low < -1 or high >= trace.num_experts:
        bad = (x < -1) | (x >= trace.num_experts)
        t, l, k = np.unravel_index(int(np.flatnonzero(bad)[0]), x.shape)
        raise ExpertIdRangeError(
            f"{location(where, row=int(t), layer=trace.layers[l], start=trace.start)}: expert id "
            f"{int(x[t, l, k])} is outside [0, {trace.num_experts}) ({int(bad.sum())} such ids); "
            "check num_experts, and that the engine reports logical (not EPLB physical) ids"
        )
    columns_KR = np.ascontiguousarray(x.reshape(-1, top_k).T)  # one contiguous row per top-k slot
    routed_R: np.ndarray | None = None  # None: every row routed (no -1 anywhere)
    if low == -1:
        negative_KR = columns_KR == -1
        all_negative_R = np.logical_and.reduce(negative_KR, axis=0)
        partial_R = np.logical_or.reduce(negative_KR, axis=0) & ~all_negative_R
        if partial_R.any():
            at, ids = _first_row(trace, where, partial_R)
            raise PartialRowError(
                f"{at}: row {ids} mixes -1 with expert ids; a row is either fully routed or fully "
                "-1 (no route). The payload was padded or truncated inside the top-k axis"
            )
        routed_R = ~all_negative_R
    routed_TL = np.ones((num_rows, num_layers), bool) if routed_R is None else routed_R.reshape(num_rows, num_layers)
    _check_zero_layers(trace, where, routed_TL)
    if top_k > 1:
        duplicate_R = _duplicate_rows(columns_KR)
        if routed_R is not None:
            duplicate_R &= routed_R
        if duplicate_R.any():
            at, ids = _first_row(trace, where, duplicate_R)
            raise DuplicateExpertError(
                f"{at}: row {ids} names an expert twice ({int(duplicate_R.sum())} such rows); zero "
                "padding was probably used for 'no route' - use -1 instead"
            )


def _first_row(trace: RoutedRows, where: str | int | None, marked_R: np.ndarray) -> tuple[str, list[int]]:
    """Where the first row `marked_R` marks is, and the ids it holds."""
    row, index = divmod(int(np.flatnonzero(marked_R)[0]), trace.experts.shape[1])
    at = location(where, row=row, layer=trace.layers[index], start=trace.start)
    return at, trace.experts[row, index].tolist()


def _check_zero_layers(trace: RoutedRows, where: str | int | None, routed_TL: np.ndarray) -> None:
    # ids are in [-1, E) and no row mixes -1 with ids, so a layer whose largest id is 0 holds
    # only all-zero and all-(-1) rows
    num_rows, num_layers, top_k = trace.experts.shape
    layer_max_L = trace.experts.reshape(num_rows, num_layers * top_k).max(axis=0).reshape(num_layers, top_k).max(axis=1)
    if not (layer_max_L == 0).any():
        return
    routed_rows_L = routed_TL.sum(axis=0)
    threshold = 1 if top_k > 1 else ZERO_LAYER_MIN_ROWS_K1
    all_zero_L = (layer_max_L == 0) & (routed_rows_L >= threshold)
    if all_zero_L.any():
        layer_numbers = [trace.layers[i] for i in np.flatnonzero(all_zero_L)]
        raise ZeroLayerError(
            f"{location(where)}: MoE layer(s) {layer_numbers} are all zeros over "
            f"{int(routed_rows_L[all_zero_L].max())} routed rows: the engine's capture failed "
            "there (known: vLLM FlashInfer TRT-LLM/NVFP4, SGLang pipeline stages). If these are "
            "dense layers of an all-layer payload, pass moe_layers= (CLI: --moe-layers) to drop them"
        )


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
