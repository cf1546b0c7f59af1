"""A real HTTP server on 127.0.0.1 that answers like vLLM (>= 0.22) and SGLang, routes included.

Wire forms (as the engines build them):
- vLLM POST /v1/completions: `choices[0].token_ids`, `.logprobs.token_logprobs` (when `logprobs` is
  set), `.routed_experts` = base64 of np.save bytes, uint8 when E <= 256 else uint16; GET /v1/models.
- SGLang POST /generate: `output_ids`, `meta_info.output_token_logprobs` as [logprob, token_id, null],
  `meta_info.routed_experts` = base64 of the raw int32 bytes (or `routed_experts_dtype`'s); GET
  /get_model_info (or only /model_info).
Routes have num_tokens - 1 rows over every hidden layer, dense layers zero-filled, distinct ids per
row. Tokens, log-probs and routes come from numpy seeded by the request (seed and prompt). Every
generated response is kept in `served` so tests can compare against ground truth. `mutate(path,
response)` rewrites each generation response before it is sent (malformed-field tests).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import numpy as np


@dataclass(kw_only=True)
class StubConfig:
    model: str = "test-moe"
    num_layers: int = 4  # every hidden layer, as both engines report
    dense_layers: tuple[int, ...] = (0,)  # zero-filled in the payload
    top_k: int = 2
    num_experts: int = 64
    vocab: int = 500
    eos_token_id: int = 2  # the model's EOS, emitted at step `eos_at`
    eos_at: int | None = None
    ignore_eos: bool = False  # keep generating after EOS / stop tokens (client must cut)
    routes: Literal["present", "absent", "none"] = "present"
    sglang_dtype: str | None = None  # e.g. "uint8": also sets meta_info.routed_experts_dtype
    sglang_info_path: str = "/get_model_info"
    index_topk: int | None = None  # SGLang: DSA indexer choices (`return_indexer_topk`) over `indexer_layers`
    indexer_layers: int = 2
    fail_first: int = 0  # that many generation requests get `fail_status` first
    fail_status: int = 503
    always_status: int | None = None
    malformed: bool = False
    delay: float = 0.0  # seconds before answering a generation request
    mutate: Callable[[str, Any], Any] | None = None  # rewrites a generation response (path, JSON) before sending


@dataclass
class Served:
    path: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routes: np.ndarray  # (num_tokens - 1, num_layers, top_k), dense layers zero
    indexer: np.ndarray | None = None  # (num_tokens - 1, indexer layers, index_topk) key positions, -1 padded


@dataclass
class StubServer:
    config: StubConfig
    url: str = ""
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, path, JSON body)
    served: list[Served] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    failures: int = 0

    def posts(self, path: str) -> list[Any]:
        with self.lock:
            return [body for method, p, body in self.requests if method == "POST" and p == path]


@contextmanager
def stub_server(config: StubConfig | None = None, *, max_lifetime: float = 30.0) -> Iterator[StubServer]:
    """Start the stub on an ephemeral port of 127.0.0.1; it stops on exit (or after `max_lifetime`)."""
    stub = StubServer(config or StubConfig())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.stub = stub  # type: ignore[attr-defined]
    stub.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    watchdog = threading.Timer(max_lifetime, httpd.shutdown)
    watchdog.daemon = True
    thread.start()
    watchdog.start()
    try:
        yield stub
    finally:
        stub.stopping.set()
        watchdog.cancel()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def closed_port_url() -> str:
    """A 127.0.0.1 URL where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # silence the default stderr log
        pass

    @property
    def stub(self) -> StubServer:
        return self.server.stub  # type: ignore[attr-defined,no-any-return]

    def do_GET(self) -> None:
        cfg = self.stub.config
        self._record("GET", None)
        if self.path == "/v1/models":
            model = {"id": cfg.model, "object": "model", "owned_by": "vllm", "root": cfg.model}
            self._json(200, {"object": "list", "data": [model]})
        elif self.path == cfg.sglang_info_path:
            self._json(200, {"model_path": cfg.model, "tokenizer_path": cfg.model, "is_generation": True})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"null")
        self._record("POST", body)
        if self.path not in ("/v1/completions", "/generate"):
            return self._json(404, {"detail": "Not Found"})
        cfg, stub = self.stub.config, self.stub
        if cfg.delay and stub.stopping.wait(cfg.delay):
            return None
        with stub.lock:
            transient = stub.failures < cfg.fail_first
            stub.failures += transient
        status = cfg.always_status or (cfg.fail_status if transient else None)
        if status is not None:
            return self._json(status, {"error": {"message": f"stub failure {status}", "code": status}})
        if cfg.malformed:
            return self._raw(200, b'{"choices": [{"index": 0, "token_ids": [1, 2')
        if self.path == "/v1/completions":
            if body.get("model") != cfg.model:
                message = f"The model `{body.get('model')}` does not exist."
                return self._json(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
            return self._answer(self._vllm(prompts, body))
        batched = isinstance(body["input_ids"][0], list)
        answers = [self._sglang(p, body) for p in (body["input_ids"] if batched else [body["input_ids"]])]
        return self._answer(answers if batched else answers[0])

    def _answer(self, payload: Any) -> None:
        mutate = self.stub.config.mutate
        return self._json(200, payload if mutate is None else mutate(self.path, payload))

    # --- generation -----------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_new: int, seed: int, stop_ids: list[int]) -> Served:
        cfg = self.stub.config
        rng = np.random.default_rng([seed, *prompt])
        tokens = rng.integers(3, cfg.vocab, size=max_new).tolist()
        if cfg.eos_at is not None and cfg.eos_at < max_new:
            tokens[cfg.eos_at] = cfg.eos_token_id
        if not cfg.ignore_eos:
            stops = [i for i, t in enumerate(tokens) if t == cfg.eos_token_id or t in stop_ids]
            tokens = tokens[: stops[0] + 1] if stops else tokens
        logprobs = (-3.0 * rng.random(len(tokens))).tolist()
        rows = len(prompt) + len(tokens) - 1
        keys = rng.random((rows * cfg.num_layers, cfg.num_experts))
        routes = np.argsort(keys, axis=1)[:, : cfg.top_k].reshape(rows, cfg.num_layers, cfg.top_k)
        routes[:, list(cfg.dense_layers)] = 0
        served = Served(self.path, prompt, tokens, logprobs, routes, self._indexer(rng, rows))
        with self.stub.lock:
            self.stub.served.append(served)
        return served

    def _indexer(self, rng: np.random.Generator, rows: int) -> np.ndarray | None:
        """Canonical indexer choices: row t keeps min(I, t + 1) of the keys 0..t, sorted, then -1."""
        cfg = self.stub.config
        if cfg.index_topk is None:
            return None
        out = np.full((rows, cfg.indexer_layers, cfg.index_topk), -1, np.int32)
        for t in range(rows):
            for layer in range(cfg.indexer_layers):
                keys = np.sort(rng.permutation(t + 1)[: cfg.index_topk])
                out[t, layer, : keys.size] = keys
        return out

    def _vllm(self, prompts: list[list[int]], body: dict[str, Any]) -> dict[str, Any]:
        cfg, choices, completion_tokens = self.stub.config, [], 0
        for index, prompt in enumerate(prompts):
            stop_ids = body.get("stop_token_ids") or []
            out = self._generate(prompt, body.get("max_tokens", 16), body.get("seed") or 0, stop_ids)
            completion_tokens += len(out.tokens)
            finished = bool(out.tokens) and (out.tokens[-1] == cfg.eos_token_id or out.tokens[-1] in stop_ids)
            choice: dict[str, Any] = {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": "stop" if finished else "length",
                "stop_reason": out.tokens[-1] if finished and out.tokens[-1] in stop_ids else None,
                "prompt_logprobs": None,
            }
            if body.get("logprobs") is not None:
                choice["logprobs"] = {
                    "text_offset": [0] * len(out.tokens),
                    "token_logprobs": out.logprobs,
                    "tokens": [f"token_id:{t}" for t in out.tokens],
                    "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(out.tokens, out.logprobs, strict=True)],
                }
            if body.get("return_token_ids"):
                choice["token_ids"], choice["prompt_token_ids"] = out.tokens, prompt
            if cfg.routes != "absent":
                choice["routed_experts"] = None if cfg.routes == "none" else _npy_b64(out.routes, cfg.num_experts)
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        usage["total_tokens"] = prompt_tokens + completion_tokens
        return {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": int(time.time()),
            "model": cfg.model,
            "choices": choices,
            "usage": usage,
        }

    def _sglang(self, prompt: list[int], body: dict[str, Any]) -> dict[str, Any]:
        cfg, sampling = self.stub.config, body.get("sampling_params") or {}
        stop_ids = sampling.get("stop_token_ids") or []
        out = self._generate(prompt, sampling.get("max_new_tokens", 128), sampling.get("sampling_seed") or 0, stop_ids)
        finished = bool(out.tokens) and (out.tokens[-1] == cfg.eos_token_id or out.tokens[-1] in stop_ids)
        reason = (
            {"type": "stop", "matched": out.tokens[-1]} if finished else {"type": "length", "length": len(out.tokens)}
        )
        meta: dict[str, Any] = {
            "id": "req-stub",
            "finish_reason": reason,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out.tokens),
            "cached_tokens": 0,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(out.tokens, out.logprobs, strict=True)]
        if body.get("return_routed_experts") and cfg.routes != "absent":
            dtype = cfg.sglang_dtype or "int32"
            raw = base64.b64encode(out.routes.astype(dtype).tobytes()).decode("ascii")
            meta["routed_experts"] = None if cfg.routes == "none" else raw
            if cfg.sglang_dtype is not None:
                meta["routed_experts_dtype"] = cfg.sglang_dtype
        if body.get("return_indexer_topk") and out.indexer is not None:
            meta["indexer_topk"] = base64.b64encode(out.indexer.tobytes()).decode("ascii")
        return {"text": "", "output_ids": out.tokens, "meta_info": meta}

    # --- plumbing -------------------------------------------------------------------------------
    def _record(self, method: str, body: Any) -> None:
        with self.stub.lock:
            self.stub.requests.append((method, self.path, body))

    def _json(self, status: int, payload: Any) -> None:
        self._raw(status, json.dumps(payload).encode("utf-8"))

    def _raw(self, status: int, data: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 429:
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass


def _npy_b64(routes: np.ndarray, num_experts: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if num_experts <= 256 else np.uint16))
    return base64.b64encode(buffer.getvalue()).decode("ascii")
