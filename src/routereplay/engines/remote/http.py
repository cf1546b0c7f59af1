"""Bounded HTTP for the remote engine clients: every attempt ends by a deadline, every body is capped.

A plain HTTP client applies its timeout to each socket operation and reads any body whole, so a
server that sends one byte just before each timeout keeps a request alive for ever, and one huge
response takes all the memory. `BoundedHTTP` runs each attempt (connect, send, wait for the
headers, read the body) under the limits of an `HTTPPolicy`:
- `deadline`: seconds one attempt may take in all, from connect to the last body byte (default
  `DEADLINE_PER_TIMEOUT` x `timeout`: the wait for the answer, then as long again to receive it,
  so `timeout=1` ends a trickled attempt after 2 s, `timeout=60` after 120 s). Every socket
  operation waits at most min(`timeout`, time left), and none starts once the deadline has passed,
  so a server trickling its headers or its body is cut off at the deadline (`DeadlineExceededError`).
  Each retry gets a fresh deadline: a call lasts at most `retries` x `deadline` plus the backoff
  sleeps (`backoff` x (1 + 2 + 4 ...)). Name resolution (DNS) is outside the socket clock.
- `timeout`: the longest silence (connect, or waiting for the next bytes); a non-streamed
  generation sends nothing until it is done, so this also bounds the generation time.
- `max_response_bytes`: a `Content-Length` above it is refused before the body is read; a body
  without one (chunked, or read until close) is read in pieces of at most 64 KiB and refused as
  soon as it passes the cap (`ResponseTooLargeError`), so at most cap + 64 KiB is held. A body
  shorter than its `Content-Length` (the server closed mid-body) is a transport error; bytes after
  the declared length are never read.
- `retries` attempts in all: connection errors, timeouts, deadlines, 429 and 5xx are retried with
  exponential backoff; other 4xx and oversized responses are not.
Only a 200 answer is parsed: a redirect (3xx, never followed) or another 2xx such as 204 or 299 is
an `EngineRequestError` naming the status (not retried), however engine-like its JSON body looks.
Bodies are asked for uncompressed (`Accept-Encoding: identity`); a compressed body is refused, not
inflated, so the cap counts the bytes the JSON parser sees. JSON is parsed by `load_json` (bounded
depth and number length). Environment proxies (HTTP_PROXY) are not used. httpcore (installed with
httpx, `pip install 'routereplay[serve]'`) is imported only when a pool is opened.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

from routereplay.errors import (
    ConfigError,
    DeadlineExceededError,
    EngineRequestError,
    EngineTimeoutError,
    MissingDependencyError,
    PayloadEncodingError,
    ResponseTooLargeError,
)
from routereplay.jsondocument import JsonLimits, load_json

DEFAULT_TIMEOUT = 60.0  # seconds of silence: connect, or between two reads
DEADLINE_PER_TIMEOUT = 2.0  # default deadline (seconds per attempt, connect to last byte) = this x timeout
DEFAULT_MAX_RESPONSE_BYTES = 256 << 20  # 256 MiB: SGLang int32 routes of ~100k tokens x 61 layers x top-8
DEFAULT_RETRIES = 3  # attempts in all
DEFAULT_BACKOFF = 0.5  # seconds before the 2nd attempt, doubling after
EXCERPT_CHARS = 300  # characters of a response body quoted in errors
ERROR_BODY_BYTES = 64 << 10  # bytes of an error response kept on EngineRequestError.body
_CAP_ADVICE = (
    "Raise the client's max_response_bytes= if responses this large are expected (routes grow with "
    "tokens x layers x top-k), else check the server"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HTTPPolicy:
    """Limits and retries of one client's requests (see the module docstring for each field)."""

    timeout: float = DEFAULT_TIMEOUT
    deadline: float | None = None  # None: DEADLINE_PER_TIMEOUT x timeout (resolved on construction)
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    retries: int = DEFAULT_RETRIES
    backoff: float = DEFAULT_BACKOFF

    def __post_init__(self) -> None:
        if self.deadline is None and _seconds(self.timeout):
            object.__setattr__(self, "deadline", DEADLINE_PER_TIMEOUT * self.timeout)
        for name, minimum in (("timeout", 0.0), ("deadline", 0.0), ("backoff", None)):
            value = getattr(self, name)
            if not _seconds(value) or (value <= minimum if minimum is not None else value < 0):
                bound = "> 0" if minimum is not None else ">= 0"
                raise ConfigError(f"{name}={value!r} must be a finite number of seconds {bound}")
        for name, least, meaning in (
            ("retries", 1, "total attempts per request"),
            ("max_response_bytes", 1, "bytes of one response body"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name}={value!r} ({meaning}) must be an int >= {least}")

    @property
    def attempt_seconds(self) -> float:
        """The resolved `deadline`: seconds one attempt may take, connect to last body byte."""
        assert self.deadline is not None  # resolved in __post_init__
        return self.deadline


def _seconds(value: object) -> bool:
    """Whether `value` is a finite real number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class BoundedHTTP:
    """A connection pool whose requests follow an `HTTPPolicy`; use it as a context manager.

    `call(method, url, body)` sends `body` as JSON and returns the parsed JSON answer, or raises an
    `EngineRequestError` subclass naming the URL and the policy field to change. Thread-safe: each
    thread's attempt has its own deadline.
    """

    def __init__(self, policy: HTTPPolicy, *, server: str, max_connections: int = 1, tls: bool = False) -> None:
        self.policy, self.server = policy, server
        httpcore, httpx = _import_http()
        self._errors = httpcore
        self._clock = _Clock()
        backend = _DeadlineBackend(httpcore.SyncBackend(), self._clock, httpcore)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context() if tls else None,  # httpx's: honours SSL_CERT_FILE
            max_connections=max_connections,
            network_backend=backend,
        )

    def __enter__(self) -> BoundedHTTP:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._pool.close()

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One request with retries; the parsed JSON of the first 200 answer (any other status below 400
        is an `EngineRequestError` naming it, not retried)."""
        policy = self.policy
        content = None if body is None else json.dumps(body).encode("utf-8")
        failure: EngineRequestError | None = None
        for attempt in range(policy.retries):
            if attempt:
                time.sleep(policy.backoff * 2 ** (attempt - 1))
            try:
                status, data = self._attempt(method, url, content)
            except ResponseTooLargeError:
                raise  # the same answer again would be as large
            except EngineRequestError as exc:
                failure = exc
                continue
            if status == 200:
                what = f"{method} {url} (HTTP {status})"
                return load_json(cast(bytes, data), what=what, error=PayloadEncodingError, limits=self._json_limits)
            text = bytes(data[:ERROR_BODY_BYTES]).decode("utf-8", "replace")
            message = f"HTTP {status}: {text[:EXCERPT_CHARS]!r}"
            if status < 400:  # 1xx / 2xx / 3xx but not 200: not the engine's answer, whatever the body holds
                raise EngineRequestError(
                    f"{method} {url} answered {message}, not 200 (not retried): {_not_an_answer(status)}",
                    url=url,
                    status=status,
                    body=text,
                )
            if status != 429 and status < 500:
                raise EngineRequestError(
                    f"{method} {url} failed with {message} (not retried)", url=url, status=status, body=text
                )
            failure = EngineRequestError(message, url=url, status=status, body=text)
        assert failure is not None  # retries >= 1
        advice = f"Check that the {self.server} server is up and healthy, or raise retries="
        prefix = f"{method} {url} failed after {policy.retries} attempts; last: {failure}"
        if isinstance(failure, DeadlineExceededError):
            raise DeadlineExceededError(
                f"{prefix}. {advice}/deadline=",
                url=url,
                deadline=failure.deadline,
                elapsed=failure.elapsed,
                received=failure.received,
            )
        kind = EngineTimeoutError if isinstance(failure, EngineTimeoutError) else EngineRequestError
        raise kind(f"{prefix}. {advice}/timeout=", url=url, status=failure.status, body=failure.body)

    @property
    def _json_limits(self) -> JsonLimits:
        return JsonLimits(max_bytes=self.policy.max_response_bytes)

    def _attempt(self, method: str, url: str, content: bytes | None) -> tuple[int, bytearray]:
        """(status, body) of one attempt; transport failures become (retried) EngineRequestErrors."""
        httpcore, policy = self._errors, self.policy
        headers = [(b"Accept", b"application/json"), (b"Accept-Encoding", b"identity")]
        if content is not None:
            headers.append((b"Content-Type", b"application/json"))
        seconds = min(policy.timeout, policy.attempt_seconds)
        timeouts = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}
        body = bytearray()
        start = time.monotonic()
        with self._clock.attempt(start + policy.attempt_seconds):
            try:
                with self._pool.stream(
                    method, url, headers=headers, content=content, extensions={"timeout": timeouts}
                ) as response:
                    self._check_headers(method, url, response.headers)
                    for chunk in response.iter_stream():
                        body += chunk
                        if len(body) > policy.max_response_bytes:
                            raise ResponseTooLargeError(
                                f"{method} {url}: the response body passed max_response_bytes="
                                f"{policy.max_response_bytes} (no Content-Length; stopped reading after {len(body)} "
                                f"bytes). {_CAP_ADVICE}",
                                url=url,
                                limit=policy.max_response_bytes,
                                size=len(body),
                            )
                    return response.status, body
            except httpcore.TimeoutException as exc:
                elapsed = time.monotonic() - start
                if self._clock.deadline_bound():
                    raise DeadlineExceededError(
                        f"no complete response within deadline={policy.attempt_seconds}s ({elapsed:.2f}s elapsed, "
                        f"{len(body)} body bytes received): the server is too slow or trickling bytes",
                        url=url,
                        deadline=policy.attempt_seconds,
                        elapsed=elapsed,
                        received=len(body),
                    ) from exc
                raise EngineTimeoutError(
                    f"timed out after {policy.timeout}s without a byte from the server ({type(exc).__name__})",
                    url=url,
                ) from exc
            except httpcore.ConnectError as exc:
                raise EngineRequestError(f"ConnectError: {exc}", url=url) from exc
            except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
                raise EngineRequestError(f"{type(exc).__name__}: {exc}", url=url) from exc

    def _check_headers(self, method: str, url: str, headers: list[tuple[bytes, bytes]]) -> None:
        """Refuse a declared body above the cap, and a compressed body, before reading any of it."""
        cap = self.policy.max_response_bytes
        for name, value in headers:
            key = name.lower()
            if key == b"content-length" and value.strip().isdigit() and int(value) > cap:
                raise ResponseTooLargeError(
                    f"{method} {url}: the response declares Content-Length {int(value)} bytes, above "
                    f"max_response_bytes={cap}; nothing was read. {_CAP_ADVICE}",
                    url=url,
                    limit=cap,
                    size=int(value),
                )
            if key == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                raise PayloadEncodingError(
                    f"{method} {url}: the response is compressed (Content-Encoding: {value[:40].decode('latin-1')}) "
                    "although the client asked for identity; turn compression off in the server or proxy"
                )


