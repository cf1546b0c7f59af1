"""SkyRL 0.4.0's route forms, decoded: `decode_skyrl` and the `{data, shape, dtype}` envelope.

SkyRL hands a generator one engine call's routes in one of these forms, all (rows, every hidden layer,
top_k) with rows `[routed_experts_prompt_start, prompt + generated - 1)`:
- the `/skyrl/v1/generate` response (`inference_servers/vllm_server_actor.py`): `choices[0].routed_experts` is
  an envelope `{"data": base64, "shape": [T, L, K], "dtype": "uint8" | "int16" | "int32"}`
  (`generate_wire.py` `pack_routed_experts`), the dtype picked per call from that call's largest id
  (`utils/routed_experts.py` `compact_routed_expert_indices`: uint8 below 256, int16 below 2**15);
- the in-process array: `RemoteGenerateResult.routed_experts`, or `InferenceEngineOutput
  ["rollout_expert_indices"][i]` (an ndarray in the same compact dtype), or vLLM's own
  `CompletionOutput.routed_experts`;
- vLLM's own HTTP forms (base64 `.npy`, nested lists, a whole OpenAI-style response).

The envelope is checked before its base64 is decoded: a dtype SkyRL writes, a 3-D shape of plain ints within
`WireLimits`, the decoded size within `max_bytes` and the base64 length exactly the one that shape and
dtype need (a truncated or padded body is refused unread). Every form then goes through `decode_vllm`
(ids in [0, E), no duplicates, dense layers dropped by global layer number, the row count of
`num_tokens - 1 - prompt_start`). SkyRL's narrow dtypes are widened to int32 first, once the shape is
within `WireLimits` and the row count is the expected one (an envelope's declared count before its base64 is
decoded, unless only its data can say whether it is a duplicated prefix): SkyRL picks them from
the call's own largest id (lossless), so they say nothing about the model's expert count, unlike a uint8
payload that `decode_vllm` alone refuses for E > 256 (vLLM sends uint16 there). The trace then holds
signed ids whatever dtype each call used, so a uint8 call followed by an int16 call cannot lose ids >= 256
(SkyRL #1912).

Legend: T = rows of one call, L = every hidden layer (the payload's layer axis), K = top-k.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from routereplay.errors import (
    ConfigError,
    DtypeError,
    PayloadEncodingError,
    PayloadSizeError,
    TraceShapeError,
    location,
)
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire import decode_vllm
from routereplay.wire.assembler import Expectation, check_rows
from routereplay.wire.limits import DEFAULT_LIMITS, WireLimits, checked_decoder_args, checked_int, is_int
from routereplay.wire.payload import DEFAULT_MAX_BYTES, b64_to_bytes, pick_choice

ENVELOPE_KEYS = ("data", "shape", "dtype")  # generate_wire.PackedArrayKey
ENVELOPE_DTYPES = ("uint8", "int16", "int32")  # utils/routed_experts.ROUTED_EXPERT_DTYPES
ROUTES_FIELD = "routed_experts"  # generate_wire.PackedField.ROUTED_EXPERTS: the choice's envelope
ENGINE_OUTPUT_FIELD = "rollout_expert_indices"  # InferenceEngineOutput: one array per prompt


def is_envelope(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """A mapping that carries SkyRL's envelope keys (`data`, `shape`, `dtype`; sidecar keys may ride along)."""
    return isinstance(value, Mapping) and all(key in value for key in ENVELOPE_KEYS)


