"""A raw-socket HTTP server on 127.0.0.1 that misbehaves on purpose, and counts what it sent.

`hostile_server(*scripts)` accepts connections, reads one request each (headers and the body its
Content-Length declares), then runs the next script (the last one repeats) on the socket and closes
it. A script writes whatever bytes it likes through `Hostile.send`, which counts them, so a test
can assert that the client stopped reading early (bytes sent far below what the script would
have sent) without timing anything. Sends stop when the client goes away or the test ends.
The server's send buffer is kept small (64 KiB) so the count stays close to what the client took.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SEND_BUFFER = 64 << 10


class ClientGone(Exception):
    """The client closed the connection (or the test ended) while the script was sending."""


@dataclass
class Hostile:
    url: str = ""
    sent: int = 0  # bytes handed to the kernel by all scripts so far
    requests: list[bytes] = field(default_factory=list)  # raw request heads, in arrival order
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)

    def send(self, conn: socket.socket, data: bytes) -> None:
        if self.stopping.is_set():
            raise ClientGone
        try:
            conn.sendall(data)
        except OSError as exc:  # broken pipe, reset, timeout
            raise ClientGone from exc
        with self.lock:
            self.sent += len(data)

    def pause(self, seconds: float) -> None:
        if self.stopping.wait(seconds):
            raise ClientGone


Script = Callable[[socket.socket, Hostile], None]


@contextmanager
def hostile_server(*scripts: Script) -> Iterator[Hostile]:
    """Serve `scripts` (one per request, the last repeating) until the block ends."""
    state = Hostile()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    state.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    threads: list[threading.Thread] = []

    def serve() -> None:
        while not state.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with state.lock:
                index = len(state.requests)
                state.requests.append(b"")
            script = scripts[min(index, len(scripts) - 1)]
            worker = threading.Thread(target=_handle, args=(conn, state, index, script), daemon=True)
            threads.append(worker)
            worker.start()

    acceptor = threading.Thread(target=serve, daemon=True)
    acceptor.start()
    try:
        yield state
    finally:
        state.stopping.set()
        acceptor.join(timeout=5)
        listener.close()
        for worker in threads:
            worker.join(timeout=5)


def _handle(conn: socket.socket, state: Hostile, index: int, script: Script) -> None:
    with conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        conn.settimeout(10)
        try:
            head = _read_request(conn)
            with state.lock:
                state.requests[index] = head
            script(conn, state)
        except (ClientGone, OSError):
            pass


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ClientGone
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise ClientGone
        body += chunk
    return head


def head(status: int = 200, **headers: str | int) -> bytes:
    """A status line and headers (`Content_Length=5` is sent as `Content-Length: 5`), then the blank line."""
    lines = [f"HTTP/1.1 {status} X"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# --- scripts -----------------------------------------------------------------------------------


def answer(body: bytes | object, status: int = 200) -> Script:
    """A well-formed response: `body` bytes as they are, anything else as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()

    def script(conn: socket.socket, state: Hostile) -> None:
        state.send(conn, head(status, Content_Type="application/json", Content_Length=len(data)) + data)

    return script


def trickle_body(size: int, every: float) -> Script:
    """Declare `size` bytes, then send one byte every `every` seconds."""

    def script(conn: socket.socket, state: Hostile) -> None:
        state.send(conn, head(Content_Length=size))
        for _ in range(size):
            state.pause(every)
            state.send(conn, b" ")

    return script


def trickle_headers(size: int, every: float) -> Script:
    """A status line, then `size` bytes of one header line, one byte every `every` seconds."""

    def script(conn: socket.socket, state: Hostile) -> None:
        state.send(conn, b"HTTP/1.1 200 OK\r\nX-Pad: ")
        for _ in range(size):
            state.pause(every)
            state.send(conn, b"a")

    return script


def flood(total: int, *, declared: int | None = None, chunked: bool = False, piece: int = 64 << 10) -> Script:
    """Send up to `total` body bytes: under a `declared` Content-Length, chunked, or until close."""

    def script(conn: socket.socket, state: Hostile) -> None:
        if chunked:
            state.send(conn, head(Transfer_Encoding="chunked"))
        elif declared is not None:
            state.send(conn, head(Content_Length=declared))
        else:
            state.send(conn, head(Connection="close"))
        block = b"[" + b"1," * (piece // 2 - 1)  # a JSON list that never ends
        for _ in range(total // piece):
            state.send(conn, b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)

    return script


def close_mid_body(declared: int, sent: bytes) -> Script:
    """Declare `declared` bytes, send `sent` (fewer), and close the connection."""

    def script(conn: socket.socket, state: Hostile) -> None:
        state.send(conn, head(Content_Type="application/json", Content_Length=declared) + sent)

    return script


def hang_up() -> Script:
    """Close the connection without answering."""

    def script(conn: socket.socket, state: Hostile) -> None:
        del conn, state

    return script
