"""routereplay's SGLang backend for AReaL 1.0.4's `RemoteInfEngine`: a resumed request keeps each route row once.

AReaL's `RemoteInfEngine.agenerate` (`infra/remote_inf_engine.py` l.781-950) loops while SGLang answers a request
with stop reason "abort" (paused for a weight update): each pass calls `backend.build_generation_request(req)`,
sends `req.input_ids + everything generated so far`, calls `backend.parse_generation_response(result)`, and
concatenates every pass's `routed_experts`. AReaL's `SGLangBackend` never sends `routed_experts_start_len` and
keeps each pass's rows of [0, seqlen - 1), so a resumed request carries its prefix rows twice (the verl #6029
pattern). `RoutedSGLangBackend` (a subclass: every other request AReaL builds is its own) sends
`routed_experts_start_len` = the rows already held on a resumed pass, and keeps rows [held, seqlen - 1) of each
response, so AReaL's concatenation holds every position's row once: the row of the pass that first routed it.

Each response is checked before anything is kept. A finished (not aborted) pass that asked for routes and got
none (`routed_experts` missing or null: a server without `--enable-return-routed-experts`, a dense model) is a
`MissingRoutesError` here, before AReaL's own check in `agenerate` (l.886-893) reads it as "not a MoE model".
Then `prompt_tokens` must be what the pass sent, and its row count must be the honoured one (seqlen - 1 - start_len
rows) or, from a server that ignores the field, the whole [0, seqlen - 1) (the first start_len rows are then
dropped); any other count raises `RowCountError` naming both, never a reshape. The rows are decoded by
`routereplay.wire.sglang.decode_sglang` (corrupt base64, wrong layer count, ids outside [0, E) or negative: named
errors) and handed to AReaL in its own form, int32 `(rows, num_layers * K)`, every hidden layer.

Pairing build and parse under asyncio: AReaL passes `parse_generation_response` the response only. One `agenerate`
runs in one asyncio task, and its passes are sequential (build, await the HTTP call, parse); concurrent episodes
are separate tasks (AReaL's `WorkflowExecutor`). So the backend keeps a `CallLedger` per task in a `ContextVar`
owned by the backend instance (AReaL keeps its own workflow context the same way, `infra/workflow_context.py`):
build records the pending pass (the tokens sent, its start), parse takes it. A ledger names the task that made it:
a task that inherits another task's context starts a ledger of its own, so no two tasks ever share one. A pass
is a resume when it sends the same rid with exactly the tokens the previous pass sent and generated; anything
else (a new rid, a new turn with more tokens) starts at 0.

`install(engine, geometry)` puts it on AReaL's `RemoteSGLangEngine` (`._engine.backend`) or `RemoteInfEngine`
(`.backend`); a vLLM or any other backend is refused by name (`ConfigError`: AReaL captures routes with SGLang
only, `trainer/rl_trainer.py` l.1310-1313). This module imports AReaL.

Legend: T rows of one pass, A every hidden layer, K top-k.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from areal.api.io_struct import HttpGenerationResult, HttpRequest, ModelRequest
from areal.engine.sglang_remote import SGLangBackend

from routereplay.errors import ConfigError, MissingRoutesError, ResponseFieldError, RowCountError
from routereplay.integrations.verl.rollout import RouteGeometry
from routereplay.wire.limits import is_int
from routereplay.wire.payload import DEFAULT_MAX_BYTES, b64_to_bytes, dtype_named
from routereplay.wire.sglang import decode_sglang

START_FIELD = "routed_experts_start_len"  # SGLang's request field: the response covers rows [start_len, seqlen - 1)


@dataclass(frozen=True, slots=True)
class PassRecord:
    """One HTTP pass of a request: the rows it was asked to skip, what it saw and generated, what it returned."""

    start: int  # routed_experts_start_len sent (0: none)
    sent: int  # tokens sent (the server's prompt_tokens)
    generated: int  # the server's completion_tokens
    rows: int  # rows kept (positions [start, sent + generated - 1)); 0 when the pass returned no routes
    start_honoured: bool | None  # None: start 0 or no routes; False: the server sent [0, ...) and rows were trimmed


@dataclass(slots=True)
class RequestPasses:
    """One `agenerate` request (one rid) as this backend saw it: its tokens so far and the rows held."""

    rid: str
    tokens: list[int]  # sent + generated so far
    rows_held: int = 0  # positions [0, rows_held) have a row in what AReaL concatenated
    passes: list[PassRecord] = field(default_factory=list)


@dataclass(slots=True)
class CallLedger:
    """The current asyncio task's request and its pending pass (built, not yet parsed)."""

    task: asyncio.Task[Any] | None
    request: RequestPasses | None = None
    pending: tuple[int, int, bool] | None = None  # (start, tokens sent, routes asked) of the pass in flight


def current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop: a synchronous caller
        return None


