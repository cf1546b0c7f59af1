"""Decode the routes Megatron-core's inference engine returns (`moe_topk_indices`).

megatron-core >= 0.17 records routing per KV block in a static int32 buffer and returns
`moe_topk_indices` of shape (total_tokens - 1, L, K) in its responses: int16 when E <= 32768
(int32 otherwise), as an array in-process or nested lists over HTTP. Megatron-LM's HTTP server
(0.20, `InferenceClient(deserialize=False)`) wraps it as `["ndarray", {"data": [...], "dtype":
"int16"}]`; the dtype name must be an integer type (`WIRE_INT_DTYPES`) and the values must fit
it. The layer axis holds the model's MoE layers in order unless the caller says otherwise;
`moe_layers` selects from an all-layer payload exactly as for vLLM/SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.enums import Source
from routereplay.errors import MissingRoutesError, PayloadEncodingError, TraceShapeError, location
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.assembler import Expectation, assemble
from routereplay.wire.limits import (
    DEFAULT_LIMITS,
    WireLimits,
    checked_decoder_args,
    checked_int,
)
from routereplay.wire.payload import (
    DEFAULT_MAX_BYTES,
    b64_to_bytes,
    get_field,
    is_array_like,
    is_ndarray_wrapper,
    lists_to_array,
    load_npy,
    pick,
    pick_choice,
    require_present,
    to_numpy,
    unwrap_ndarray,
)

FIELD = "moe_topk_indices"
_ABORTED_HINT = "the request was aborted, or routing capture is off in the Megatron inference engine"


def decode_megatron(
    value: Any,
    *,
    num_experts: int,
    layers: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    num_tokens: int | None = None,
    start: int = 0,
    index: int = 0,
    sequence: str | int | None = None,
    policy_version: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    validate: bool = True,
    limits: WireLimits = DEFAULT_LIMITS,
) -> RouteTrace:
    """Decode one request's `moe_topk_indices` into a validated `RouteTrace`.

    `value` is an array/tensor, nested lists, Megatron's `["ndarray", {"data", "dtype"}]` wrapper,
    base64 `.npy` text, or a response holding the field (at top level, in `choices[index]`, or in
    the `index`-th entry of a list of results). `limits` bounds every axis before allocation.
    """
    expect = Expectation(
        num_experts=num_experts,
        layers=layers,
        moe_layers=moe_layers,
        num_layers=num_layers,
        top_k=top_k,
        start=start,
        num_tokens=num_tokens,
        limits=limits,
    )
    index = checked_int(index, "index")
    max_bytes, policy_version, validate, sequence = checked_decoder_args(max_bytes, policy_version, validate, sequence)
    where = sequence if sequence is not None else f"request {index}"
    routes = _locate(value, index, where)
    what = f"{location(where)} {FIELD}"
    if is_ndarray_wrapper(routes):
        experts_TLK = unwrap_ndarray(routes, what)
    elif is_array_like(routes):
        experts_TLK = to_numpy(routes)
    elif isinstance(routes, (list, tuple)):
        experts_TLK = lists_to_array(routes, what)
    elif isinstance(routes, (str, bytes, bytearray)):
        experts_TLK = load_npy(b64_to_bytes(routes, what, max_bytes), what, limits)
    else:
        raise PayloadEncodingError(f"{what}: unsupported payload type {type(routes).__name__}")
    if experts_TLK.size == 0 and experts_TLK.ndim == 1:  # `[]`: a one-token sequence has no rows
        width = expect.num_layers if expect.num_layers is not None else (len(expect.layers) if expect.layers else None)
        if width is None or expect.top_k is None:
            raise TraceShapeError(f"{what}: empty list; pass num_layers (or layers) and top_k to shape it")
        experts_TLK = experts_TLK.reshape(0, width, expect.top_k)
    return assemble(
        np.asarray(experts_TLK),
        expect,
        source=Source.MEGATRON,
        sequence=where,
        policy_version=policy_version,
        validate=validate,
    )


def _locate(value: Any, index: int, where: str | int) -> Any:
    what = f"{location(where)} {FIELD}"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = pick(value, index, "results", what)
    if not isinstance(value, dict) and get_field(value, FIELD, None) is None:
        return require_present(value, what, _ABORTED_HINT)
    if get_field(value, FIELD, None) is not None:
        return get_field(value, FIELD)
    choices = get_field(value, "choices", None)
    if choices is not None:
        found = get_field(pick_choice(choices, index, what), FIELD, None)
        if found is not None:
            return found
    raise MissingRoutesError(f"{what}: the response carries no {FIELD} ({_ABORTED_HINT})")


__all__ = ["decode_megatron"]
