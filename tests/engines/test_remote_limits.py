"""Misbehaving servers (issue 11 item 8 and the hostile-server list): deadline, response cap, retries.

Every server here is a real socket on 127.0.0.1 (tests/engines/hostile_server.py) that counts the
bytes it managed to send. No test times anything: a test shows that the client stopped early by
the count (far below what the server would have sent) and by the error the client raised.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import (
    DeadlineExceededError,
    EngineRequestError,
    EngineTimeoutError,
    ResponseTooLargeError,
    SGLangClient,
    VLLMClient,
)
from routereplay.engines.remote.http import (
    DEADLINE_PER_TIMEOUT,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TIMEOUT,
    HTTPPolicy,
)
from routereplay.errors import ConfigError, PayloadEncodingError, RouteReplayError
from tests.engines.hostile_server import (
    answer,
    close_mid_body,
    flood,
    hang_up,
    hostile_server,
    trickle_body,
    trickle_headers,
)
from tests.engines.stub_server import _npy_b64

MiB = 1 << 20
FLOOD = 64 * MiB  # what a flooding server would send if the client never stopped
CAP = 1 * MiB  # the clients' max_response_bytes in these tests
# bytes a client may hold unread in socket buffers (its receive buffer, the server's send buffer)
# after it stopped reading: well below FLOOD - the margin that shows the client stopped early
BUFFERED = 16 * MiB
PARAMS = SamplingParams(max_new_tokens=3, seed=0)


def client(url: str, kind: str = "vllm", **kwargs: Any) -> VLLMClient | SGLangClient:
    options: dict[str, Any] = {"timeout": 5.0, "backoff": 0.0, "retries": 1, "max_response_bytes": CAP, **kwargs}
    if kind == "vllm":
        return VLLMClient(url, model="m", num_experts=8, moe_layers=(1,), top_k=2, **options)
    return SGLangClient(url, num_layers=2, top_k=2, num_experts=8, moe_layers=(1,), **options)


def vllm_answer(prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """A valid vLLM completion for `prompt`: 2 hidden layers (0 dense), top-2 of 8 experts."""
    rows = len(prompt) + len(tokens) - 1
    routes = np.zeros((rows, 2, 2), np.int64)
    routes[:, 1] = [3, 5]
    choice = {
        "index": 0,
        "token_ids": tokens,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
        "routed_experts": _npy_b64(routes, 8),
    }
    return {"model": "m", "choices": [choice]}


# --- deadline --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_trickling_body_is_cut_at_the_deadline(kind: str) -> None:
    """Resource exhaustion (issue 11 item 8): a byte every 20 ms never trips the 5 s per-read timeout,
    so before the fix a 2000-byte body held the call for 40 s. The deadline (0.3 s per attempt,
    covering connect, headers and body) ends it after a handful of bytes."""
    with hostile_server(trickle_body(2000, every=0.02)) as server:
        with pytest.raises(DeadlineExceededError, match=r"within deadline=0\.3s.*raise retries=/deadline=") as info:
            client(server.url, kind, deadline=0.3).generate([[1, 2]], PARAMS)
        sent = server.sent
    assert sent < 1000, f"the server sent {sent} of 2000 body bytes: the client did not stop at its deadline"
    error = info.value
    assert error.deadline == 0.3 and error.received < 1000
    # behaviour of the deadline logic: the attempt never gives up before its deadline
    assert error.elapsed >= error.deadline * 0.99  # 1 % for the clocks of poll() and time.monotonic()
    assert error.url == server.url + ("/v1/completions" if kind == "vllm" else "/generate")


def test_trickling_headers_are_cut_at_the_deadline() -> None:
    """Resource exhaustion (issue 11 item 8): the deadline also covers the headers; a server that
    sends its header line one byte every 20 ms is cut off, not read for minutes."""
    with hostile_server(trickle_headers(2000, every=0.02)) as server:
        with pytest.raises(DeadlineExceededError, match=r"0 body bytes received"):
            client(server.url, deadline=0.3).generate([[1, 2]], PARAMS)
        sent = server.sent
    assert sent < 1000, f"the server sent {sent} header bytes: the client did not stop at its deadline"


def test_each_retry_gets_a_fresh_deadline() -> None:
    """Resource exhaustion (issue 11 item 8): with retries=2 a trickling server gets two attempts of
    `deadline` each (documented: a call lasts at most retries x deadline plus backoff), then the
    error names the deadline."""
    with hostile_server(trickle_body(2000, every=0.02)) as server:
        with pytest.raises(DeadlineExceededError, match=r"failed after 2 attempts; last: no complete response"):
            client(server.url, deadline=0.3, retries=2).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 2
        sent = server.sent
    assert sent < 2000


def test_silence_is_a_timeout_not_a_deadline() -> None:
    """Misleading message (issue 11 item 8): a server that answers nothing within `timeout` (shorter
    than the deadline) is reported as a timeout naming timeout=, not as a deadline."""
    with hostile_server(trickle_body(10, every=30.0)) as server:
        with pytest.raises(EngineTimeoutError, match=r"timed out after 0\.2s.*raise retries=/timeout=") as info:
            client(server.url, timeout=0.2, deadline=60.0).generate([[1, 2]], PARAMS)
    assert not isinstance(info.value, DeadlineExceededError)


# --- response size -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_huge_content_length_is_refused_before_reading(kind: str) -> None:
    """Resource exhaustion (issue 11 item 8): a declared Content-Length above max_response_bytes is
    refused from the header alone; the server's flood stops at what the sockets buffer."""
    with hostile_server(flood(FLOOD, declared=10**12)) as server:
        with pytest.raises(ResponseTooLargeError, match=r"Content-Length 1000000000000 .*max_response_bytes=1048576"):
            client(server.url, kind).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 1, "an oversized response is not retried"
        sent = server.sent
    assert sent < BUFFERED, f"the server sent {sent} bytes: the client kept reading a refused body"


