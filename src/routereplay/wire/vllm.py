"""Decode vLLM's routed experts (every version's wire form) into a `RouteTrace`.

vLLM records routes when started with `--enable-return-routed-experts`:
- <= 0.20 offline: `CompletionOutput.routed_experts`, int32 ndarray (num_tokens - 1, L, K).
- 0.21: `RequestOutput.prompt_routed_experts` (prompt rows) + `routed_experts` (generated rows);
  over HTTP both as nested JSON lists, int16, with -1 for prefix-cached positions.
- >= 0.22: one ndarray (uint8 when E <= 256, else uint16) of num_tokens - 1 - prompt_start rows;
  over HTTP `choices[i].routed_experts` is base64 of the `.npy` bytes (np.save, then b64).
The layer axis is every hidden layer (dense layers zero-filled): pass `moe_layers=` to keep the MoE
layers by global number. `None` on a finished choice means the request was aborted before any forward
pass or the flag is off.

Streaming: /v1/completions and /v1/chat/completions streams carry no routes in any chunk (every
version). From vLLM 0.31 the token-in-token-out endpoint /inference/v1/generate also streams them:
only the final chunk of a choice (the one with `finish_reason` set) carries `routed_experts`, covering
the whole sequence; earlier chunks carry `routed_experts: null`, which is not an abort. `decode_vllm`
takes that final chunk parsed, or the whole server-sent-event text (it finds the final chunk of
`choice` itself); a mid-stream chunk is refused as such (`StreamedResponseError`). A chunk's
`token_ids` holds only that chunk's tokens: `num_tokens` is the prompt plus the sum over chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.enums import Source
from routereplay.errors import (
    MissingRoutesError,
    PayloadEncodingError,
    StreamedResponseError,
    TraceShapeError,
    location,
)
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
    has_field,
    is_array_like,
    lists_to_array,
    load_npy,
    pick_choice,
    require_present,
    to_numpy,
)

_ABORTED_HINT = (
    "the request was aborted (or preempted) before any forward pass, or the server runs without "
    "--enable-return-routed-experts (streams carry routes only on /inference/v1/generate's final chunk, "
    "vLLM >= 0.31)"
)


def decode_vllm(
    value: Any,
    *,
    num_experts: int,
    layers: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
    prompt_value: Any = None,
    num_tokens: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    prompt_start: int = 0,
    choice: int = 0,
    sequence: str | int | None = None,
    policy_version: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    validate: bool = True,
    limits: WireLimits = DEFAULT_LIMITS,
) -> RouteTrace:
    """Decode one vLLM completion's routed experts into a validated `RouteTrace`.

    `value` is any real wire form: an ndarray/tensor, a base64 `.npy` string (>= 0.22), nested
    lists (0.21; `prompt_value` then holds the prompt rows), or a whole response (dict from the
    OpenAI-compatible server, or `RequestOutput` / `CompletionOutput` objects) from which
    `choices[choice]` (`outputs[choice]`) is read. Pass the parsed JSON, not the response text.
    `prompt_start` is the request's `routed_experts_prompt_start`: row 0 is token `prompt_start`.
    With `num_tokens` (prompt + generated tokens) the row count must be `num_tokens - 1 -
    prompt_start`. `limits` bounds every declared axis before anything is allocated.
    Nothing in a payload marks rows a speculative draft model routed: vLLM before 0.26 could capture
    them into the target's rows, so the engine version is the guard (`engines/vllm/speculative.py`,
    docs/engines.md "Speculative decoding").
    """
    expect = Expectation(
        num_experts=num_experts,
        layers=layers,
        moe_layers=moe_layers,
        num_layers=num_layers,
        top_k=top_k,
        start=prompt_start,
        start_name="prompt_start",
        num_tokens=num_tokens,
        limits=limits,
    )
    choice = checked_int(choice, "choice")
    max_bytes, policy_version, validate, sequence = checked_decoder_args(max_bytes, policy_version, validate, sequence)
    where = f"choice {choice}" if sequence is None else sequence
    value = _final_chunk(value, choice, where, max_bytes)
    value, prompt_value = _locate(value, prompt_value, choice, where)
    what = f"{location(where)} routed_experts"
    routes = _to_array(value, what, max_bytes, limits)
    if prompt_value is not None:
        prompt = _to_array(prompt_value, f"{location(where)} prompt_routed_experts", max_bytes, limits)
        routes = _join(prompt, routes, expect, where)
    else:
        routes = _shape_empty(routes, expect, what)
    return assemble(
        routes, expect, source=Source.VLLM, sequence=where, policy_version=policy_version, validate=validate
    )


def _locate(value: Any, prompt_value: Any, choice: int, where: str | int) -> tuple[Any, Any]:
    """Find routed_experts (and 0.21's prompt_routed_experts) inside a response or output object."""
    _refuse_stream(value, where)
    if value is None or isinstance(value, (str, bytes, bytearray, list, tuple)) or is_array_like(value):
        require_present(value, f"{location(where)} routed_experts", _ABORTED_HINT)
        return value, prompt_value
    response = value
    choices = get_field(response, "choices", None)
    if choices is None:
        choices = get_field(response, "outputs", None)  # offline RequestOutput
    if choices is not None:
        if prompt_value is None:
            prompt_value = get_field(response, "prompt_routed_experts", None)
        response = pick_choice(choices, choice, f"{location(where)} response")
        if isinstance(response, dict) and response.get("routed_experts", 0) is None and _mid_stream(response):
            raise StreamedResponseError(
                f"{location(where)}: a mid-stream chunk (finish_reason null) of a streamed /inference/v1/generate "
                "response; its routed_experts is null because only the final chunk carries the routes, not because "
                "the request was aborted: decode the final chunk, or the whole event stream"
            )
    if not has_field(response, "routed_experts"):
        raise MissingRoutesError(
            f"{location(where)}: the response has no 'routed_experts' field; start vLLM (>= 0.22 for "
            "HTTP) with --enable-return-routed-experts, and do not stream"
        )
    routes = get_field(response, "routed_experts")
    require_present(routes, f"{location(where)} routed_experts", _ABORTED_HINT)
    return routes, prompt_value


_STREAM_HINT = (
    "vLLM's /v1/completions and /v1/chat/completions streams carry no routed_experts in any chunk: send "
    "the request with stream=false, or stream /inference/v1/generate (vLLM >= 0.31), whose final chunk "
    "carries them"
)
SSE_MARKERS = (b"data:", b"event:", b":")


def _mid_stream(choice: dict[str, Any]) -> bool:
    """A choice of a stream chunk that is not its last: `finish_reason` present and null."""
    return "finish_reason" in choice and choice["finish_reason"] is None


def _is_sse(value: Any) -> bool:
    if not isinstance(value, (str, bytes, bytearray)):
        return False
    head = bytes(value[:16]).lstrip() if not isinstance(value, str) else value[:16].lstrip().encode()
    return head.startswith(SSE_MARKERS)


def _final_chunk(value: Any, choice: int, where: str | int, max_bytes: int) -> Any:
    """From server-sent-event text, the parsed chunk that carries `choice`'s routes (the stream's final one).

    Anything else is returned as given. Text longer than twice `max_bytes` (the routes' base64 is 4/3 of
    them, plus token ids) is refused before parsing; a chunk that is not JSON is a `PayloadEncodingError`."""
    if not _is_sse(value):
        return value
    if len(value) > 2 * max_bytes + (1 << 20):
        raise PayloadEncodingError(
            f"{location(where)}: server-sent-event text of {len(value)} bytes exceeds twice max_bytes={max_bytes}; "
            "raise max_bytes if the stream is trusted"
        )
    text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value
    chunks: list[Any] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            chunks.append(json.loads(line[5:]))
        except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
            raise PayloadEncodingError(f"{location(where)}: an event's data is not JSON ({error})") from None
    seen_field = False
    for chunk in reversed(chunks):
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for entry in choices if isinstance(choices, list) else []:
            if not isinstance(entry, dict) or entry.get("index", 0) != choice or "routed_experts" not in entry:
                continue
            seen_field = True
            if entry["routed_experts"] is not None:
                return {**chunk, "choices": [{**entry, "index": choice}]}
    if seen_field:
        raise MissingRoutesError(
            f"{location(where)}: no chunk of the stream carries choice {choice}'s routes; {_ABORTED_HINT}"
        )
    raise StreamedResponseError(f"{location(where)}: got server-sent-event text without routes; {_STREAM_HINT}")


def _refuse_stream(value: Any, where: str | int) -> None:
    """`StreamedResponseError` for server-sent-event text or a parsed chunk of a streamed response.

    vLLM 0.30 marks chat chunks with object "chat.completion.chunk" and a `delta` per choice; a
    completions chunk has object "text_completion" like the whole response, but never `usage`
    (which every non-streaming completions response has), unless it carries routed_experts.
    """
    if isinstance(value, (str, bytes, bytearray)):
        if _is_sse(value):
            raise StreamedResponseError(f"{location(where)}: got server-sent-event text; {_STREAM_HINT}")
        return
    if not isinstance(value, dict):
        return
    kind = value.get("object")
    choices = value.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    chunk = kind == "chat.completion.chunk" or "delta" in first
    chunk = chunk or (kind == "text_completion" and "usage" not in value and "routed_experts" not in first)
    if chunk:
        raise StreamedResponseError(f"{location(where)}: got a chunk of a streamed response; {_STREAM_HINT}")


def _to_array(value: Any, what: str, max_bytes: int, limits: WireLimits) -> np.ndarray:
    if is_array_like(value):
        return to_numpy(value)
    if isinstance(value, (str, bytes, bytearray)):
        return load_npy(b64_to_bytes(value, what, max_bytes), what, limits)
    if isinstance(value, (list, tuple)):
        return lists_to_array(value, what)
    if isinstance(value, dict):
        raise PayloadEncodingError(
            f"{what}: got a dict {sorted(map(str, value))[:5]}; expected base64 .npy text, nested lists or an "
            "array. A tensor that was JSON-serialised by a gateway arrives as {}: return it with np.save"
        )
    raise PayloadEncodingError(f"{what}: unsupported payload type {type(value).__name__}")


def _is_no_rows(array: np.ndarray) -> bool:
    """`[]` on the wire: no rows, and no word on (layers, top_k)."""
    return array.ndim == 1 and array.size == 0


def _shape_empty(array: np.ndarray, expect: Expectation, what: str) -> np.ndarray:
    """Give `[]` the (0, L, K) shape the caller's num_layers / layers and top_k describe."""
    if not _is_no_rows(array):
        return array
    width = expect.num_layers if expect.num_layers is not None else (len(expect.layers) if expect.layers else None)
    if width is None or expect.top_k is None:
        raise TraceShapeError(
            f"{what}: empty list with no shape; pass num_layers (or layers) and top_k to shape a trace of 0 rows"
        )
    return array.reshape(0, width, expect.top_k)


def _join(prompt: np.ndarray, generated: np.ndarray, expect: Expectation, where: str | int) -> np.ndarray:
    """vLLM 0.21's prompt rows + generated rows as one (T, L, K) array; `[]` is a part with no rows."""
    parts = {"prompt_routed_experts": prompt, "routed_experts": generated}
    for name, part in parts.items():
        if not _is_no_rows(part) and part.ndim != 3:
            raise TraceShapeError(
                f"{location(where)}: {name} has shape {part.shape[:6]}; each row must hold L lists of K ids "
                "([T][L][K]); an empty part is [] (no rows), not [[]]"
            )
    if _is_no_rows(prompt) and _is_no_rows(generated):
        return _shape_empty(generated, expect, f"{location(where)} prompt_routed_experts + routed_experts")
    if _is_no_rows(prompt):
        return generated
    if _is_no_rows(generated):
        return prompt
    if prompt.shape[1:] != generated.shape[1:]:
        raise TraceShapeError(
            f"{location(where)}: prompt routes have (layers, top_k) {prompt.shape[1:]} but "
            f"generated routes have {generated.shape[1:]}; both must come from the same model"
        )
    return np.concatenate([prompt, generated], axis=0)


__all__ = ["decode_vllm"]
