"""Clients for remote inference servers (vLLM, SGLang) that return routes with every rollout.

`VLLMClient` and `SGLangClient` have the built-in engine's interface, `generate(prompts, params)
-> list[Rollout]`, so an RL loop can swap `HFEngine` for a real server. Each prompt is one HTTP
request (run `concurrency` at a time) with its own seed `params.seed + index`, so repeated prompts
(GRPO groups) are sampled independently:
- vLLM >= 0.22: POST /v1/completions with the prompt as token ids, `return_token_ids: true` and
  `logprobs: 1`; reads `choices[0].token_ids`, `.logprobs.token_logprobs`, `.routed_experts`.
- SGLang: POST /generate with `input_ids`, `return_logprob: true`, `return_routed_experts: true`;
  reads `output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text] triples) and
  `meta_info.routed_experts`.
Both servers must run with --enable-return-routed-experts. Connection errors, timeouts, 429 and 5xx
are retried with exponential backoff; other 4xx are not. httpx is imported only when a request is
made (`pip install 'routereplay[serve]'`).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from routereplay.engines.hf import Rollout, SamplingParams
from routereplay.engines.sglang import decode_sglang
from routereplay.engines.vllm import decode_vllm
from routereplay.errors import ConfigError, MissingRoutesError, PayloadEncodingError, PayloadError, RouteReplayError
from routereplay.trace import RouteTrace

if TYPE_CHECKING:
    import httpx

_EXCERPT = 300  # characters of a response body quoted in errors


class EngineRequestError(RouteReplayError):
    """An HTTP request to an inference server failed (after retries, when the failure is transient)."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.url, self.status, self.body = url, status, body


class EngineTimeoutError(EngineRequestError):
    """Every attempt of a request timed out (raise `timeout=`, or check that the server is alive)."""


class EngineModelError(ConfigError):
    """The server serves a different model than the client was configured for."""


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError("remote engine clients need httpx: pip install 'routereplay[serve]'") from exc
    return httpx