def unpack_envelope(
    envelope: Mapping[str, Any],
    *,
    what: str = "routed_experts",
    max_bytes: int = DEFAULT_MAX_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
    expect: Expectation | None = None,
    sequence: str | int | None = None,
) -> np.ndarray:
    """The (T, L, K) array of one `{data, shape, dtype}` envelope; dtype, shape and sizes checked first, and with
    `expect` (its `num_tokens`) the declared row count too, before the base64 is decoded."""
    max_bytes = checked_int(max_bytes, "max_bytes")  # a ConfigError, before the size comparison uses it
    if not isinstance(limits, WireLimits):
        raise ConfigError(f"limits must be a WireLimits, got {type(limits).__name__}")
    if not is_envelope(envelope):
        keys = sorted(map(str, envelope))[:6] if isinstance(envelope, Mapping) else type(envelope).__name__
        raise PayloadEncodingError(
            f"{what}: expected SkyRL's envelope {{data, shape, dtype}} (generate_wire.pack_routed_experts), got "
            f"{keys}; pass the /skyrl/v1/generate response or its choice untouched"
        )
    name = envelope["dtype"]
    if not isinstance(name, str) or name not in ENVELOPE_DTYPES:
        raise DtypeError(
            f"{what}: envelope dtype {str(name)[:40]!r} is not one SkyRL writes ({', '.join(ENVELOPE_DTYPES)}); "
            "the envelope was built by something other than generate_wire.pack_routed_experts"
        )
    dtype = np.dtype(name).newbyteorder("<")
    shape = envelope["shape"]
    if (
        not isinstance(shape, Sequence)
        or isinstance(shape, (str, bytes))
        or not all(is_int(n) and n >= 0 for n in shape)
    ):
        raise TraceShapeError(
            f"{what}: envelope shape {str(shape)[:60]} must be a list of non-negative ints [T, L, K] (rows, every "
            "hidden layer, top_k)"
        )
    shape = tuple(int(n) for n in shape)
    limits.check_shape(shape, what)
    if expect is not None and not could_repeat_prefix(shape[0], expect):  # refused from the header alone
        check_rows(np.broadcast_to(np.zeros((), dtype), shape), expect, sequence)
    size = math.prod(shape) * dtype.itemsize
    if size > max_bytes:
        raise PayloadSizeError(
            f"{what}: envelope declares {name}{list(shape)} = {size} bytes, above max_bytes={max_bytes}; refused "
            "before decoding. Raise max_bytes if the payload is genuine"
        )
    data = envelope["data"]
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise PayloadEncodingError(f"{what}: envelope data is a {type(data).__name__}; SkyRL sends base64 text")
    length = data.nbytes if isinstance(data, memoryview) else len(data)
    needed = 4 * -(-size // 3)  # padded standard base64 of `size` bytes
    if length != needed:
        raise PayloadSizeError(
            f"{what}: envelope data holds {length} base64 characters, but {name}{list(shape)} needs {needed} "
            f"({size} bytes); the body was truncated or the shape / dtype altered in transit"
        )
    if isinstance(data, memoryview):  # SkyRL's load_packed_body splices the base64 in as a view of the body
        data = data.tobytes()
    raw = b64_to_bytes(data, what, max_bytes)
    if len(raw) != size:
        raise PayloadSizeError(
            f"{what}: envelope data decodes to {len(raw)} bytes, but {name}{list(shape)} needs {size}; the base64 "
            "padding was altered in transit"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def could_repeat_prefix(rows: int, expect: Expectation) -> bool:
    """Whether `rows` is the expected count, or too many in a way only the data can diagnose (a duplicated prefix:
    `check_rows` compares the first rows); any other count is refused from the shape alone."""
    expected = expect.expected_rows
    extra = 0 if expected is None else rows - expected
    return extra == 0 or (extra > 0 and 2 * extra <= rows)


def widened(
    routes: Any, what: str = ROUTES_FIELD, *, limits: WireLimits = DEFAULT_LIMITS, expect: Expectation | None = None,
    sequence: str | int | None = None,
) -> Any:  # fmt: skip
    """A SkyRL-compacted ndarray (uint8 / int16: the narrowest for its own largest id) as int32, its shape within
    `limits` and its row count the one `expect` needs checked on the narrow array first (the int32 copy is 4x / 2x
    its size); anything else as given."""
    if isinstance(routes, np.ndarray) and routes.dtype.name in ENVELOPE_DTYPES[:2]:
        limits.check_shape(routes.shape, what)
        if expect is not None:
            check_rows(routes, expect, sequence)
        return routes.astype(np.int32)
    return routes


def skyrl_routes(
    value: Any, *, choice: int = 0, sequence: str | int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
    limits: WireLimits = DEFAULT_LIMITS, expect: Expectation | None = None,
) -> Any:  # fmt: skip
    """One call's routes out of SkyRL's containers: an envelope (or a response / choice holding one) as its
    array, `InferenceEngineOutput["rollout_expert_indices"][choice]`, SkyRL's compact dtypes `widened` (shape
    limits and, with `expect`, the row count checked before widening); any other value is returned as given
    (vLLM's forms, which `decode_vllm` reads)."""
    where = f"{location(sequence)} {ROUTES_FIELD}" if sequence is not None else ROUTES_FIELD
    rows_at = f"choice {choice}" if sequence is None else sequence  # decode_vllm's name for the sequence
    checks: dict[str, Any] = {"limits": limits, "expect": expect, "sequence": rows_at}
    if is_envelope(value):
        return widened(unpack_envelope(value, what=where, max_bytes=max_bytes, **checks), where, **checks)
    if not isinstance(value, Mapping):
        return widened(value, where, **checks)
    if ENGINE_OUTPUT_FIELD in value:  # SkyRL's InferenceEngineOutput dict: one array per prompt
        arrays = value[ENGINE_OUTPUT_FIELD]
        if arrays is None:
            return None  # decode_vllm names the missing routes
        return skyrl_routes(
            pick_choice(arrays, choice, f"{where} ({ENGINE_OUTPUT_FIELD})"),
            choice=choice, sequence=sequence, max_bytes=max_bytes, limits=limits, expect=expect,
        )  # fmt: skip
    picked: Any = value
    if isinstance(value.get("choices"), (list, tuple)):
        picked = pick_choice(value["choices"], choice, f"{where} response")
    inner = picked.get(ROUTES_FIELD) if isinstance(picked, Mapping) else None
    if is_envelope(inner):
        return widened(unpack_envelope(inner, what=where, max_bytes=max_bytes, **checks), where, **checks)
    return value


def decode_skyrl(
    value: Any,
    *,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    num_tokens: int | None = None,
    prompt_start: int = 0,
    choice: int = 0,
    sequence: str | int | None = None,
    policy_version: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
) -> RouteTrace:
    """One SkyRL engine call's routes (any form above) as a validated `RouteTrace` of the MoE layers.

    `prompt_start` is the `routed_experts_prompt_start` the request carried (SkyRL's `RoutedExpertTrace.
    prompt_start` before the call); `num_tokens` is the prompt plus the generated tokens of the call."""
    max_bytes, policy_version, _, sequence = checked_decoder_args(max_bytes, policy_version, True, sequence)
    expect = Expectation(  # decode_vllm's own, built first: rows and limits are checked before any widening
        num_experts=num_experts, moe_layers=moe_layers, num_layers=num_layers, top_k=top_k, start=prompt_start,
        start_name="prompt_start", num_tokens=num_tokens, limits=limits,
    )  # fmt: skip
    routes = skyrl_routes(value, choice=choice, sequence=sequence, max_bytes=max_bytes, limits=limits, expect=expect)
    return decode_vllm(
        routes,
        num_experts=num_experts,
        moe_layers=moe_layers,
        num_layers=num_layers,
        top_k=top_k,
        num_tokens=num_tokens,
        prompt_start=prompt_start,
        choice=choice,
        sequence=sequence,
        policy_version=policy_version,
        max_bytes=max_bytes,
        limits=limits,
    )


__all__ = ["ENVELOPE_DTYPES", "decode_skyrl", "is_envelope", "skyrl_routes", "unpack_envelope"]
