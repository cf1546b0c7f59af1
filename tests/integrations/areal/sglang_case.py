"""A real HTTP server on 127.0.0.1 that speaks SGLang's /generate JSON, its tokens and routes from a tiny HF MoE.

AReaL's `RemoteSGLangEngine` talks to it as to SGLang (`GET /health`, `POST /generate`): the request's
`input_ids`, `sampling_params` (max_new_tokens, stop_token_ids), `return_routed_experts` and
`routed_experts_start_len`; the response's `meta_info` holds `prompt_tokens`, `completion_tokens`,
`output_token_logprobs` ([logprob, token id, None]), `finish_reason` and `routed_experts`: the int32 base64 of
rows [start_len, seqlen - 1) over EVERY hidden layer, the dense layer 0 zero-filled, as SGLang sends them.

The model is the tiny dense-first Qwen3-MoE (layer 0 dense, layers 1-2 with 16 experts, top-2; seeded): greedy
next tokens, and the routes a probe on its routers records for the call's `input_ids + output` (`model_routes`).
`versions` are the policy's weights over time (index = version): the server starts at version 0 and moves to
the next one when it aborts a request (the pause for a weight update AReaL resumes after), and, with
`update_after_request`, after every finished request.

Knobs: `abort_after=n` answers every request that is not itself a resume with n tokens and
`finish_reason.type == "abort"` (AReaL's `agenerate` then resends input + output); `honour_start=False` ignores
`routed_experts_start_len` (rows from 0, as a server without the field). `calls` logs every pass.

Legend: N tokens of a pass (input + output), A every hidden layer, K top-k.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from torch import nn

import routereplay


def model_routes(model: nn.Module, token_ids: list[int]) -> np.ndarray:
    """The model's own routing of `token_ids`, as SGLang reports it: int32 (N - 1, A, K), dense layers 0."""
    replayer = routereplay.attach(model)
    try:
        with torch.no_grad(), replayer.record() as recording:
            model(torch.tensor([token_ids]))
        moe_1NMK = recording.routes
    finally:
        replayer.detach()
    out_TAK = np.zeros((len(token_ids) - 1, model.config.num_hidden_layers, moe_1NMK.shape[-1]), dtype=np.int32)
    out_TAK[:, list(replayer.layers)] = moe_1NMK[0, :-1].numpy()
    return out_TAK


@dataclass(frozen=True, slots=True)
class ServedPass:
    """One /generate pass as the server ran it."""

    input_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    version: int
    start_len: int  # routed_experts_start_len the request sent
    first_row: int  # first position of the rows the response carried (start_len, or 0 when ignored)
    aborted: bool

    @property
    def tokens(self) -> list[int]:
        return [*self.input_ids, *self.output_ids]


class SGLangServer:
    """SGLang's /generate over a threading HTTP server; `address` is what AReaL's `initialize(addr=...)` takes."""

    def __init__(
        self,
        versions: list[nn.Module],
        *,
        honour_start: bool = True,
        abort_after: int | None = None,
        update_after_request: bool = False,
    ) -> None:
        self.versions, self.version = versions, 0
        self.honour_start, self.abort_after, self.update_after_request = honour_start, abort_after, update_after_request
        self.calls: list[ServedPass] = []
        self.resumes: set[tuple[int, ...]] = set()  # input + output of aborted passes: their resumes
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def __enter__(self) -> SGLangServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/generate":
                    self.reply(404, {"error": self.path})
                    return
                self.reply(200, server.generate(body))

        return Handler

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return self._generate(body)

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["input_ids"]]
        params = body["sampling_params"]
        stops = set(params.get("stop_token_ids") or [])
        model, version = self.versions[self.version], self.version
        resumed = tuple(ids) in self.resumes
        self.resumes.discard(tuple(ids))
        limit = int(params["max_new_tokens"])
        aborted = self.abort_after is not None and not resumed and self.abort_after < limit
        if aborted:
            limit = int(self.abort_after)  # type: ignore[arg-type]  # not None: aborted
        out, logprobs, stopped = greedy(model, ids, limit, stops)
        if aborted:
            finish: dict[str, Any] = {"type": "abort", "message": "Abort in waiting queue (weight update)"}
        elif stopped:
            finish = {"type": "stop", "matched": out[-1]}
        else:
            finish = {"type": "length", "length": len(out)}
        meta: dict[str, Any] = {
            "id": body.get("rid") or f"req-{len(self.calls)}",
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": finish,
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, out, strict=True)],
        }
        start = int(body.get("routed_experts_start_len", 0) or 0)
        first = start if self.honour_start else 0
        if body.get("return_routed_experts"):
            rows_TAK = model_routes(model, ids + out)[first:]
            meta["routed_experts"] = base64.b64encode(rows_TAK.astype(np.int32).tobytes()).decode()
        self.calls.append(ServedPass(tuple(ids), tuple(out), version, start, first, aborted))
        if aborted:
            self.resumes.add(tuple(ids + out))
        if aborted or self.update_after_request:
            self.version = min(self.version + 1, len(self.versions) - 1)
        return {"text": " ".join(f"w{t}" for t in out), "output_ids": out, "meta_info": meta}


