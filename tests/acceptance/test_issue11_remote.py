"""Acceptance tests for issue 11, remote engine clients (items 8, 14), against real local sockets."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from routereplay import RouteReplayError
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import SGLangClient, VLLMClient
from routereplay.errors import (
    DeadlineExceededError,
    ModelMismatchError,
    PayloadError,
    ResponseTooLargeError,
)

pytest.importorskip("httpcore")

L, K, E = 2, 2, 8
PROMPT = [5, 6, 7]


@contextmanager
def server(handler: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-thread TCP server answering each connection with `handler`; yields its base URL."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                _read_request(conn)
                try:
                    handler(conn)
                except OSError:
                    pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)


def _read_request(conn: socket.socket) -> None:
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        rest += conn.recv(65536)


def json_answer(document: object) -> Callable[[socket.socket], None]:
    body = json.dumps(document).encode()

    def handler(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    return handler


def vllm_response(response_ids: list[int], model: str = "tiny") -> dict:
    rows = len(PROMPT) + len(response_ids) - 1
    experts_TLK = np.tile(np.array([0, 1], dtype=np.int32), (rows, L, 1))
    buffer = io.BytesIO()
    np.save(buffer, experts_TLK)
    return {
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "x",
                "token_ids": response_ids,
                "logprobs": {"token_logprobs": [-0.5] * len(response_ids)},
                "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
            }
        ],
    }


def vllm_client(url: str, **kw) -> VLLMClient:
    return VLLMClient(url, model="tiny", num_experts=E, top_k=K, **kw)


PARAMS = SamplingParams(max_new_tokens=2)


# -- item 8 ---------------------------------------------------------------------------------------
def test_item8_trickling_server_is_cut_at_the_deadline() -> None:
    """Issue 11 item 8 (resource exhaustion): a server sending one byte every 0.4 s with timeout=1,
    retries=1 no longer keeps the call alive for ever: a DeadlineExceededError (deadline 2 x timeout)
    ends it after a handful of bytes of the trickled answer."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2000\r\n\r\n" + b" " * 2000
    sent: list[int] = []

    def trickle(conn: socket.socket) -> None:
        for i in range(len(answer)):
            conn.sendall(answer[i : i + 1])
            sent.append(i)
            time.sleep(0.4)

    with server(trickle) as url:
        client = vllm_client(url, timeout=1, retries=1)
        with pytest.raises(DeadlineExceededError) as info:
            client.generate([PROMPT], PARAMS)
    assert info.value.deadline == pytest.approx(2.0)
    assert info.value.received < len(answer)
    assert isinstance(info.value, RouteReplayError)


