"""What the remote inference clients share: one bounded HTTP request per prompt, checked responses.

`RemoteEngine` is the base of `VLLMClient` and `SGLangClient` (engines/remote/clients.py): it checks the URL and
concurrency, runs `concurrency` requests at a time through `BoundedHTTP` (engines/remote/http.py), refuses a
response from another model (`ModelMismatchError`) and cuts each rollout after its first EOS. A subclass
gives the request body, reads the token ids and log-probs, and decodes the routes. `checked_token_ids`
and `checked_logprobs` hold token ids to ints in [0, 2**31) and log-probs to real numbers (not NaN, not
+inf), one per token (`ResponseFieldError`); `excerpt` bounds what an error message quotes.
"""

from __future__ import annotations

import math
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from routereplay.engines.hf.engine import Rollout, SamplingParams, check_prompts, checked_prefix_routes
from routereplay.engines.remote.http import EXCERPT_CHARS, BoundedHTTP, HTTPPolicy
from routereplay.engines.vllm.forced_routes import XARG_KEY, check_forced
from routereplay.errors import (
    ConfigError,
    EngineRequestError,
    ForcedRoutesError,
    MissingRoutesError,
    ModelMismatchError,
    PayloadError,
    ResponseFieldError,
    UnsupportedByEngineError,
)
from routereplay.trace.route_trace import RouteTrace

MAX_TOKEN_ID = 2**31  # token ids are ints in [0, MAX_TOKEN_ID): what a trainer's int32/int64 ids hold


def excerpt(value: Any) -> str:
    """A bounded excerpt of any parsed JSON value (depth, items and characters capped)."""
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxlist, bounded.maxdict = 2, 4, 4
    bounded.maxstring = bounded.maxlong = bounded.maxother = 40
    return bounded.repr(value)


