"""What combine weights given to `replay(weights=...)` may hold, checked before anything is allocated.

Weights are a float (B, S, L, K) tensor (or numpy array) aligned like the routes: `weights[b, s, l, k]`
is the weight the engine gave expert `routes[b, s, l, k]`, so they follow the routes' own order (the
engine's); replay maps each one to its expert id, so set order and engine order both work. A row whose
route is -1 keeps the live weights and must hold zeros there. Refused, by name, before the context opens:
- a shape other than the routes' or a non-float dtype (`WeightsShapeError`); a numpy array of any float width
  (float16 .. longdouble), byte order or strides is read as float32, and a tensor with no plain values
  (meta, sparse, nested, quantized) is a `ConfigError` (`runtime/tensor_forms.py`);
- NaN, infinite or negative weights, weights beyond float32's range, a row whose weights sum beyond it, or
  non-zero weights on a -1 route row (`WeightsValueError`), all before any sum comparison;
- for a router that says it normalises its top-k (`norm_topk_prob=True` on the router, its block or
  their config), rows of one layer that do not all sum to one value within `SUM_RTOL`
  (`WeightsSumError`). The value itself (1, or a scaling factor applied before the experts, as
  DeepSeek-V3 does, or after them, as Beam does) is checked against the router's own rows at each
  experts call (`runtime/gate_weights/forcing.py`).

Legend: B = batch rows, S = positions, L = bound layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from routereplay.errors import ConfigError, WeightsShapeError, WeightsSumError, WeightsValueError
from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.gate_weights.experts import ExpertsSite, experts_sites
from routereplay.runtime.routes import mask_array
from routereplay.runtime.tensor_forms import native_array, refuse_unreadable
from routereplay.trace.route_trace import RouteTrace

SUM_RTOL = 1e-2  # row sums are compared with this relative tolerance (fp16 storage, bf16 engines)


def checked_weights(weights: Any, routes_BSLK: torch.Tensor, sites: Sequence[RouterSite]) -> torch.Tensor:
    """`weights` as a float32 (B, S, L, K) CPU tensor, after every check of the module docstring."""
    shape = tuple(routes_BSLK.shape)
    if isinstance(weights, np.ndarray):
        if weights.dtype.kind != "f":
            raise WeightsShapeError(f"weights must be floating point, got numpy {weights.dtype}")
        _check_shape(weights.shape, shape)
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below as not finite in float32
            weights = torch.from_numpy(native_array(weights.astype(np.float32, copy=False)))
    if not isinstance(weights, torch.Tensor):
        raise WeightsShapeError(
            f"weights must be a (B, S, L, K) float tensor aligned with the routes, got {type(weights).__name__}"
        )
    refuse_unreadable(weights, "weights")
    if not weights.is_floating_point():
        raise WeightsShapeError(f"weights must be floating point, got {weights.dtype}")
    _check_shape(tuple(weights.shape), shape)
    weights_BSLK = weights.detach().to("cpu", torch.float32)
    missing_BSL = (routes_BSLK[..., 0] < 0).cpu()
    bad = ~torch.isfinite(weights_BSLK)
    _refuse(bad, "is not finite in float32 (NaN, inf, or beyond float32's +-3.4e38)", sites)
    _refuse(weights_BSLK < 0, "is negative", sites)
    _refuse((weights_BSLK != 0) & missing_BSL[..., None], "is non-zero on a row whose route is -1", sites)
    sums_BSL = weights_BSLK.sum(-1)  # float32, as the experts combine them: a row beyond its range is inf
    over_BSL = ~torch.isfinite(sums_BSL)
    if bool(over_BSL.any()):  # before any sum comparison, which would blame the normalisation
        b, s, column = (int(i) for i in over_BSL.nonzero()[0])
        raise WeightsValueError(
            f"weights of batch row {b}, position {s}, layer {sites[column].layer} sum to "
            f"{float(weights_BSLK[b, s, column].double().sum()):.4g}, which is not finite in float32 (beyond "
            f"float32's +-3.4e38; {int(over_BSL.sum())} such rows): combine weights are the engine's, of the "
            "router's scale (a top-k row sums to about 1, or the model's scaling factor)"
        )
    for column, site in enumerate(sites):
        if not says_normalised(site):
            continue
        sums_BS = sums_BSL[:, :, column]
        routed_BS = ~missing_BSL[:, :, column]
        if not bool(routed_BS.any()):
            continue
        level = float(sums_BS[routed_BS].median())
        off_BS = routed_BS & ((sums_BS - level).abs() > SUM_RTOL * abs(level))
        if bool(off_BS.any()):
            b, s = (int(i) for i in off_BS.nonzero()[0])
            raise WeightsSumError(
                f"weights of batch row {b}, position {s}, layer {site.layer} sum to {float(sums_BS[b, s]):.6g}, but "
                f"the layer's other rows to {level:.6g}, and {site.family} normalises every top-{site.top_k} row to "
                "one value: pass the weights the engine's experts received (normalised, scaled) for these routes"
            )
    return weights_BSLK


def _check_shape(given: tuple[int, ...], routes: tuple[int, ...]) -> None:
    if given != routes:
        raise WeightsShapeError(
            f"weights have shape {given} but the routes {routes} (B, S, L, K): "
            "give one weight per routed expert, aligned like the routes"
        )


def replay_weights(
    sites: Sequence[RouterSite],
    routes_BSLK: torch.Tensor,
    weights: Any,
    traces: Sequence[RouteTrace] | None,
    attention_mask: torch.Tensor | np.ndarray | None,
) -> tuple[list[ExpertsSite], torch.Tensor, torch.Tensor] | None:
    """What `replay(weights=...)` forces: (experts sites, routes, checked weights), or None when off.

    `weights=True` takes them from the RouteTraces' `weights`, placed like their routes."""
    if weights is None or weights is False:
        return None
    experts = experts_sites(sites)
    if weights is True:
        if traces is None or attention_mask is None:
            raise ConfigError("weights=True takes the weights from RouteTraces: pass traces and attention_mask")
        weights = traces_to_weights(traces, attention_mask, routes_BSLK.shape, [s.layer for s in sites])
    return experts, routes_BSLK, checked_weights(weights, routes_BSLK, sites)


