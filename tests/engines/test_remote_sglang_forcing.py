"""`SGLangClient.generate(prefix_routes=)`: the codec blob goes in `sampling_params.custom_params`, the client
checks what it can before sending, and what the server's own capture returns is checked against what was asked.

The server is the test suite's SGLang wire stub (tests/engines/stub_server.py); a server with the plugin is
stood in for by rewriting the stub's returned routes to the forced rows (`StubConfig.mutate`), a server without
it by the stub as is. The forcing inside SGLang is tested with SGLang's own classes in tests/engines/sglang/.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from routereplay import codec
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import SGLangClient
from routereplay.engines.sglang.forcing.requests import CUSTOM_KEY
from routereplay.errors import ForcedRoutesError, ForcingNotAppliedError
from routereplay.trace.route_trace import RouteTrace
from tests.engines.stub_server import StubConfig, stub_server

E, K, NUM_LAYERS, MOE_LAYERS = 64, 2, 4, (1, 2, 3)
PROMPT = [5, 6, 7, 8, 9]


def asked(rows: int = 4, seed: int = 0) -> RouteTrace:
    order = np.argsort(np.random.default_rng(seed).random((rows, len(MOE_LAYERS), E)), axis=-1)[:, :, :K]
    return RouteTrace(order.astype(np.int16), E, MOE_LAYERS)


def client(url: str) -> SGLangClient:
    return SGLangClient(url, num_layers=NUM_LAYERS, top_k=K, num_experts=E, moe_layers=MOE_LAYERS, timeout=5.0)


def forcing_server(trace: RouteTrace):  # type: ignore[no-untyped-def]
    """A `mutate` that writes the forced rows into the returned routes, as SGLang's capture reports them."""

    def mutate(path: str, data: Any) -> Any:
        raw = np.frombuffer(base64.b64decode(data["meta_info"]["routed_experts"]), np.int32)
        routes_TLK = raw.reshape(-1, NUM_LAYERS, K).copy()
        routes_TLK[trace.start : trace.stop, list(MOE_LAYERS)] = trace.experts
        data["meta_info"]["routed_experts"] = base64.b64encode(routes_TLK.tobytes()).decode("ascii")
        return data

    return mutate


def test_the_blob_rides_in_custom_params_and_forced_rows_come_back() -> None:
    trace = asked()
    with stub_server(StubConfig(num_experts=E, mutate=forcing_server(trace))) as stub:
        [rollout] = client(stub.url).generate([PROMPT], SamplingParams(max_new_tokens=3), prefix_routes=[trace])
        sent = stub.posts("/generate")[-1]["sampling_params"]["custom_params"][CUSTOM_KEY]
    assert codec.decode(base64.b64decode(sent)).equal_sets(trace)
    got_TLK = np.sort(np.asarray(rollout.trace.experts[:4]), axis=-1)
    assert np.array_equal(got_TLK, np.sort(trace.experts, axis=-1))  # routes are sets


def test_a_server_without_the_plugin_is_named() -> None:
    with stub_server(StubConfig(num_experts=E)) as stub:
        with pytest.raises(ForcingNotAppliedError, match="asked to force"):
            client(stub.url).generate([PROMPT], SamplingParams(max_new_tokens=3), prefix_routes=[asked()])


def test_the_client_checks_before_sending() -> None:
    with stub_server(StubConfig(num_experts=E)) as stub:
        with pytest.raises(ForcedRoutesError, match=r"positions 0\.\.5 but the prompt has 5 tokens"):
            client(stub.url).generate([PROMPT], SamplingParams(), prefix_routes=[asked(6)])
        assert stub.posts("/generate") == []


def test_a_refusal_by_the_server_is_a_forced_routes_error() -> None:
    """SGLang answers a refused request with 400 and the plugin's message (it names the custom_params key)."""
    message = f"SGLang request 'x': forced routes (sampling_params.custom_params {CUSTOM_KEY!r}) refused: E=8"

    class Refusing(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            data = json.dumps({"error": {"message": message}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ForcedRoutesError, match="the server refused the forced routes: .*E=8"):
            client(url).generate([PROMPT], SamplingParams(max_new_tokens=3), prefix_routes=[asked()])
    finally:
        server.shutdown()
        server.server_close()
