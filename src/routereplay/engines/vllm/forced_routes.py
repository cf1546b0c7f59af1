"""Routes one vLLM request asks to have forced: the codec blob it carries, checked against the model and prompt.

A request asks by carrying `SamplingParams.extra_args[XARG_KEY]`: the project's compact codec blob
(`routereplay.codec.encode`, CRC included) as base64 text. In process `VLLMEngine` sets it; over HTTP
it travels in the request body's `vllm_xargs`, which vLLM's OpenAI server copies into `extra_args`.
The blob is a `RouteTrace`: row i forces the token at position `start + i`; a -1 row routes live; its
`layers` must be exactly the model's MoE layers, by their global numbers (a dense-first model's start at 1).

`ForcedRoutes.parse` trusts nothing: the text must be base64; the blob's fixed header (magic, version,
then its expert count, top-k, layers, start and rows) must be the served model's and lie inside the
prompt before anything sized by the blob is built (a 100-byte blob of another model's geometry would
otherwise pay that model's set-mode tables: 11-13 ms and 16.5 MiB for E=32767, K=2, on one shared AMD
EPYC core); then the blob passes the codec's own checks (CRC, lengths) under limits sized from the
prompt (at most prompt x MoE layers x K ids, so a small blob cannot declare a huge trace), and token
ids, when the blob has them, must be the prompt's. The checked rows stay in the trace's own dtype (int16
for E <= 32767) until the routing step. Every failure is a `ForcedRoutesError` naming the request and the
fix. It runs twice: in vLLM's front end before the request is queued (the request fails with HTTP 400, the server serves
on) and in the worker before use (`forcing.worker`).

Prefix caching: KV blocks are keyed by token ids, not by the routes that computed them. A forced
request's prompt is salted with a digest of its routes (`salted`, vLLM's own `cache_salt`), so its
blocks are shared only with requests forcing the same routes, and an unforced request never reuses
KV computed under forced routes (nor the other way round).

Legend: T = forced rows, L = the model's MoE layers, K = top-k, N = token rows of one engine step.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay import codec
from routereplay.codec.header import peek_geometry
from routereplay.codec.limits import CodecLimits
from routereplay.enums import CodecMode
from routereplay.errors import ForcedRoutesError, ForcingNotAppliedError, RouteReplayError
from routereplay.trace.route_trace import RouteTrace

XARG_KEY = "routereplay_routes"  # the key in SamplingParams.extra_args / the request body's vllm_xargs
WEIGHTS_KEY = "routereplay_weights"  # extra_args[WEIGHTS_KEY] = True: keep the combine weights (`asks_weights`)
WEIGHTS_SALT = "routereplay-weights:"  # a weights request's own cache salt: its rows are all computed, none cached
SALT_PREFIX = "routereplay-forced:"
MAX_BLOB_CHARS = 64 << 20  # base64 text longer than this is refused before it is decoded
CARRIER = "extra_args / vllm_xargs"  # where a vLLM request carries the blob (named in every refusal)


@dataclass(frozen=True, slots=True)
class ServedRouting:
    """What the served model routes with: experts, top-k, hidden layers and which of them are MoE layers."""

    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, text_config: Any, num_experts: int, top_k: int) -> ServedRouting:
        """From an HF text config (the front end has no model): MoE layers by the config's own fields."""
        num_layers = int(text_config.num_hidden_layers)
        return cls(int(num_experts), int(top_k), num_layers, moe_layers_of(text_config, num_layers))


