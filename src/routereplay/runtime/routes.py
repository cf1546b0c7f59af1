"""Batch routes <-> per-sequence traces, and the checks a replay batch must pass.

A batch's routes are an int tensor `routes_BSLK` aligned with the model input (B rows of S
positions, L bound layers in order, K experts), -1 where there is no route. Sequences map onto it
through the attention mask: the i-th attended position of row b is token i of sequence b, so left
padding, right padding and packed rows all work the same.

A layer with several routers has a column per router (`slots`: each column's router slot in its
layer, see `RouteTrace.columns`); traces are matched to the model by (layer, slot) column.

Legend: B = batch rows, S = positions per row, L = layer columns, K = top-k, T = tokens of one sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from routereplay.enums import ReplayOrder, Source
from routereplay.errors import (
    BatchShapeError,
    ConfigError,
    DtypeError,
    ExpertIdRangeError,
    LayerCountError,
    OrderLostError,
    TopKMismatchError,
)
from routereplay.runtime.alignment import check_coverage, refuse_meta
from routereplay.runtime.tensor_forms import native_array, refuse_unreadable
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype

INT64_MAX = np.iinfo(np.int64).max
MASK_VALUES = (
    "the attention mask is the (B, S) padding mask: 0 = padding, a non-negative integer (1, or a packed row's "
    "segment id) = attended, as bool, int or float"
)


def traces_to_routes(
    traces: Sequence[RouteTrace],
    attention_mask: torch.Tensor | np.ndarray,
    layers: Sequence[int],
    top_k: int,
    *,
    check_alignment: bool = True,
    slots: Sequence[str] | None = None,
) -> torch.Tensor:
    """(B, S, L, K) int routes for a padded batch: token i of sequence b gets row i - start of its trace.

    With `check_alignment`, a trace that stops short of the sequence's last attended token (more
    than the one token engines never route) is a `PaddingMismatchError`."""
    mask_BS = _mask(attention_mask)
    batch, positions = mask_BS.shape
    if len(traces) != batch:
        raise BatchShapeError(
            f"got {len(traces)} traces for a batch of {batch} rows (attention_mask {tuple(mask_BS.shape)})"
        )
    num_experts = max((t.num_experts for t in traces), default=1)
    routes_BSLK = np.full((batch, positions, len(layers), top_k), -1, dtype=canonical_dtype(num_experts))
    for b, trace in enumerate(traces):
        trace = _on_columns(trace, layers, slots, b)
        if trace.top_k != top_k:
            raise TopKMismatchError(f"sequence {b}: trace has top-k {trace.top_k}, the model's routers use {top_k}")
        attended_T = np.flatnonzero(mask_BS[b])
        tokens = attended_T.size
        if trace.stop > tokens:
            raise BatchShapeError(
                f"sequence {b}: trace covers tokens {trace.start}..{trace.stop} but the attention mask attends to only "
                f"{tokens} positions; routes and token ids are misaligned"
            )
        if check_alignment:
            check_coverage(trace, b, tokens)
        routes_BSLK[b, attended_T[trace.start : trace.stop]] = trace.experts
    return torch.from_numpy(routes_BSLK)


def routes_to_traces(
    routes_BSLK: torch.Tensor,
    attention_mask: torch.Tensor,
    layers: Sequence[int],
    num_experts: int,
    source: Source | str = Source.TRAINER,
    policy_version: int | None = None,
    input_ids: torch.Tensor | None = None,
    slots: Sequence[str] | None = None,
) -> list[RouteTrace]:
    """Per-sequence traces from batch routes: attended positions only, padding dropped.

    With `input_ids` (B, S') the traces carry the token id of every row (`RouteTrace.token_ids`)."""
    mask_BS = _mask(attention_mask)
    if tuple(mask_BS.shape) != tuple(routes_BSLK.shape[:2]):
        if mask_BS.shape[0] == routes_BSLK.shape[0] and mask_BS.shape[1] >= routes_BSLK.shape[1]:
            mask_BS = mask_BS[:, : routes_BSLK.shape[1]]  # generation: the last sampled token has no route
        else:
            raise BatchShapeError(
                f"attention_mask has shape {tuple(mask_BS.shape)} but routes cover {tuple(routes_BSLK.shape[:2])}"
            )
    routes = routes_BSLK.detach().cpu().numpy()
    ids_BS = None
    if input_ids is not None:
        refuse_meta(input_ids, "input_ids")
        if isinstance(input_ids, torch.Tensor) and (
            input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool
        ):
            raise ConfigError(f"input_ids has dtype {input_ids.dtype}; token ids are integers (pass the batch's ids)")
        try:
            ids_BS = np.asarray(input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids)
        except (ValueError, TypeError) as error:  # ragged nested lists
            raise ConfigError(f"input_ids is not a (B, S) integer array ({error})") from None
        if ids_BS.dtype.kind not in "iu":
            raise ConfigError(f"input_ids has dtype {ids_BS.dtype}; token ids are integers (pass the batch's ids)")
        if ids_BS.ndim != 2 or ids_BS.shape[0] != routes.shape[0] or ids_BS.shape[1] < routes.shape[1]:
            raise BatchShapeError(
                f"input_ids has shape {ids_BS.shape} but the routes cover (B, S) = {tuple(routes.shape[:2])}"
            )
        ids_BS = ids_BS[:, : routes.shape[1]]
    traces = []
    for b in range(routes.shape[0]):
        experts_TLK = routes[b, mask_BS[b]]
        segments = (Segment(0, len(experts_TLK), source, policy_version),) if len(experts_TLK) else ()
        token_ids = None if ids_BS is None else ids_BS[b, mask_BS[b]]
        traces.append(RouteTrace(experts_TLK, num_experts, tuple(layers), 0, segments, token_ids, slots=slots))
    return traces


def check_routes(
    routes_BSLK: torch.Tensor,
    layers: Sequence[int],
    top_k: int,
    num_experts: int,
    slots: Sequence[str] | None = None,
) -> np.ndarray:
    """Validate a replay batch (shape, ids, partial and duplicate rows) and return its host copy (numpy).

    Routes on the host (numpy, a CPU tensor: as decoded from an engine) are read in place; routes on a
    device cost one device->host copy, a host sync (`runtime/transfer.py`)."""
    if not isinstance(routes_BSLK, torch.Tensor):
        raise ConfigError(
            f"routes must be a (B, S, L, K) int tensor or a list of RouteTrace, got {type(routes_BSLK).__name__}"
        )
    refuse_meta(routes_BSLK, "routes")
    if routes_BSLK.is_floating_point() or routes_BSLK.is_complex() or routes_BSLK.dtype == torch.bool:
        raise DtypeError(f"routes tensor has dtype {routes_BSLK.dtype}; expert ids are integers")
    if routes_BSLK.dim() != 4:
        raise BatchShapeError(f"routes must have shape (B, S, L, K), got {tuple(routes_BSLK.shape)}")
    batch, positions, num_layers, k = routes_BSLK.shape
    if num_layers != len(layers):
        raise LayerCountError(
            f"routes have {num_layers} layers, the model has {len(layers)} bound routers (layers {list(layers)}); "
            "select the MoE layers (moe_layers=) when decoding"
        )
    if k != top_k:
        raise TopKMismatchError(f"routes have top-k {k}, the model's routers use top-k {top_k}")
    host_BSLK: np.ndarray = routes_BSLK.detach().cpu().numpy()
    flat = host_BSLK.reshape(batch * positions, num_layers, k)
    RouteTrace(flat, num_experts, tuple(layers), slots=slots).validate("replay batch (token = b * S + s)")
    return host_BSLK


def replay_routes(routes: object) -> torch.Tensor | list[RouteTrace]:
    """`routes=` of `Replayer.replay`: a tensor as given, an int numpy array as a tensor (shared memory where
    torch can share it), RouteTraces (a list, tuple or any iterable of them) as a list; anything else is a
    `ConfigError` naming the accepted forms."""
    if isinstance(routes, torch.Tensor):
        refuse_unreadable(routes, "routes")
        return routes
    if isinstance(routes, np.ndarray):
        return routes_tensor(routes, "routes array")
    forms = "a (B, S, L, K) int tensor or numpy array aligned with the input, or a list of RouteTrace (one per row)"
    if isinstance(routes, (str, bytes, bytearray, Mapping)) or not isinstance(routes, Iterable):
        raise ConfigError(
            f"routes is a {type(routes).__name__}: routes must be {forms}; decode an engine payload with "
            "routereplay.decode_vllm / decode_sglang first"
        )
    traces = list(routes)
    for index, trace in enumerate(traces):
        if not isinstance(trace, RouteTrace):
            raise ConfigError(
                f"routes[{index}] is a {type(trace).__name__}: routes must be {forms}; decode an engine payload with "
                "routereplay.decode_vllm / decode_sglang, or pass np.asarray(routes) for a (B, S, L, K) nested list"
            )
    return traces


def routes_tensor(routes: np.ndarray, name: str) -> torch.Tensor:
    """An int numpy array of routes as a tensor: any byte order, strides or integer width (uint16..uint64 as
    int64, which torch serves); a non-integer dtype is a `DtypeError`, a uint64 id beyond int64 (which a cast
    would wrap to -1, a silent "no route") an `ExpertIdRangeError`."""
    if routes.dtype.kind not in "iu":
        raise DtypeError(f"{name} has dtype {routes.dtype}; expert ids are integers (-1 = no route)")
    if routes.dtype.kind == "u" and routes.dtype.itemsize == 8 and routes.size and int(routes.max()) > INT64_MAX:
        raise ExpertIdRangeError(
            f"{name} holds uint64 id {int(routes.max())}, beyond any expert; pass ids in [0, E) (-1 = none)"
        )
    if routes.dtype.kind == "u" and routes.dtype.itemsize > 1:  # torch has few ops on uint16/32/64
        routes = routes.astype(np.int64)
    return torch.from_numpy(native_array(routes))


def replay_order(order: ReplayOrder | str) -> ReplayOrder:
    """`order=` of `Replayer.replay`, checked."""
    try:
        return ReplayOrder(order)
    except ValueError:
        raise ConfigError(f"order={order!r}: use 'set' (default) or 'engine'") from None


def refuse_unordered(traces: Sequence[RouteTrace]) -> None:
    """order='engine' needs traces that kept the top-k order: `OrderLostError` otherwise."""
    lost = [i for i, trace in enumerate(traces) if not trace.ordered]
    if lost:
        raise OrderLostError(
            f"order='engine' forces the routes' top-k order, but traces {lost[:8]} keep only the expert set "
            "(a set codec or sorted rows); store them with codec_mode='ordered', or replay with order='set'"
        )


def _on_columns(trace: RouteTrace, layers: Sequence[int], slots: Sequence[str] | None, index: int) -> RouteTrace:
    columns = tuple(zip((int(x) for x in layers), slots or ("",) * len(layers), strict=True))
    if trace.columns == columns:
        return trace
    missing = sorted(set(columns) - set(trace.columns))
    if missing:
        shown = [c[0] for c in missing] if slots is None else missing
        raise LayerCountError(
            f"sequence {index}: trace has layers {list(trace.layers)} but the model routes in layers {list(layers)} "
            f"(missing {shown}); decode the payload with moe_layers= set to the model's MoE layers"
            + ("" if slots is None else f"; the model's router slots are {list(columns)}, the trace's {trace.slots}")
        )
    return trace.select_columns(columns)


def _mask(attention_mask: torch.Tensor | np.ndarray) -> np.ndarray:
    refuse_unreadable(attention_mask, "attention_mask")
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.is_complex():
            raise ConfigError(f"attention_mask has dtype {attention_mask.dtype}; {MASK_VALUES}")
        host = attention_mask.detach().cpu()
        if host.is_floating_point() and host.dtype not in (torch.float16, torch.float32, torch.float64):
            host = host.float()  # bfloat16, float8: no numpy dtype
        mask = host.numpy()
    else:
        try:
            mask = np.asarray(attention_mask)
        except (ValueError, TypeError) as error:  # ragged nested lists
            raise ConfigError(f"attention_mask is not a (B, S) array ({error}); {MASK_VALUES}") from None
    if mask.ndim != 2:
        raise BatchShapeError(f"attention_mask must be (B, S), got shape {mask.shape}")
    if mask.dtype.kind not in "biuf":
        raise ConfigError(f"attention_mask has dtype {mask.dtype}; {MASK_VALUES}")
    if mask.dtype.kind in "if":  # negative (additive masks: 0 / -inf), fractional, NaN or inf entries
        with np.errstate(invalid="ignore"):
            bad_BS = ~(mask >= 0)
            if mask.dtype.kind == "f":
                bad_BS |= ~np.isfinite(mask) | (mask != np.floor(mask))
        if bad_BS.any():
            b, s = (int(i) for i in np.argwhere(bad_BS)[0])
            raise ConfigError(
                f"attention_mask[{b}, {s}] = {mask[b, s].item()!r} ({int(bad_BS.sum())} such entries); {MASK_VALUES} "
                "(an additive mask of 0 / -inf, or a 4-D mask, is not the batch's padding mask)"
            )
    return mask.astype(bool)


def mask_array(attention_mask: torch.Tensor | np.ndarray) -> np.ndarray:
    """The (B, S) attention mask as a bool array (meta tensors and other ranks refused)."""
    return _mask(attention_mask)


__all__ = [
    "check_routes",
    "mask_array",
    "refuse_unordered",
    "replay_order",
    "replay_routes",
    "routes_tensor",
    "routes_to_traces",
    "traces_to_routes",
]