@pytest.mark.parametrize("framing", ["chunked", "until-close"])
def test_body_without_length_stops_at_the_cap(framing: str) -> None:
    """Resource exhaustion (issue 11 item 8): a chunked body (or one read until the server closes)
    with no Content-Length is read in pieces and refused as soon as it passes the cap (before the
    fix a 300 MB body was read whole and cost 0.9-1.2 GB)."""
    with hostile_server(flood(FLOOD, chunked=framing == "chunked")) as server:
        with pytest.raises(
            ResponseTooLargeError, match=r"passed max_response_bytes=1048576 \(no Content-Length"
        ) as info:
            client(server.url).generate([[1, 2]], PARAMS)
        sent = server.sent
    assert CAP < info.value.size <= CAP + (64 << 10), "stops within one read (64 KiB) past the cap"
    assert sent < BUFFERED, f"the server sent {sent} bytes: the client did not stop at the cap"


def test_body_longer_than_its_content_length_is_not_read_past_it() -> None:
    """Resource exhaustion (issue 11 item 8): a server that declares 1000 bytes (under the cap) and
    sends 64 MiB: the client reads the declared 1000, never the rest, and the truncated JSON is a
    named error."""
    with hostile_server(flood(FLOOD, declared=1000)) as server:
        with pytest.raises(PayloadEncodingError, match=r"invalid JSON"):
            client(server.url).generate([[1, 2]], PARAMS)
        sent = server.sent
    assert sent < BUFFERED, f"the server sent {sent} bytes: the client read past the declared length"


def test_body_shorter_than_its_content_length_is_retried_then_named() -> None:
    """Error that is not a RouteReplayError (hostile servers): a server that declares 5000 bytes,
    sends 10 and closes the connection mid-body: every attempt fails, then a named error."""
    with hostile_server(close_mid_body(5000, b'{"choices"')) as server:
        with pytest.raises(EngineRequestError, match=r"failed after 2 attempts; last: RemoteProtocolError"):
            client(server.url, retries=2).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 2


def test_closed_mid_body_then_answered_is_retried() -> None:
    """Error that is not a RouteReplayError (hostile servers): a connection closed mid-body (or with
    no answer at all) is transient; the next attempt's answer is used."""
    good = vllm_answer([1, 2], [4, 5, 6])
    with hostile_server(close_mid_body(5000, b'{"cho'), hang_up(), answer(good)) as server:
        [rollout] = client(server.url, retries=3).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 3
    assert rollout.response_ids == [4, 5, 6]
    assert rollout.trace is not None and rollout.trace.experts[:, 0].tolist() == [[3, 5]] * 4


