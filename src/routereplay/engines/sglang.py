"""Decode SGLang's routed experts (every wire form) into a `RouteTrace`.

SGLang records routes when the server runs with `--enable-return-routed-experts` and a request asks
`return_routed_experts: true` (OpenAI endpoints: in `extra_body`). The payload covers token
positions [routed_experts_start_len, seqlen - 1) over every hidden layer:
- `/generate`: `meta_info.routed_experts` = base64 of the RAW flattened int32 bytes (no shape
  header); an optional `meta_info.routed_experts_dtype` (int32 / uint16 / uint8) names another dtype.
- OpenAI-style responses: response-level `sglext.routed_experts` (the protocol code) or per-choice
  `sgl_ext.routed_experts` (the docs); both are checked.
- `skip_tokenizer_init=True`: a raw tensor in `meta_info` (a gateway that JSON-serialises it sends
  `{}`, which is refused with an explanation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.engines.assembler import Expectation, assemble
from routereplay.engines.payload import (
    DEFAULT_MAX_BYTES,
    b64_to_bytes,
    dtype_named,
    get_field,
    is_array_like,
    lists_to_array,
    mapping,
    pick,
    raw_to_array,
    require_present,
    to_numpy,
)
from routereplay.enums import Source
from routereplay.errors import ConfigError, MissingRoutesError, PayloadEncodingError, TraceShapeError, location
from routereplay.trace import RouteTrace

_ABORTED_HINT = (
    "the request was aborted before any forward pass, or it did not ask return_routed_experts: true "
    "(and the server needs --enable-return-routed-experts)"
)


def decode_sglang(
    value: Any,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
    start_len: int = 0,
    num_tokens: int | None = None,
    dtype: str | np.dtype[Any] | None = None,
    layers: Sequence[int] | None = None,
    index: int = 0,
    choice: int = 0,
    sequence: str | int | None = None,
    policy_version: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    validate: bool = True,
) -> RouteTrace:
    """Decode one SGLang request's routed experts into a validated `RouteTrace`.

    `value` is any real wire form: base64 raw bytes, an ndarray/tensor, a `meta_info` dict, a whole
    `/generate` response (a list of them for a batch: `index` picks one), or an OpenAI-style
    response (`choice` picks the choice). `num_layers` is the payload's layer count (every hidden
    layer); `moe_layers` keeps the MoE ones by global number. `start_len` is the request's
    `routed_experts_start_len` (row 0 is token `start_len`). The dtype is `dtype`, else
    `meta_info.routed_experts_dtype`, else int32. Without `num_tokens`, a `meta_info` with
    `prompt_tokens` and `completion_tokens` supplies it, so the row count is always checked there.
    """
    if num_layers < 1 or top_k < 1:
        raise ConfigError(f"num_layers={num_layers} and top_k={top_k} must be >= 1")
    where = sequence if sequence is not None else (f"request {index}" if isinstance(value, list) else None)
    meta, routes = _locate(value, index, choice, where)
    num_tokens_origin = "num_tokens"
    if num_tokens is None and meta is not None:
        prompt_tokens, completion_tokens = (
            get_field(meta, "prompt_tokens", None),
            get_field(meta, "completion_tokens", None),
        )
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            num_tokens = prompt_tokens + completion_tokens
            num_tokens_origin = "meta_info prompt_tokens+completion_tokens"
    if dtype is None and meta is not None and get_field(meta, "routed_experts_dtype", None) is not None:
        dtype = get_field(meta, "routed_experts_dtype")
    what = f"{location(where)} routed_experts"
    experts_TLK = _to_array(routes, dtype, num_layers, top_k, what, max_bytes)
    expect = Expectation(
        num_experts=num_experts,
        layers=layers,
        moe_layers=moe_layers,
        num_layers=num_layers,
        top_k=top_k,
        start=start_len,
        num_tokens=num_tokens,
        num_tokens_origin=num_tokens_origin,
    )
    return assemble(
        experts_TLK, expect, source=Source.SGLANG, sequence=where, policy_version=policy_version, validate=validate
    )


def _locate(value: Any, index: int, choice: int, where: str | int | None) -> tuple[Any, Any]:
    """Return (meta_info or None, routes) from whichever response shape was given."""
    what = f"{location(where)} routed_experts"
    if isinstance(value, list) and value and isinstance(value[0], dict):  # batched /generate
        value = pick(value, index, "requests", what)
    if not isinstance(value, dict):
        return None, require_present(value, what, _ABORTED_HINT)
    if "meta_info" in value:
        value = mapping(value["meta_info"], "meta_info", what)
    if "routed_experts" in value:
        return value, require_present(value["routed_experts"], what, _ABORTED_HINT)
    if "choices" in value:
        found = pick(value["choices"], choice, "choices", what)
        ext = mapping(found, "choices[]", what).get("sgl_ext")
        if ext is not None and "routed_experts" in mapping(ext, "sgl_ext", what):
            return ext, require_present(ext["routed_experts"], what, _ABORTED_HINT)
    if value.get("sglext") is not None and "routed_experts" in mapping(value["sglext"], "sglext", what):
        ext = value["sglext"]
        routes = ext["routed_experts"]
        if isinstance(routes, list) and routes and isinstance(routes[0], str):  # one string per choice
            routes = pick(routes, choice, "sglext.routed_experts", what)
        return ext, require_present(routes, what, _ABORTED_HINT)
    raise MissingRoutesError(
        f"{what}: the response has no routed_experts (looked in meta_info, choices[{choice}].sgl_ext and "
        "sglext); start SGLang with --enable-return-routed-experts and send return_routed_experts: true"
    )


def _to_array(
    routes: Any, dtype: str | np.dtype[Any] | None, num_layers: int, top_k: int, what: str, max_bytes: int
) -> np.ndarray:
    if isinstance(routes, (str, bytes, bytearray)):
        wire_dtype = np.dtype(np.int32) if dtype is None else dtype_named(dtype, what)
        return raw_to_array(b64_to_bytes(routes, what, max_bytes), wire_dtype, num_layers, top_k, what)
    if is_array_like(routes) or isinstance(routes, list):
        array = to_numpy(routes) if is_array_like(routes) else lists_to_array(routes, what)
        if array.ndim == 3 or (array.size == 0 and array.ndim == 1):
            return array.reshape(-1, num_layers, top_k) if array.ndim == 1 else array
        if array.ndim in (1, 2) and array.size % (num_layers * top_k) == 0:
            return array.reshape(-1, num_layers, top_k)
        raise TraceShapeError(
            f"{what}: array of shape {array.shape} cannot be viewed as (tokens, {num_layers}, {top_k}); "
            "check num_layers (every hidden layer) and top_k"
        )
    if isinstance(routes, dict):
        raise PayloadEncodingError(
            f"{what}: got a dict ({'empty' if not routes else sorted(routes)[:5]}); with "
            "skip_tokenizer_init=True SGLang puts a raw tensor in meta_info, which a JSON gateway "
            "serialises as {} and loses. Read the tensor in-process, or let SGLang base64-encode it"
        )
    raise PayloadEncodingError(f"{what}: unsupported payload type {type(routes).__name__}")


__all__ = ["decode_sglang"]