def test_item8_declared_300_mb_body_refused_before_reading() -> None:
    """Issue 11 item 8 (resource exhaustion): a response declaring a 300 MB body is refused by the size
    cap (ResponseTooLargeError) without reading or holding it."""
    size = 300 * 10**6

    def huge(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + f"Content-Length: {size}\r\n\r\n".encode()
        )
        block = b" " * (1 << 20)
        for _ in range(size // len(block)):
            conn.sendall(block)

    with server(huge) as url:
        client = vllm_client(url, retries=1, max_response_bytes=16 << 20)
        tracemalloc.start()
        try:
            with pytest.raises(ResponseTooLargeError):
                client.generate([PROMPT], PARAMS)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 32 << 20


def test_item8_chunked_body_past_the_cap_refused_while_reading() -> None:
    """Issue 11 item 8 (resource exhaustion): a chunked body without Content-Length is refused as soon as
    it passes max_response_bytes; memory stays near the cap, not the body."""

    def chunked(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b" " * (1 << 16)
        for _ in range(4096):  # 256 MiB if read whole
            conn.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n")
        conn.sendall(b"0\r\n\r\n")

    with server(chunked) as url:
        client = vllm_client(url, retries=1, max_response_bytes=2 << 20)
        tracemalloc.start()
        try:
            with pytest.raises(ResponseTooLargeError):
                client.generate([PROMPT], PARAMS)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 16 << 20


def test_item8_well_behaved_server_still_works() -> None:
    """Issue 11 item 8 (guard): a normal answer passes the deadline and cap."""
    with server(json_answer(vllm_response([9, 10]))) as url:
        rollout = vllm_client(url, timeout=5, retries=1).generate([PROMPT], PARAMS)[0]
    assert rollout.response_ids == [9, 10]
    assert rollout.trace.num_tokens == len(PROMPT) + 2 - 1


# -- item 14 --------------------------------------------------------------------------------------
def _mutate(path: tuple, value: object) -> dict:
    document = vllm_response([9, 10])
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return document


VLLM_MALFORMED = {
    "token_ids_str": (("choices", 0, "token_ids"), "9,10"),
    "token_ids_float": (("choices", 0, "token_ids"), [9.5, 10]),
    "token_ids_nested": (("choices", 0, "token_ids"), [[9], [10]]),
    "token_ids_negative": (("choices", 0, "token_ids"), [-9, 10]),
    "token_ids_bool": (("choices", 0, "token_ids"), [True, 10]),
    "logprobs_list": (("choices", 0, "logprobs"), [-0.5, -0.5]),
    "token_logprobs_str": (("choices", 0, "logprobs", "token_logprobs"), ["a", "b"]),
    "token_logprobs_short": (("choices", 0, "logprobs", "token_logprobs"), [-0.5]),
    "token_logprobs_null": (("choices", 0, "logprobs", "token_logprobs"), None),
    "token_logprobs_nan_text": (("choices", 0, "logprobs", "token_logprobs"), [{"x": 1}, -0.5]),
}


@pytest.mark.parametrize("case", sorted(VLLM_MALFORMED))
def test_item14_vllm_malformed_fields_are_payload_errors(case: str) -> None:
    """Issue 11 item 14 (error that is not a RouteReplayError): remote vLLM responses with malformed
    token_ids or logprobs raise a PayloadError (not TypeError / ValueError / AttributeError)."""
    path, value = VLLM_MALFORMED[case]
    with server(json_answer(_mutate(path, value))) as url:
        with pytest.raises(PayloadError):
            vllm_client(url, timeout=5, retries=1).generate([PROMPT], PARAMS)


def sglang_response(output_ids: object, triples: object, model: str | None = None) -> dict:
    rows = len(PROMPT) + 2 - 1
    experts = np.tile(np.array([0, 1], dtype=np.int32), (rows, L, 1))
    document = {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": 2,
            "output_token_logprobs": triples,
            "routed_experts": base64.b64encode(experts.tobytes()).decode(),
        },
    }
    if model is not None:
        document["model"] = model
    return document


GOOD_TRIPLES = [[-0.5, 9, "a"], [-0.5, 10, "b"]]
SGLANG_MALFORMED = {
    "output_ids_str": ("9 10", GOOD_TRIPLES),
    "output_ids_floats": ([9.0, 10.0], GOOD_TRIPLES),
    "output_ids_disagree": ([9, 11], GOOD_TRIPLES),
    "triples_dicts": ([9, 10], [{"a": 1}, {"b": 2}]),
    "triples_id_str": ([9, 10], [[-0.5, "9", "a"], [-0.5, 10, "b"]]),
    "triples_logprob_str": ([9, 10], [["x", 9, "a"], [-0.5, 10, "b"]]),
    "triples_scalar": ([9, 10], 5),
}


@pytest.mark.parametrize("case", sorted(SGLANG_MALFORMED))
def test_item14_sglang_malformed_fields_are_payload_errors(case: str) -> None:
    """Issue 11 item 14 (error that is not a RouteReplayError): SGLang /generate responses with malformed
    output_ids or output_token_logprobs raise a PayloadError."""
    output_ids, triples = SGLANG_MALFORMED[case]
    with server(json_answer(sglang_response(output_ids, triples))) as url:
        client = SGLangClient(url, num_layers=L, top_k=K, num_experts=E, timeout=5, retries=1)
        with pytest.raises(PayloadError):
            client.generate([PROMPT], PARAMS)


def test_item14_sglang_good_response_guard() -> None:
    """Issue 11 item 14 (guard): the well-formed SGLang answer is accepted."""
    with server(json_answer(sglang_response([9, 10], GOOD_TRIPLES))) as url:
        client = SGLangClient(url, num_layers=L, top_k=K, num_experts=E, timeout=5, retries=1)
        rollout = client.generate([PROMPT], PARAMS)[0]
    assert rollout.trace.num_tokens == len(PROMPT) + 1


def test_item14_response_from_another_model_refused() -> None:
    """Issue 11 item 14 (silent misroute): a response whose "model" names another model than the client
    asked for is refused (ModelMismatchError), not accepted silently."""
    with server(json_answer(vllm_response([9, 10], model="some-other-model"))) as url:
        with pytest.raises(ModelMismatchError, match="some-other-model"):
            vllm_client(url, timeout=5, retries=1).generate([PROMPT], PARAMS)