class _RemoteEngine(ABC):
    """Shared HTTP plumbing: retries, JSON parsing, concurrency, EOS cut."""

    name = "remote"
    generate_path = "/"

    def __init__(
        self,
        url: str,
        model: str | None,
        timeout: float,
        retries: int,
        backoff: float,
        concurrency: int,
        policy_version: int | None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        if timeout <= 0 or retries < 1 or backoff < 0 or concurrency < 1:
            raise ConfigError(
                f"timeout={timeout} must be > 0, retries={retries} (total attempts per request) >= 1, "
                f"backoff={backoff} >= 0 and concurrency={concurrency} >= 1"
            )
        self.url = url.rstrip("/")
        self.model = model
        self.timeout, self.retries, self.backoff, self.concurrency = timeout, retries, backoff, concurrency
        self.policy_version = policy_version  # set it after each weight sync, like HFEngine.sync_weights

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Rollout]:
        """Sample one response per prompt; `progress(done, total)` is called as requests finish."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("generate needs at least one prompt, and every prompt at least one token")
        httpx = _import_httpx()
        results: dict[int, Rollout] = {}
        with httpx.Client(timeout=self.timeout) as client:
            pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)))
            try:
                futures = {
                    pool.submit(self._rollout, client, i, [int(t) for t in p], params): i for i, p in enumerate(prompts)
                }
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    if progress is not None:
                        progress(len(results), len(prompts))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return [results[i] for i in range(len(prompts))]

    def _rollout(self, client: httpx.Client, index: int, prompt: list[int], params: SamplingParams) -> Rollout:
        data = self._call(client, "POST", self.generate_path, self._body(prompt, params, params.seed + index))
        where = f"{self.name} {self.url}, sequence {index}"
        if not isinstance(data, dict):
            raise PayloadError(f"{where}: expected a JSON object, got {type(data).__name__}")
        try:
            response_ids, logprobs = self._tokens(data, where)
            trace = self._decode(data, num_tokens=len(prompt) + len(response_ids), sequence=index)
        except MissingRoutesError as exc:
            raise MissingRoutesError(f"{self.name} server {self.url}: {exc}") from None
        return _cut_at_eos(prompt, response_ids, logprobs, trace, params.eos_token_id)

    @abstractmethod
    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        """The request body for one prompt (server-specific)."""

    @abstractmethod
    def _tokens(self, data: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
        """Response token ids and their log-probs (server-specific)."""

    @abstractmethod
    def _decode(self, data: dict[str, Any], *, num_tokens: int, sequence: int) -> RouteTrace:
        """The response's routes as a validated trace (server-specific decoder)."""

    def _call(self, client: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request with retries on connection errors, timeouts, 429 and 5xx; returns parsed JSON."""
        httpx = _import_httpx()
        url = self.url + path
        failure, status, text, timed_out = "", None, "", False
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = client.request(method, url, json=body)
            except httpx.TransportError as exc:  # connection errors and timeouts
                timed_out, status, text = isinstance(exc, httpx.TimeoutException), None, ""
                failure = f"timed out after {self.timeout}s" if timed_out else f"{type(exc).__name__}: {exc}"
                continue
            status, text, timed_out = response.status_code, response.text, False
            if status < 400:
                return _parse_json(text, url, status)
            failure = f"HTTP {status}: {text[:_EXCERPT]!r}"
            if status != 429 and status < 500:
                raise EngineRequestError(
                    f"{method} {url} failed with {failure} (not retried)", url=url, status=status, body=text
                )
        error = EngineTimeoutError if timed_out else EngineRequestError
        raise error(
            f"{method} {url} failed after {self.retries} attempts; last: {failure}. Check that the {self.name} "
            "server is up and healthy, or raise retries=/timeout=",
            url=url,
            status=status,
            body=text,
        )


class VLLMClient(_RemoteEngine):
    """Rollouts from a vLLM (>= 0.22) OpenAI-compatible server started with --enable-return-routed-experts.

    `num_experts`, `moe_layers` (which of the payload's all-hidden-layer axis to keep), `layers` and
    `top_k` are passed to `decode_vllm`. `retries` is the total number of attempts per request.
    """

    name = "vLLM"
    generate_path = "/v1/completions"

    def __init__(
        self,
        url: str,
        *,
        model: str,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
        top_k: int | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        concurrency: int = 8,
        policy_version: int | None = None,
    ) -> None:
        super().__init__(url, model, timeout, retries, backoff, concurrency, policy_version)
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_layers = None if moe_layers is None else tuple(moe_layers)
        self.layers = None if layers is None else tuple(layers)

    def check_server(self) -> list[str]:
        """GET /v1/models; raise `EngineModelError` unless `model` is served. Returns the served names."""
        with _import_httpx().Client(timeout=self.timeout) as client:
            data = self._call(client, "GET", "/v1/models")
        served = (
            [str(m.get("id")) for m in data.get("data", []) if isinstance(m, dict)] if isinstance(data, dict) else []
        )
        if self.model not in served:
            raise EngineModelError(
                f"vLLM server {self.url} serves {served}, not model={self.model!r}; pass one of those names "
                "(vLLM's --served-model-name) or point the client at the right server"
            )
        return served

    def _rollout(self, client: httpx.Client, index: int, prompt: list[int], params: SamplingParams) -> Rollout:
        try:
            return super()._rollout(client, index, prompt, params)
        except EngineRequestError as exc:
            if exc.status == 404 and "model" in exc.body.lower():
                raise EngineModelError(
                    f"vLLM server {self.url} does not serve model={self.model!r} ({exc.body[:_EXCERPT]!r}); "
                    "call check_server() to list the served names"
                ) from exc
            raise

    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "logprobs": 1,
            "return_token_ids": True,
            "stream": False,
        }
        if params.eos_token_id is not None:
            body["stop_token_ids"] = [params.eos_token_id]
        return body

    def _tokens(self, data: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise PayloadError(f"{where}: expected exactly one choice, got {str(choices)[:_EXCERPT]}")
        token_ids = choices[0].get("token_ids")
        if token_ids is None:
            raise PayloadError(
                f"{where}: the choice has no token_ids; vLLM >= 0.10.2 returns them for return_token_ids"
            )
        logprobs = (choices[0].get("logprobs") or {}).get("token_logprobs")
        return _checked(token_ids, logprobs, where, "choices[0].logprobs.token_logprobs")

    def _decode(self, data: dict[str, Any], *, num_tokens: int, sequence: int) -> RouteTrace:
        return decode_vllm(
            data,
            num_experts=self.num_experts,
            layers=self.layers,
            moe_layers=self.moe_layers,
            top_k=self.top_k,
            num_tokens=num_tokens,
            sequence=sequence,
            policy_version=self.policy_version,
        )


class SGLangClient(_RemoteEngine):
    """Rollouts from an SGLang server (native /generate) started with --enable-return-routed-experts.

    `num_layers` is the payload's layer count (every hidden layer); `moe_layers` keeps the MoE ones.
    `model` is optional and only checked by `check_server()`. `retries` is the total attempts per request.
    """

    name = "SGLang"
    generate_path = "/generate"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        num_layers: int,
        top_k: int,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        concurrency: int = 8,
        policy_version: int | None = None,
    ) -> None:
        super().__init__(url, model, timeout, retries, backoff, concurrency, policy_version)
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.moe_layers = None if moe_layers is None else tuple(moe_layers)

    def check_server(self) -> dict[str, Any]:
        """GET /get_model_info (or /model_info); raise `EngineModelError` if `model` is set and not served."""
        with _import_httpx().Client(timeout=self.timeout) as client:
            try:
                info = self._call(client, "GET", "/get_model_info")
            except EngineRequestError as exc:
                if exc.status != 404:
                    raise
                info = self._call(client, "GET", "/model_info")
        if not isinstance(info, dict):
            raise PayloadError(f"SGLang server {self.url}: model info is {type(info).__name__}, expected an object")
        served = [str(info[k]) for k in ("model_path", "served_model_name") if info.get(k) is not None]
        if self.model is not None and self.model not in served:
            raise EngineModelError(
                f"SGLang server {self.url} serves {served}, not model={self.model!r}; pass model= as the server's "
                "--model-path (or --served-model-name), or point the client at the right server"
            )
        return info

    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "sampling_seed": seed,
        }
        if params.eos_token_id is not None:
            sampling["stop_token_ids"] = [params.eos_token_id]
        return {
            "input_ids": prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "return_routed_experts": True,
            "stream": False,
        }

    def _tokens(self, data: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
        meta = data.get("meta_info")
        triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(triples, list) or not all(isinstance(t, (list, tuple)) and len(t) >= 2 for t in triples):
            raise PayloadError(f"{where}: meta_info.output_token_logprobs must be [logprob, token_id, text] triples")
        output_ids = data.get("output_ids")
        if output_ids is None:
            output_ids = [t[1] for t in triples]
        elif list(output_ids) != [t[1] for t in triples]:
            raise PayloadError(f"{where}: output_ids and the token ids of output_token_logprobs disagree")
        return _checked(output_ids, [t[0] for t in triples], where, "meta_info.output_token_logprobs")

    def _decode(self, data: dict[str, Any], *, num_tokens: int, sequence: int) -> RouteTrace:
        return decode_sglang(
            data,
            num_layers=self.num_layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
            moe_layers=self.moe_layers,
            num_tokens=num_tokens,
            sequence=sequence,
            policy_version=self.policy_version,
        )


def _parse_json(text: str, url: str, status: int) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PayloadEncodingError(
            f"{url} answered HTTP {status} with a body that is not valid JSON ({exc}): {text[:_EXCERPT]!r}; "
            "a truncated response or a proxy error page"
        ) from None


def _checked(token_ids: Any, logprobs: Any, where: str, field: str) -> tuple[list[int], list[float]]:
    if not isinstance(token_ids, list) or not isinstance(logprobs, list) or len(token_ids) != len(logprobs):
        raise PayloadError(
            f"{where}: {field} must give one log-prob per response token ({len(token_ids or [])} tokens, "
            f"{len(logprobs) if isinstance(logprobs, list) else logprobs!r} log-probs)"
        )
    if any(lp is None for lp in logprobs):
        raise PayloadError(f"{where}: {field} holds null log-probs for response tokens")
    return [int(t) for t in token_ids], [float(lp) for lp in logprobs]


def _cut_at_eos(
    prompt: list[int], response_ids: list[int], logprobs: list[float], trace: RouteTrace, eos_token_id: int | None
) -> Rollout:
    """Cut after the first EOS (inclusive) with its log-probs and trace rows (prompt + response - 1)."""
    finished = eos_token_id is not None and eos_token_id in response_ids
    length = response_ids.index(eos_token_id) + 1 if eos_token_id is not None and finished else len(response_ids)
    rows = len(prompt) + length - 1
    if trace.num_tokens != rows:
        trace = trace.slice(trace.start, trace.start + rows)
    return Rollout(prompt, response_ids[:length], logprobs[:length], trace, finished)


__all__ = ["EngineModelError", "EngineRequestError", "EngineTimeoutError", "SGLangClient", "VLLMClient"]