def greedy(model: nn.Module, ids: list[int], limit: int, stops: set[int]) -> tuple[list[int], list[float], bool]:
    """Up to `limit` greedy tokens after `ids`, their log-probs, and whether a stop token ended them."""
    out: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(limit):
            logits_V = model(torch.tensor([ids + out])).logits[0, -1].float()
            token = int(logits_V.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits_V, dim=-1)[token]))
            if token in stops:
                return out, logprobs, True
    return out, logprobs, False


def first_routing(calls: list[ServedPass], versions: list[nn.Module], tokens: list[int]) -> np.ndarray:
    """The truth for an episode with final `tokens`: per position, the routing (probe, (S, A, K), -1 where none)
    of the FIRST pass that fed that token, by that pass's weights version, over that pass's own tokens."""
    config: Any = versions[0].config
    truth_SAK = np.full((len(tokens), config.num_hidden_layers, config.num_experts_per_tok), -1, dtype=np.int64)
    routed = 0
    for served in calls:
        fed = served.tokens
        if fed != tokens[: len(fed)]:
            continue  # another episode's pass
        if len(fed) - 1 > routed:
            truth_SAK[routed : len(fed) - 1] = model_routes(versions[served.version], fed)[routed:]
            routed = len(fed) - 1
    return truth_SAK


def tiny_versions(count: int = 2) -> list[nn.Module]:
    """The tiny dense-first Qwen3-MoE (seeded) and `count - 1` weight updates of it (routers perturbed: they route
    differently, so a row kept from the wrong version shows)."""
    from routereplay.testing.vllm_models import tiny_vllm_model
    from tests.runtime.models import perturbed_routers

    base = tiny_vllm_model("qwen3_moe_dense_first", seed=0)
    return [base] + [perturbed_routers(base, noise=0.5, seed=7 + v) for v in range(1, count)]


@contextmanager
def areal_engine(server: SGLangServer, **config: Any) -> Iterator[Any]:
    """AReaL's own `RemoteSGLangEngine`, initialised against `server` (`initialize(addr=...)`), destroyed after."""
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    engine = RemoteSGLangEngine(
        InferenceEngineConfig(
            experiment_name="routereplay", trial_name="areal", backend="sglang:d1", setup_timeout=30, **config
        )
    )
    engine.initialize(addr=server.address)
    try:
        yield engine
    finally:
        engine.destroy()


def chat(words: str) -> dict[str, Any]:
    """AReaL's episode data: one user message (the word tokenizer's text)."""
    return {"messages": [{"role": "user", "content": words}]}


def zero_reward(*args: Any, **kwargs: Any) -> float:
    """A reward function AReaL can ship to its reward process pool (module-level): never right, so
    `MultiTurnWorkflow` runs every turn."""
    return 0.0


def unit_reward(*args: Any, **kwargs: Any) -> float:
    return 1.0


__all__ = [
    "SGLangServer",
    "ServedPass",
    "areal_engine",
    "chat",
    "first_routing",
    "greedy",
    "model_routes",
    "tiny_versions",
    "unit_reward",
    "zero_reward",
]
