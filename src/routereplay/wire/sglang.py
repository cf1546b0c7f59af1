"""Decode SGLang's routed experts (every wire form) into a `RouteTrace`.

SGLang records routes when the server runs with `--enable-return-routed-experts` and a request asks
`return_routed_experts: true` (OpenAI endpoints: in `extra_body`). The payload covers token
positions [routed_experts_start_len, seqlen - 1) over every hidden layer:
- `/generate`: `meta_info.routed_experts` = base64 of the RAW flattened int32 bytes (no shape
  header); an optional `meta_info.routed_experts_dtype` (int32 / uint16 / uint8) names another dtype.
- OpenAI-style responses: response-level `sglext.routed_experts` (the protocol code) or per-choice
  `sgl_ext.routed_experts` (the docs); both are checked. With n > 1, SGLang fills the
  response-level field from the first choice only (`_build_chat_response` reads `ret[0]`), so
  it is accepted for `choice=0` alone; any other choice raises `AmbiguousChoiceError` unless the
  choice carries its own `sgl_ext` (or the field is a list with one entry per choice). A response
  rebuilt from an n > 1 *stream* is not covered: there SGLang sends the first choice it holds
  routes for, not necessarily choice 0, and no decoder can tell - stream with n = 1, or do not stream.
- NVIDIA Dynamo's frontend (ai-dynamo/dynamo #9657) relays the same raw int32 base64 in an `nvext`
  envelope, per choice or response-level; it is read exactly like `sgl_ext` / `sglext`.
- `skip_tokenizer_init=True`: a raw tensor in `meta_info` (a gateway that JSON-serialises it sends
  `{}`, which is refused with an explanation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from routereplay.enums import Source
from routereplay.errors import (
    AmbiguousChoiceError,
    ConfigError,
    MissingRoutesError,
    PayloadEncodingError,
    TraceShapeError,
    location,
)
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.assembler import Expectation, assemble, raise_wrong_split
from routereplay.wire.limits import (
    DEFAULT_LIMITS,
    MAX_INT_ARGUMENT,
    WireLimits,
    checked_decoder_args,
    checked_int,
    is_int,
)
from routereplay.wire.payload import (
    DEFAULT_MAX_BYTES,
    b64_to_bytes,
    dtype_named,
    get_field,
    is_array_like,
    lists_to_array,
    mapping,
    pick,
    pick_choice,
    raw_to_array,
    require_present,
    to_numpy,
)

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
    limits: WireLimits = DEFAULT_LIMITS,
) -> RouteTrace:
    """Decode one SGLang request's routed experts into a validated `RouteTrace`.

    `value` is any real wire form: base64 raw bytes, an ndarray/tensor, a `meta_info` dict, a whole
    `/generate` response (a list of them for a batch: `index` picks one), or an OpenAI-style
    response (`choice` picks the choice). `num_layers` is the payload's layer count (every hidden
    layer); `moe_layers` keeps the MoE ones by global number. `start_len` is the request's
    `routed_experts_start_len` (row 0 is token `start_len`). The dtype is `dtype`, else
    `meta_info.routed_experts_dtype`, else int32. Without `num_tokens`, a `meta_info` with
    `prompt_tokens` and `completion_tokens` supplies it, so the row count is always checked there.
    The payload has no shape header: when its ids fit another (num_layers, top_k) split better,
    the error lists the splits that fit. `limits` bounds every axis before allocation.
    """
    expect = Expectation(
        num_experts=num_experts,
        layers=layers,
        moe_layers=moe_layers,
        num_layers=checked_int(num_layers, "num_layers", minimum=1),
        top_k=checked_int(top_k, "top_k", minimum=1),
        start=start_len,
        start_name="start_len",
        num_tokens=num_tokens,
        flat_layout=True,
        limits=limits,
    )
    index = checked_int(index, "index")
    choice = checked_int(choice, "choice")
    max_bytes, policy_version, validate, sequence = checked_decoder_args(max_bytes, policy_version, validate, sequence)
    where = sequence if sequence is not None else (f"request {index}" if isinstance(value, list) else None)
    meta, routes = _locate(value, index, choice, where)
    if expect.num_tokens is None and meta is not None:
        prompt_tokens, completion_tokens = (
            get_field(meta, "prompt_tokens", None),
            get_field(meta, "completion_tokens", None),
        )
        if (
            is_int(prompt_tokens)
            and is_int(completion_tokens)
            and 0 <= prompt_tokens < MAX_INT_ARGUMENT // 2
            and 0 <= completion_tokens < MAX_INT_ARGUMENT // 2
        ):
            total = int(prompt_tokens) + int(completion_tokens)
            if total >= 1:
                expect = replace(
                    expect, num_tokens=total, num_tokens_origin="meta_info prompt_tokens+completion_tokens"
                )
    if dtype is None and meta is not None and get_field(meta, "routed_experts_dtype", None) is not None:
        dtype = get_field(meta, "routed_experts_dtype")
    what = f"{location(where)} routed_experts"
    experts_TLK = _to_array(routes, dtype, expect, what, max_bytes, where)
    return assemble(
        experts_TLK, expect, source=Source.SGLANG, sequence=where, policy_version=policy_version, validate=validate
    )


CHOICE_EXTENSIONS = ("sgl_ext", "nvext")  # per-choice envelopes: SGLang's docs, NVIDIA Dynamo's frontend
RESPONSE_EXTENSIONS = ("sglext", "nvext")  # response-level envelopes: SGLang's protocol code, Dynamo


def _locate(value: Any, index: int, choice: int, where: str | int | None) -> tuple[Any, Any]:
    """Return (meta_info or None, routes) from whichever response shape was given."""
    what = f"{location(where)} routed_experts"
    if isinstance(value, list) and value and isinstance(value[0], dict):  # batched /generate
        value = pick(value, index, "requests", what)
    if not isinstance(value, dict):
        return None, require_present(value, what, _ABORTED_HINT)
    if "choices" not in value and not any(k in value for k in RESPONSE_EXTENSIONS) and choice != 0:
        raise ConfigError(
            f"{what}: choice={choice} picks a choice of an OpenAI-style response, but this is a /generate "
            "result or meta_info (one sample); a /generate batch is a list, indexed by index="
        )
    if "meta_info" in value:
        value = mapping(value["meta_info"], "meta_info", what)
    if "routed_experts" in value:
        return value, require_present(value["routed_experts"], what, _ABORTED_HINT)
    num_choices = None
    if "choices" in value:
        choices = value["choices"]
        found = mapping(pick_choice(choices, choice, what), "choices[]", what)
        num_choices = len(choices)
        for key in CHOICE_EXTENSIONS:
            ext = found.get(key)
            if ext is not None and "routed_experts" in mapping(ext, key, what):
                return ext, require_present(ext["routed_experts"], what, _ABORTED_HINT)
    for key in RESPONSE_EXTENSIONS:
        if value.get(key) is not None and "routed_experts" in mapping(value[key], key, what):
            ext = value[key]
            return ext, require_present(
                _response_level(ext["routed_experts"], choice, num_choices, what), what, _ABORTED_HINT
            )
    raise MissingRoutesError(
        f"{what}: the response has no routed_experts (looked in meta_info, choices[{choice}].sgl_ext / .nvext, "
        "sglext and nvext); start SGLang with --enable-return-routed-experts and send return_routed_experts: true"
    )


def _response_level(routes: Any, choice: int, num_choices: int | None, what: str) -> Any:
    """The asked choice's routes from a response-level `sglext.routed_experts`, or a named refusal."""
    if isinstance(routes, list) and routes and all(isinstance(r, str) or r is None for r in routes):
        if num_choices is not None and len(routes) != num_choices:
            raise AmbiguousChoiceError(
                f"{what}: sglext.routed_experts lists {len(routes)} payloads for {num_choices} choices; which "
                "belongs to which cannot be told. Send n=1 requests, or read each choice's sgl_ext"
            )
        return pick(routes, choice, "sglext.routed_experts", what)
    if choice != 0:
        raise AmbiguousChoiceError(
            f"{what}: choice={choice} asked, but the routes sit in the response-level sglext.routed_experts, "
            f"which SGLang fills from the first choice only ({num_choices or 'unknown number of'} choices here): "
            "they are choice 0's. Send one request per sample (n=1), or use a build that puts sgl_ext on each choice"
        )
    return routes