def moe_layers_of(text_config: Any, num_layers: int) -> tuple[int, ...]:
    """The hidden layers with a router, by the fields MoE configs use (all layers when none is set).

    An explicit `moe_layers` list (Llama 4) wins; otherwise `mlp_only_layers` / `decoder_sparse_step`
    (Qwen2/3-MoE), `first_k_dense_replace` / `moe_layer_freq` (DeepSeek-V2/V3, Kimi, GLM-4.5),
    `expert_layer_period` / `expert_layer_offset` (Jamba), `moe_layer_start_index` / `moe_layer_end_index`
    / `moe_layer_interval` (ERNIE 4.5). The worker checks the same against the loaded model's routers."""
    explicit = getattr(text_config, "moe_layers", None)
    if isinstance(explicit, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in explicit):
        return tuple(sorted(i for i in set(explicit) if 0 <= i < num_layers))
    dense = {int(i) for i in (getattr(text_config, "mlp_only_layers", None) or [])}
    step = getattr(text_config, "decoder_sparse_step", None)
    first = getattr(text_config, "first_k_dense_replace", None)
    freq = getattr(text_config, "moe_layer_freq", None)
    period, offset = getattr(text_config, "expert_layer_period", None), getattr(text_config, "expert_layer_offset", 0)
    begin = getattr(text_config, "moe_layer_start_index", None)
    end = getattr(text_config, "moe_layer_end_index", None)
    interval = getattr(text_config, "moe_layer_interval", None)
    layers = []
    for i in range(num_layers):
        if i in dense:
            continue
        if isinstance(step, int) and step > 0 and (i + 1) % step != 0:
            continue
        if isinstance(first, int) and i < first:
            continue
        if isinstance(freq, int) and freq > 1 and i % freq != 0:
            continue
        if isinstance(period, int) and period > 0 and i % period != (offset or 0) % period:
            continue
        if isinstance(begin, int) and i < begin:
            continue
        if isinstance(end, int) and end >= 0 and i > end:
            continue
        if isinstance(interval, int) and interval > 1 and (i + 1) % interval != 0:
            continue
        layers.append(i)
    return tuple(layers)


def encode_forced(trace: RouteTrace) -> str:
    """A trace as the text a request carries under `XARG_KEY`: its codec blob (ordered mode: a few
    microseconds to decode for a prompt's rows, where set mode pays its unranker's set-up), base64."""
    return base64.b64encode(codec.encode(trace, mode=CodecMode.ORDERED)).decode("ascii")


def weights_flag(value: object) -> bool | None:
    """A `WEIGHTS_KEY` value as vLLM delivers it: True / False; 1 / 0 (vLLM's OpenAI server validates
    `vllm_xargs` as `str | int | float`, which turns JSON true / false into 1 / 0); "true" / "false" (any case).
    None for anything else."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def asks_weights(extra: Any, where: str) -> bool:
    """Whether a request's `extra_args` ask for the combine weights beside its routes (`WEIGHTS_KEY`: true, in any
    of the forms `weights_flag` reads); any other value is refused (`ForcedRoutesError`)."""
    value = (extra or {}).get(WEIGHTS_KEY, False)
    flag = weights_flag(value)
    if flag is None:
        raise ForcedRoutesError(
            f"{where}: vllm_xargs {WEIGHTS_KEY!r}={value!r} must be true (keep the combine weights) or false "
            '(JSON true / false, 1 / 0, or the strings "true" / "false" in any case)'
        )
    return flag


def route_digest(text: str) -> str:
    """A short digest of a request's forced-routes text (what its KV blocks are salted with)."""
    return hashlib.sha256(text.encode("ascii", "replace")).hexdigest()[:32]


def salted(cache_salt: str | None, text: str) -> str:
    """The cache salt of a forced request: the caller's salt (if any) and the routes' digest."""
    digest = SALT_PREFIX + route_digest(text)
    return digest if not cache_salt else f"{cache_salt}|{digest}"