def traces_to_weights(
    traces: Sequence[RouteTrace], attention_mask: torch.Tensor | np.ndarray, shape: Sequence[int], layers: Sequence[int]
) -> torch.Tensor:
    """(B, S, L, K) float32 weights of traces carrying them, placed like `traces_to_routes` places routes
    (token i of sequence b at the i-th attended position of row b); 0 where a trace has no row."""
    mask_BS = mask_array(attention_mask)
    weights_BSLK = torch.zeros(tuple(shape), dtype=torch.float32)
    for b, trace in enumerate(traces):
        if trace.weights is None:
            raise WeightsShapeError(
                f"trace {b} carries no weights: record them (`record(weights=True)`, an engine capturing weights), "
                "or replay without weights=True"
            )
        if tuple(trace.layers) != tuple(layers):
            raise WeightsShapeError(f"trace {b}'s layers {trace.layers} are not the model's {tuple(layers)}")
        positions = np.flatnonzero(mask_BS[b])[trace.start : trace.start + trace.num_tokens]
        weights_BSLK[b, positions] = torch.from_numpy(trace.weights[: len(positions)].astype(np.float32))
    return weights_BSLK


def says_normalised(site: RouterSite) -> bool:
    """True when the router says it normalises its top-k weights (`norm_topk_prob=True` on the router, its
    block or their config): every row then sums to one value (1, or a scaling factor applied before or
    after the experts, which the family decides), checked across the given rows."""
    owners = [site.router, site.block, getattr(site.router, "config", None), getattr(site.block, "config", None)]
    flags = [getattr(o, "norm_topk_prob", None) for o in owners if o is not None]
    return next((f for f in flags if isinstance(f, bool)), None) is True


def _refuse(bad_BSLK: torch.Tensor, what: str, sites: Sequence[RouterSite]) -> None:
    if not bool(bad_BSLK.any()):
        return
    b, s, column, k = (int(i) for i in bad_BSLK.nonzero()[0])
    raise WeightsValueError(
        f"weight {k} of batch row {b}, position {s}, layer {sites[column].layer} {what} "
        f"({int(bad_BSLK.sum())} such weights): combine weights are finite, >= 0, and 0 where the route is -1"
    )


__all__ = ["SUM_RTOL", "checked_weights", "replay_weights", "says_normalised", "traces_to_weights"]