def _to_array(
    routes: Any, dtype: Any, expect: Expectation, what: str, max_bytes: int, where: str | int | None
) -> np.ndarray:
    num_layers, top_k = expect.num_layers, expect.top_k
    assert num_layers is not None and top_k is not None  # decode_sglang passes both
    if isinstance(routes, (str, bytes, bytearray)):
        wire_dtype = np.dtype(np.int32) if dtype is None else dtype_named(dtype, what)
        data = b64_to_bytes(routes, what, max_bytes)
        if len(data) % (num_layers * top_k * wire_dtype.itemsize) and len(data) % wire_dtype.itemsize == 0:
            head = (
                f"{location(where)}: {len(data)} bytes of {wire_dtype} do not split into rows of "
                f"num_layers({num_layers}) x top_k({top_k})"
            )
            raise_wrong_split(len(data) // wire_dtype.itemsize, expect, num_layers, top_k, where, head)
        return raw_to_array(data, wire_dtype, num_layers, top_k, what)
    if is_array_like(routes) or isinstance(routes, list):
        array = to_numpy(routes) if is_array_like(routes) else lists_to_array(routes, what)
        if array.ndim == 3:
            return array
        if array.size == 0 and array.ndim == 1:
            return array.reshape(0, num_layers, top_k)
        if array.ndim in (1, 2) and array.size % (num_layers * top_k) == 0:
            return array.reshape(-1, num_layers, top_k)
        if array.ndim in (1, 2):
            head = (
                f"{location(where)}: {array.size} ids do not split into rows of "
                f"num_layers({num_layers}) x top_k({top_k})"
            )
            raise_wrong_split(array.size, expect, num_layers, top_k, where, head)
        raise TraceShapeError(
            f"{what}: array of shape {array.shape[:6]} cannot be viewed as (tokens, {num_layers}, {top_k}); "
            "check num_layers (every hidden layer) and top_k"
        )
    if isinstance(routes, dict):
        raise PayloadEncodingError(
            f"{what}: got a dict ({'empty' if not routes else sorted(map(str, routes))[:5]}); with "
            "skip_tokenizer_init=True SGLang puts a raw tensor in meta_info, which a JSON gateway "
            "serialises as {} and loses. Read the tensor in-process, or let SGLang base64-encode it"
        )
    raise PayloadEncodingError(f"{what}: unsupported payload type {type(routes).__name__}")


__all__ = ["decode_sglang"]