@dataclass(frozen=True, slots=True)
class ForcedRoutes:
    """A request's checked forced routes; `experts_TLK` (the trace's canonical int16 / int32, owned) columns
    follow `ServedRouting.moe_layers`, -1 = live."""

    start: int
    experts_TLK: np.ndarray
    moe_layers: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + int(self.experts_TLK.shape[0])

    @property
    def forced_rows(self) -> int:
        """(token, layer) rows that are forced (not -1)."""
        return int((self.experts_TLK[:, :, 0] >= 0).sum())

    @classmethod
    def parse(
        cls, value: object, served: ServedRouting, prompt: list[int] | None, *, where: str, carrier: str = CARRIER
    ) -> ForcedRoutes:
        """Check a request's `extra_args[XARG_KEY]` against the model and prompt (module docstring); a refusal
        names `carrier`, where the engine's request carries the blob (vLLM's by default)."""
        fail = _Failure(where, carrier)
        if prompt is None:
            raise fail("the request has no prompt token ids (embeddings-only prompts cannot be forced)")
        if isinstance(value, bytes | bytearray):
            value = value.decode("ascii", "replace")
        if not isinstance(value, str):
            raise fail(f"the value is a {type(value).__name__}; it must be base64 text of a codec blob")
        if len(value) > MAX_BLOB_CHARS:
            raise fail(f"the text is {len(value)} characters, above the {MAX_BLOB_CHARS} allowed")
        try:
            blob = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as error:
            raise fail(f"the text is not base64 ({error})") from None
        _refuse_header(blob, served, prompt, fail)  # another model's blob costs a header parse, no tables or rows
        K, L = served.top_k, len(served.moe_layers)
        limits = CodecLimits(max_entries=max(1, len(prompt) * max(L, 1) * K))  # rows beyond the prompt: refused
        try:
            trace = codec.decode(blob, limits=limits)
        except RouteReplayError as error:
            raise fail(f"the blob does not decode to a valid trace: {error}") from None
        return cls._checked(trace, served, prompt, fail, owned=True)

    @classmethod
    def check(
        cls, trace: RouteTrace, served: ServedRouting, prompt: list[int], *, where: str, carrier: str = CARRIER
    ) -> ForcedRoutes:
        """Check a decoded (or not yet encoded) trace against the model and prompt; `ForcedRoutesError` if not.
        The plan keeps a copy of the trace's rows (in its dtype), not a view of the caller's array."""
        return cls._checked(trace, served, prompt, _Failure(where, carrier), owned=False)

    @classmethod
    def _checked(
        cls, trace: RouteTrace, served: ServedRouting, prompt: list[int], fail: _Failure, *, owned: bool
    ) -> ForcedRoutes:
        _refuse_shape(
            trace.num_experts, trace.top_k, tuple(trace.layers), trace.start, trace.num_tokens, served, prompt, fail
        )
        try:
            trace.validate()
        except RouteReplayError as error:
            raise fail(f"the routes are not valid: {error}") from None
        if trace.token_ids is not None:
            expected = np.asarray(prompt[trace.start : trace.stop], dtype=np.int64)
            differ = np.flatnonzero(np.asarray(trace.token_ids, dtype=np.int64) != expected)
            if differ.size:
                at = int(differ[0]) + trace.start
                theirs = int(trace.token_ids[at - trace.start])
                raise fail(
                    f"the trace's token id at position {at} is {theirs}, the prompt's is "
                    f"{prompt[at]} ({differ.size} position(s) differ): these routes belong to another sequence"
                )
        experts_TLK = trace.experts if owned else np.array(trace.experts, copy=True)  # int16 / int32, no widening
        return cls(trace.start, experts_TLK, served.moe_layers)

    def rows_at(self, positions_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a step's token positions: which of them this trace covers (mask N) and their rows (n, L, K)."""
        inside_N = (positions_N >= self.start) & (positions_N < self.stop)
        return inside_N, self.experts_TLK[positions_N[inside_N] - self.start]


def check_forced(asked: RouteTrace, got: RouteTrace, *, where: str) -> None:
    """`ForcingNotAppliedError` unless an engine's returned trace holds the asked experts (as sets) on every row
    `asked` routes (-1 rows are not forced; positions the engine never fed, after an early abort, are skipped)."""
    begin, end = max(asked.start, got.start), min(asked.stop, got.stop)
    if end <= begin:
        return
    missing = [layer for layer in asked.layers if layer not in got.layers]
    if missing:
        raise ForcingNotAppliedError(f"{where}: the engine's trace lacks layer(s) {missing} that were forced")
    columns = [list(got.layers).index(layer) for layer in asked.layers]
    asked_TLK = np.sort(np.asarray(asked.experts[begin - asked.start : end - asked.start], np.int64), axis=-1)
    got_TLK = np.sort(np.asarray(got.experts[begin - got.start : end - got.start][:, columns], np.int64), axis=-1)
    forced_TL = asked_TLK[:, :, 0] >= 0
    wrong_TL = forced_TL & (asked_TLK != got_TLK).any(axis=-1)
    if wrong_TL.any():
        row, column = (int(x) for x in np.argwhere(wrong_TL)[0])
        raise ForcingNotAppliedError(
            f"{where}: the engine was asked to force {int(forced_TL.sum())} (token, layer) rows and its own capture "
            f"reports other experts on {int(wrong_TL.sum())} of them (first: token {begin + row}, layer "
            f"{asked.layers[column]}: asked {asked_TLK[row, column].tolist()}, got {got_TLK[row, column].tolist()}). "
            "The server lacks the routereplay vLLM plugin (pip install 'routereplay[vllm]' where vLLM runs), or a "
            "layer's router cannot be forced (the server's log names it)"
        )


def _refuse_header(blob: bytes, served: ServedRouting, prompt: list[int], fail: _Failure) -> None:
    """Before decoding: `ForcedRoutesError` when the blob's fixed header does not fit the model and prompt.

    The header is read without the CRC pass (a valid blob pays that once, in `codec.decode`); a header that
    does not fit is CRC-checked before it is named, so a blob damaged in transit is called damaged."""
    view = memoryview(blob)
    try:
        head = peek_geometry(view)  # magic, version, fixed header, layer numbers: no tables, no rows
    except RouteReplayError as error:
        raise fail(f"the blob is not a valid codec blob: {error}") from None
    try:
        _refuse_shape(head.num_experts, head.top_k, head.layers, head.start, head.num_tokens, served, prompt, fail)
    except ForcedRoutesError:
        try:
            peek_geometry(view, verify_crc=True)
        except RouteReplayError as error:
            raise fail(f"the blob is not a valid codec blob: {error}") from None
        raise


def _refuse_shape(
    num_experts: int,
    top_k: int,
    layers: tuple[int, ...],
    start: int,
    rows: int,
    served: ServedRouting,
    prompt: list[int],
    fail: _Failure,
) -> None:
    if num_experts != served.num_experts or top_k != served.top_k:
        raise fail(
            f"the trace has E={num_experts}, K={top_k}; the served model routes E={served.num_experts}, "
            f"K={served.top_k}: encode routes of this model"
        )
    if layers != served.moe_layers:
        raise fail(
            f"the trace has layers {list(layers)}; the served model's MoE layers are "
            f"{list(served.moe_layers)}: give one column per MoE layer, numbered as the model numbers them"
        )
    if start < 0 or start + rows > len(prompt):
        raise fail(
            f"the trace covers positions {start}..{start + rows - 1} but the prompt has "
            f"{len(prompt)} tokens (positions 0..{len(prompt) - 1}): only prompt positions can be forced"
        )


class _Failure:
    """Builds the `ForcedRoutesError` of one request: what, where (the request, and the `carrier` its blob came
    in) and how to fix."""

    def __init__(self, where: str, carrier: str = CARRIER) -> None:
        self.where = where
        self.carrier = carrier

    def __call__(self, what: str) -> ForcedRoutesError:
        return ForcedRoutesError(
            f"{self.where}: forced routes ({self.carrier} {XARG_KEY!r}) refused: {what}. The request was "
            "not run; send routereplay.engines.vllm.encode_forced(trace) of a RouteTrace of this model and prompt"
        )


__all__ = [
    "CARRIER",
    "MAX_BLOB_CHARS",
    "SALT_PREFIX",
    "WEIGHTS_KEY",
    "WEIGHTS_SALT",
    "XARG_KEY",
    "ForcedRoutes",
    "ServedRouting",
    "asks_weights",
    "check_forced",
    "encode_forced",
    "moe_layers_of",
    "route_digest",
    "salted",
    "weights_flag",
]