def test_500_then_200_is_retried() -> None:
    """Error that is not a RouteReplayError (hostile servers): an HTTP 500 is retried; the 200 after
    it is used."""
    good = vllm_answer([1, 2], [4, 5, 6])
    with hostile_server(answer({"error": "boom"}, status=500), answer(good)) as server:
        [rollout] = client(server.url, retries=2).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 2
    assert rollout.response_ids == [4, 5, 6]


def test_compressed_body_is_refused_not_inflated() -> None:
    """Resource exhaustion (issue 11 item 8): the client asks for identity encoding; a gzip body
    (a decompression bomb would pass a byte cap on the wire) is refused, never inflated."""
    data = b"\x1f\x8b" + b"\0" * 100

    def gzip_script(conn: Any, state: Any) -> None:
        state.send(conn, b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 102\r\n\r\n" + data)

    with hostile_server(gzip_script) as server:
        with pytest.raises(PayloadEncodingError, match=r"compressed \(Content-Encoding: gzip\)"):
            client(server.url).generate([[1, 2]], PARAMS)
        assert b"accept-encoding: identity" in server.requests[0].lower()


# --- hostile JSON bodies ---------------------------------------------------------------------------

HOSTILE_BODIES = {
    "not-json": b"<html>502 Bad Gateway</html>",
    "deep-nesting": b"[" * 100_000 + b"]" * 100_000,
    "5000-digit-number": b'{"choices": [{"token_ids": [' + b"7" * 5000 + b"]}]}",
    "nan": b'{"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [NaN]}}]}',
    "not-utf8": b'{"model": "\xff\xfe"}',
    "empty": b"",
    "array": b"[1, 2, 3]",
    "string": b'"hello"',
}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_hostile_json_body_is_a_named_error(kind: str, name: str) -> None:
    """Error that is not a RouteReplayError (issue 11 items 10 and 14, hostile servers): before the
    fix deep nesting raised RecursionError out of the client. Only RouteReplayError escapes."""
    with hostile_server(answer(HOSTILE_BODIES[name])) as server:
        with pytest.raises(RouteReplayError, match=rf"{server.url}"):
            client(server.url, kind).generate([[1, 2]], PARAMS)


# --- limits are parameters -----------------------------------------------------------------------


def test_limits_are_documented_parameters_with_defaults() -> None:
    """Resource exhaustion (issue 11 item 8): deadline and max_response_bytes are keyword arguments
    of both clients with named defaults, validated like every other setting."""
    vllm = VLLMClient("http://127.0.0.1:1", model="m", num_experts=8)
    sglang = SGLangClient("http://127.0.0.1:1", num_layers=2, top_k=2, num_experts=8, deadline=5, max_response_bytes=7)
    assert vllm.policy == HTTPPolicy()
    assert vllm.policy.timeout == DEFAULT_TIMEOUT
    assert (vllm.policy.deadline, vllm.policy.max_response_bytes) == (
        DEADLINE_PER_TIMEOUT * DEFAULT_TIMEOUT,
        DEFAULT_MAX_RESPONSE_BYTES,
    )
    assert VLLMClient("http://127.0.0.1:1", model="m", num_experts=8, timeout=1).policy.deadline == 2.0
    assert (sglang.policy.deadline, sglang.policy.max_response_bytes) == (5, 7)
    for bad, pattern in (
        ({"deadline": 0}, r"deadline=0 must be a finite number of seconds > 0"),
        ({"timeout": None}, r"timeout=None must be"),
        ({"deadline": float("inf")}, r"deadline=inf must be a finite"),
        ({"max_response_bytes": 0}, r"max_response_bytes=0 \(bytes of one response body\) must be an int >= 1"),
        ({"max_response_bytes": 1.5}, r"max_response_bytes=1\.5"),
        ({"timeout": -1}, r"timeout=-1 must be"),
        ({"backoff": -1}, r"backoff=-1 must be a finite number of seconds >= 0"),
        ({"concurrency": 0}, r"concurrency=0 must be an int >= 1"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            VLLMClient("http://127.0.0.1:1", model="m", num_experts=8, **bad)