class _Clock:
    """The deadline of the attempt the calling thread runs (per thread; none outside an attempt)."""

    __slots__ = ("_local",)

    def __init__(self) -> None:
        self._local = threading.local()

    def attempt(self, end: float) -> _Attempt:
        return _Attempt(self._local, end)

    def deadline_bound(self) -> bool:
        """Whether the last socket wait of this thread was cut short by the deadline."""
        return bool(getattr(self._local, "bound", False))

    def budget(self, timeout: float | None, expired: type[Exception]) -> float | None:
        """The wait allowed to one socket operation; raise `expired` once the deadline has passed."""
        end = getattr(self._local, "end", None)
        if end is None:
            return timeout
        left = end - time.monotonic()
        self._local.bound = timeout is None or left <= timeout
        if left <= 0:
            raise expired("the attempt's deadline has passed")
        return left if self._local.bound else timeout


@dataclass(slots=True)
class _Attempt:
    local: threading.local
    end: float

    def __enter__(self) -> None:
        self.local.end, self.local.bound = self.end, False

    def __exit__(self, *exc: object) -> None:
        self.local.end = None


class _DeadlineStream:
    """A network stream whose every read and write waits at most the time left to the deadline."""

    __slots__ = ("_clock", "_errors", "_stream")

    def __init__(self, stream: Any, clock: _Clock, errors: Any) -> None:
        self._stream, self._clock, self._errors = stream, clock, errors

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._clock.budget(timeout, self._errors.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._clock.budget(timeout, self._errors.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        budget = self._clock.budget(timeout, self._errors.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, budget), self._clock, self._errors)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend:
    """httpcore's network backend with connects bounded by the deadline and streams wrapped."""

    __slots__ = ("_clock", "_errors", "_inner")

    def __init__(self, inner: Any, clock: _Clock, errors: Any) -> None:
        self._inner, self._clock, self._errors = inner, clock, errors

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> _DeadlineStream:
        budget = self._clock.budget(timeout, self._errors.ConnectTimeout)
        stream = self._inner.connect_tcp(host, port, budget, local_address, socket_options)
        return _DeadlineStream(stream, self._clock, self._errors)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> _DeadlineStream:
        budget = self._clock.budget(timeout, self._errors.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, budget, socket_options), self._clock, self._errors)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _not_an_answer(status: int) -> str:
    """Why a status below 400 other than 200 is refused, and what to check."""
    if 300 <= status < 400:
        return (
            "a redirect, which this client never follows (a proxy, a login page or a moved route); point url= at "
            "the engine server itself"
        )
    return "engine servers answer a completed request with 200 only; check that url= is the engine, not a proxy"


def _import_http() -> tuple[Any, Any]:
    try:
        import httpcore
        import httpx
    except ImportError as exc:
        raise MissingDependencyError(
            "remote engine clients need httpx (and its httpcore): pip install 'routereplay[serve]'"
        ) from exc
    return httpcore, httpx


__all__ = ["BoundedHTTP", "HTTPPolicy"]