class RemoteEngine(ABC):
    """Shared plumbing: the bounded HTTP policy, concurrency, response checks, EOS cut."""

    name = "remote"
    generate_path = "/"
    supports_prefix_replay = False  # `generate(prefix_routes=...)`: VLLMClient with the plugin on the server

    def __init__(
        self, url: str, model: str | None, policy: HTTPPolicy, concurrency: int, policy_version: int | None
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency={concurrency!r} must be an int >= 1")
        self.url = url.rstrip("/")
        self.model = model
        self.policy, self.concurrency = policy, concurrency
        self.policy_version = policy_version  # set it after each weight sync, like HFEngine.sync_weights

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
        *,
        prefix_routes: Sequence[RouteTrace | None] | None = None,
    ) -> list[Rollout]:
        """Sample one response per prompt; `progress(done, total)` is called as requests finish.

        `prefix_routes` (one `RouteTrace` or None per prompt) asks the server to force those routes on the
        prompt's rows (engine-side prefix replay); only servers that can (`supports_prefix_replay`) take it."""
        check_prompts(prompts)
        forced = self._forced(prompts, prefix_routes)
        results: dict[int, Rollout] = {}
        workers = min(self.concurrency, len(prompts))
        with self._http(workers) as http:
            pool = ThreadPoolExecutor(max_workers=workers)
            try:
                futures = {
                    pool.submit(self._rollout, http, i, [int(t) for t in p], params, forced[i]): i
                    for i, p in enumerate(prompts)
                }
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    if progress is not None:
                        progress(len(results), len(prompts))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return [results[i] for i in range(len(prompts))]

    def _http(self, connections: int = 1) -> BoundedHTTP:
        return BoundedHTTP(self.policy, server=self.name, max_connections=connections, tls=self.url.startswith("https"))

    def _forced(
        self, prompts: Sequence[Sequence[int]], prefix_routes: Sequence[RouteTrace | None] | None
    ) -> list[RouteTrace | None]:
        """Each prompt's routes to force (None: route live); refused where the server cannot force."""
        routes = checked_prefix_routes(prefix_routes, prompts)
        given = [i for i, trace in enumerate(routes) if trace is not None]
        if given and not self.supports_prefix_replay:
            raise UnsupportedByEngineError(
                f"prefix_routes given for prompt(s) {given[:8]}: {self.name} servers cannot be told which experts to "
                "use; use VLLMClient against a vLLM with the routereplay plugin, or pass prefix_routes=None"
            )
        return routes

    def _rollout(
        self, http: BoundedHTTP, index: int, prompt: list[int], params: SamplingParams, forced: RouteTrace | None
    ) -> Rollout:
        body = self._body(prompt, params, params.seed + index)
        if forced is not None:
            body = self._with_forced(body, prompt, forced, index)
        try:
            data = http.call("POST", self.url + self.generate_path, body)
        except EngineRequestError as exc:
            failure = self._request_failure(exc, index)
            if failure is exc:
                raise
            raise failure from exc
        where = f"{self.name} {self.url}, sequence {index}"
        if not isinstance(data, dict):
            raise PayloadError(f"{where}: expected a JSON object, got {type(data).__name__}")
        self._check_model(data, where)
        try:
            response_ids, logprobs = self._tokens(data, where)
            trace = self._decode(data, num_tokens=len(prompt) + len(response_ids), sequence=index)
        except MissingRoutesError as exc:
            raise MissingRoutesError(f"{self.name} server {self.url}: {exc}") from None
        if forced is not None:
            check_forced(forced, trace, where=where)
        return _cut_at_eos(prompt, response_ids, logprobs, trace, params.eos_token_id)

    def _check_model(self, data: dict[str, Any], where: str) -> None:
        """Refuse a response whose `"model"` names another model than the client asked for."""
        served = data.get("model")
        if served is None or self.model is None:
            return
        if not isinstance(served, str):
            raise ResponseFieldError(f'{where}: "model" must be a string, got {excerpt(served)}')
        if served != self.model:
            raise ModelMismatchError(
                f"{where}: the response comes from model {served!r}, not model={self.model!r} that the client "
                f"asked for; point the client at a server of {self.model!r}, or pass model={served!r} if that is "
                "the same model under another name (vLLM answers with its first --served-model-name)"
            )

    def _request_failure(self, exc: EngineRequestError, index: int) -> Exception:
        """What a failed request of sequence `index` raises: the server's refusal of the forced routes (HTTP 400
        naming their key) as `ForcedRoutesError`, else `exc` itself (a subclass names more of its server's errors)."""
        if exc.status == 400 and XARG_KEY in exc.body:
            return ForcedRoutesError(
                f"{self.name} server {self.url}, sequence {index}: the server refused the forced routes: "
                f"{exc.body[: 4 * EXCERPT_CHARS]}"
            )
        return exc

    def _with_forced(self, body: dict[str, Any], prompt: list[int], forced: RouteTrace, index: int) -> dict[str, Any]:
        """The request body asking the server to force `forced` (servers that can override this)."""
        raise UnsupportedByEngineError(f"{self.name} servers cannot force routes")

    @abstractmethod
    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        """The request body for one prompt (server-specific)."""

    @abstractmethod
    def _tokens(self, data: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
        """Response token ids and their log-probs (server-specific)."""

    @abstractmethod
    def _decode(self, data: dict[str, Any], *, num_tokens: int, sequence: int) -> RouteTrace:
        """The response's routes as a validated trace (server-specific decoder)."""


def checked_token_ids(values: Any, where: str, field: str) -> list[int]:
    """`values` as token ids: a list of ints (not bools, not floats) in [0, MAX_TOKEN_ID)."""
    if not isinstance(values, list):
        raise ResponseFieldError(f"{where}: {field} must be a list of token ids, got {excerpt(values)}")
    for position, value in enumerate(values):
        if type(value) is not int or not 0 <= value < MAX_TOKEN_ID:
            raise ResponseFieldError(
                f"{where}: {field}[{position}] = {excerpt(value)} is not a token id (an int in [0, 2**31)); "
                "the server sent a malformed response (a proxy rewriting it, or another API's answer?)"
            )
    return values


def checked_logprobs(values: Any, where: str, field: str, num_tokens: int) -> list[float]:
    """`values` as one log-prob per response token: real numbers, not NaN, not +inf."""
    if not isinstance(values, list) or len(values) != num_tokens:
        count = len(values) if isinstance(values, list) else excerpt(values)
        raise ResponseFieldError(
            f"{where}: {field} must give one log-prob per response token ({num_tokens} tokens, {count} log-probs)"
        )
    for position, value in enumerate(values):
        if value is None:
            raise ResponseFieldError(f"{where}: {field} holds null log-probs for response tokens")
        if type(value) not in (int, float) or math.isnan(value) or value == math.inf:
            raise ResponseFieldError(
                f"{where}: {field}[{position}] = {excerpt(value)} is not a log-prob (a real number, not NaN or +inf)"
            )
    return [float(v) for v in values]


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