class RoutedSGLangBackend(SGLangBackend):
    """AReaL's `SGLangBackend` that sends `routed_experts_start_len` on resumed passes and keeps each row once."""

    def __init__(self, geometry: RouteGeometry, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not isinstance(geometry, RouteGeometry):
            raise ConfigError(f"geometry must be a RouteGeometry, got {type(geometry).__name__}")
        self.geometry, self.max_bytes = geometry, max_bytes
        self._ledger: ContextVar[CallLedger | None] = ContextVar(f"routereplay_areal_{id(self)}", default=None)

    def ledger(self) -> CallLedger:
        """The calling task's ledger (made on first use in that task)."""
        ledger, task = self._ledger.get(), current_task()
        if ledger is None or ledger.task is not task:
            ledger = CallLedger(task)
            self._ledger.set(ledger)
        return ledger

    def request_passes(self) -> RequestPasses | None:
        """The calling task's last request: its passes, tokens and rows held."""
        return self.ledger().request

    def build_generation_request(self, req: ModelRequest, with_lora: bool, version: int) -> HttpRequest:
        http = super().build_generation_request(req, with_lora=with_lora, version=version)
        ledger, sent = self.ledger(), [int(t) for t in req.input_ids]
        held = ledger.request
        resumed = held is not None and held.rid == req.rid and held.tokens == sent  # rows_held 0: start stays 0
        if not resumed or held is None:
            held = ledger.request = RequestPasses(rid=str(req.rid), tokens=sent)
        start = held.rows_held
        if start and http.payload.get("return_routed_experts"):
            http.payload[START_FIELD] = start
        ledger.pending = (start, len(sent), bool(http.payload.get("return_routed_experts")))
        return http

    def parse_generation_response(self, response: dict[str, Any]) -> HttpGenerationResult:
        ledger = self.ledger()
        pending, ledger.pending = ledger.pending, None
        meta = response.get("meta_info") if isinstance(response, Mapping) else None
        if not isinstance(meta, Mapping):
            raise ResponseFieldError(f"SGLang's /generate response has no meta_info object: {str(response)[:200]}")
        routed = meta.get("routed_experts")
        if routed is None:
            result = super().parse_generation_response(response)
            if pending is not None and pending[2] and result.stop_reason != "abort":
                raise self._missing_routes(ledger, result.stop_reason, "routed_experts" in meta)
            self._advance(ledger, pending, result, rows_TA=None, start_honoured=None)
            return result
        if pending is None or ledger.request is None:
            raise ConfigError(
                "parse_generation_response got routes for no pass this backend built in this asyncio task: AReaL's "
                "RemoteInfEngine builds and parses each pass in one task; call build_generation_request first"
            )
        start, sent, _ = pending
        prompt: Any = meta.get("prompt_tokens")
        completion: Any = meta.get("completion_tokens")
        if not (is_int(prompt) and is_int(completion) and prompt >= 1 and completion >= 0):
            raise ResponseFieldError(
                f"request {ledger.request.rid}: meta_info prompt_tokens={prompt!r}, completion_tokens={completion!r} "
                "must be ints (>= 1, >= 0): they fix the routes' row count"
            )
        if prompt != sent:
            raise ResponseFieldError(
                f"request {ledger.request.rid}: the server counted prompt_tokens={prompt} but the pass sent {sent} "
                "tokens: the routes would not sit on the tokens sent"
            )
        rows_TA, first = self._rows(meta, routed, ledger.request.rid, start, prompt + completion)
        without = {**response, "meta_info": {k: v for k, v in meta.items() if k != "routed_experts"}}
        result = replace(super().parse_generation_response(without), routed_experts=rows_TA)
        if len(result.output_tokens) != completion:
            raise ResponseFieldError(
                f"request {ledger.request.rid}: {len(result.output_tokens)} output_token_logprobs but "
                f"completion_tokens={completion}: the row count cannot be trusted"
            )
        self._advance(ledger, pending, result, rows_TA=rows_TA, start_honoured=(first == start) if start else None)
        return result

    @staticmethod
    def _missing_routes(ledger: CallLedger, stop_reason: str, null: bool) -> MissingRoutesError:
        """A finished pass that asked for routes got none: named here, before AReaL's own check reads it as 'not a
        MoE model'."""
        held = ledger.request
        where = "a request" if held is None else f"request {held.rid}, pass {len(held.passes) + 1}"
        got = "routed_experts: null" if null else "no routed_experts field"
        return MissingRoutesError(
            f"{where} (finish_reason {stop_reason!r}) asked SGLang for its routed experts (return_routed_experts) "
            f"but the response's meta_info has {got}, so the episode would carry no routes. Fix: start the SGLang "
            "server with --enable-return-routed-experts (AReaL does when rollout.return_routed_experts=true), and "
            "serve a MoE model (a dense model has no routes)"
        )

    def _rows(self, meta: Mapping[str, Any], routed: Any, rid: str, start: int, seqlen: int) -> tuple[np.ndarray, int]:
        """Rows [start, seqlen - 1) of the response, int32 (T, A*K), and the first position it sent (start or 0)."""
        g = self.geometry
        what = f"request {rid} routed_experts"
        if not isinstance(routed, (str, bytes)):
            raise ResponseFieldError(f"{what}: expected SGLang's base64 text, got {type(routed).__name__}")
        raw = b64_to_bytes(routed, what, self.max_bytes)
        named = meta.get("routed_experts_dtype")
        dtype = np.dtype(np.int32) if named is None else dtype_named(named, what)
        width = g.num_layers * g.top_k * dtype.itemsize
        total = seqlen - 1  # positions [0, seqlen - 1) have a row: the last token is never fed back
        if len(raw) == (total - start) * width:
            first = start
        elif start and len(raw) == total * width:
            first = 0  # the server ignored routed_experts_start_len
        else:
            if start:
                needs = (
                    f"the pass (seqlen {seqlen}, {START_FIELD}={start}) needs {total - start} rows for positions "
                    f"[{start}, {total}) if the server honoured the start, or {total} rows for [0, {total}) if it "
                    "ignored it: neither"
                )
            else:
                needs = (
                    f"the pass (seqlen {seqlen}, from position 0) needs {total} rows, one per position of [0, {total}) "
                    "(the last token is never fed back)"
                )
            raise RowCountError(
                f"{what}: {len(raw)} bytes = {len(raw) / width:g} rows of {g.num_layers} layers x top-{g.top_k} "
                f"{dtype.name} ids, but {needs}. Check the model's num_hidden_layers / num_experts_per_tok and the "
                "server's routed-experts capture"
            )
        flat_TA = np.frombuffer(raw, dtype=dtype).reshape(total - first, g.num_layers * g.top_k)
        decode_sglang(  # the whole catalogue: ids in [0, E), whole rows, dense layers, no all-zero MoE layer
            flat_TA,
            num_layers=g.num_layers,
            top_k=g.top_k,
            num_experts=g.num_experts,
            moe_layers=g.moe_layers,
            start_len=first,
            num_tokens=seqlen,
            sequence=rid,
        )
        return np.ascontiguousarray(flat_TA[start - first :], dtype=np.int32), first

    @staticmethod
    def _advance(
        ledger: CallLedger,
        pending: tuple[int, int, bool] | None,
        result: HttpGenerationResult,
        *,
        rows_TA: np.ndarray | None,
        start_honoured: bool | None,
    ) -> None:
        held = ledger.request
        if held is None or pending is None:
            return
        start, sent, _ = pending
        kept = 0 if rows_TA is None else len(rows_TA)
        held.tokens = held.tokens + [int(t) for t in result.output_tokens]
        if rows_TA is not None:
            held.rows_held = start + kept
        held.passes.append(PassRecord(start, sent, len(result.output_tokens), kept, start_honoured))


def inner_engine(engine: Any) -> Any:
    """AReaL's `RemoteInfEngine` behind `engine`: the object that holds `backend` itself, found through
    `RemoteSGLangEngine._engine` and wrappers' `.engine` (an episode's recorder); None when there is none."""
    candidate = engine
    for _ in range(8):  # a few wrappers deep, never a cycle
        own = getattr(candidate, "__dict__", {})
        if "backend" in own and hasattr(candidate, "agenerate"):
            return candidate
        candidate = own.get("_engine", own.get("engine"))
        if candidate is None:
            return None
    return None


def install(engine: Any, geometry: RouteGeometry) -> RoutedSGLangBackend:
    """Put `RoutedSGLangBackend(geometry)` on AReaL's SGLang engine (idempotent); returns the backend in place.

    Refuses (`ConfigError`) a vLLM backend or any backend that is not AReaL's SGLang one, an engine with no
    AReaL `RemoteInfEngine` inside, and an installed backend of another geometry."""
    inner = inner_engine(engine)
    if inner is None:
        raise ConfigError(
            f"{type(engine).__name__} holds no AReaL RemoteInfEngine backend (.backend / ._engine.backend): install "
            "routereplay's backend on the rollout process's RemoteSGLangEngine (the routed workflows do it there)"
        )
    backend = inner.backend
    if isinstance(backend, RoutedSGLangBackend):
        if backend.geometry != geometry:
            raise ConfigError(
                f"the engine already carries routereplay's backend for {backend.geometry}, not {geometry}: one engine "
                "serves one model; pass the same geometry"
            )
        return backend
    if type(backend) is not SGLangBackend:
        raise ConfigError(
            f"the engine's backend is {type(backend).__name__}, not AReaL's SGLangBackend: AReaL captures routed "
            "experts with SGLang only (rollout.return_routed_experts refuses vLLM); serve the rollout with SGLang "
            "(a subclass of SGLangBackend is not replaced either: derive it from RoutedSGLangBackend)"
        )
    routed = RoutedSGLangBackend(geometry)
    inner.backend = routed
    return routed


__all__ = ["START_FIELD", "CallLedger", "PassRecord", "RequestPasses", "RoutedSGLangBackend", "inner_engine", "install"]
