"""Route forcing behind a real `vllm serve` (issue 24): the plugin, loaded by vLLM from its entry point.

The session's server (tests/engines/conftest.py, tiny Qwen3-MoE, prefix caching on) was started by
vLLM's own CLI module, so the only way forcing reaches it is the `vllm.general_plugins` entry point.
Forced routes sent over HTTP must give what the in-process engine gives for the same model, prompt,
seed and routes; hostile blobs must fail that request by name (HTTP 400) and the server must serve on.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import httpx
import numpy as np
import pytest

from routereplay import codec
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import VLLMClient
from routereplay.engines.vllm.forced_routes import WEIGHTS_KEY, XARG_KEY, encode_forced, salted
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace
from tests.engines.colocated_engine import Colocated, prompts
from tests.engines.conftest import LiveServer

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

TIMEOUT = 300.0


def random_routes(layout: Any, rows: int, seed: int, *, experts: int | None = None) -> RouteTrace:
    E = experts or layout.num_experts
    order = np.argsort(np.random.default_rng(seed).random((rows, len(layout.moe_layers), E)), axis=-1)
    return RouteTrace(order[:, :, : layout.top_k].astype(np.int16), E, layout.moe_layers)


def client(server: LiveServer, *, knows_layout: bool = True) -> VLLMClient:
    layout = server.layout
    extra = {"moe_layers": layout.moe_layers, "top_k": layout.top_k} if knows_layout else {}
    return VLLMClient(
        server.url, model=server.served_model_name, num_experts=layout.num_experts, timeout=TIMEOUT, **extra
    )


def post(server: LiveServer, prompt: list[int], xargs: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"model": server.served_model_name, "prompt": prompt, "max_tokens": 3}
    body["return_token_ids"] = True
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)


def test_forced_routes_over_http_give_what_the_in_process_engine_gives(
    vllm_qwen3: LiveServer, colocated_qwen3: Colocated
) -> None:
    """The same checkpoint (tiny Qwen3-MoE, seed 0) in process and behind `vllm serve`: random forced prefix
    routes come back on every forced row from both, and the continuations (tokens, log-probs, live routes) agree."""
    prompt = prompts(81, [45])[0]
    routes = random_routes(vllm_qwen3.layout, 44, seed=3)
    params = SamplingParams(max_new_tokens=6, seed=17)
    remote = client(vllm_qwen3).generate([prompt], params, prefix_routes=[routes])[0]
    local = colocated_qwen3.engine.generate([prompt], params, prefix_routes=[routes])[0]
    assert remote.trace is not None and local.trace is not None
    forced_sets = np.sort(routes.experts, -1)
    assert np.array_equal(np.sort(remote.trace.experts[:44], -1), forced_sets)
    assert remote.response_ids == local.response_ids
    assert np.allclose(remote.logprobs, local.logprobs, atol=1e-5)
    assert np.array_equal(np.sort(remote.trace.experts, -1), np.sort(local.trace.experts, -1))
    unforced = client(vllm_qwen3).generate([prompt], params)[0]
    assert unforced.trace is not None
    assert not np.array_equal(np.sort(unforced.trace.experts[:44], -1), forced_sets)


def test_hostile_blobs_fail_their_request_and_the_server_serves_on(vllm_qwen3: LiveServer) -> None:
    """Bad checksum, wrong layer count, expert ids beyond the model's E, more rows than the prompt, not base64:
    HTTP 400 naming the problem; a plain request and a good forced one still work afterwards."""
    layout = vllm_qwen3.layout
    prompt = prompts(83, [12])[0]
    good = random_routes(layout, 11, seed=1)
    flipped = bytearray(codec.encode(good))
    flipped[-3] ^= 0x01
    hostile = {
        "CRC": base64.b64encode(bytes(flipped)).decode(),
        r"layers \[0, 1\]; the served model's MoE layers are \[0, 1, 2\]": encode_forced(good.select_layers([0, 1])),
        r"E=64, K=2; the served model routes E=16": encode_forced(random_routes(layout, 11, seed=2, experts=64)),
        r"positions 0\.\.12 but the prompt has 12 tokens": encode_forced(random_routes(layout, 13, seed=4)),
        "not base64": "%%%",
    }
    for message, text in hostile.items():
        answer = post(vllm_qwen3, prompt, {XARG_KEY: text})
        assert answer.status_code == 400, (message, answer.status_code, answer.text[:300])
        assert XARG_KEY in answer.text
        assert re.search(message, answer.text), (message, answer.text[:400])
    spoof = httpx.post(
        vllm_qwen3.url + "/v1/completions",
        json={
            "model": vllm_qwen3.served_model_name,
            "prompt": prompt,
            "max_tokens": 2,
            "cache_salt": salted(None, encode_forced(good)),
        },
        timeout=TIMEOUT,
    )  # an unforced request with a forced request's salt would reuse KV computed under forced routes
    assert spoof.status_code == 400 and "reserved for requests that force routes" in spoof.text
    assert post(vllm_qwen3, prompt, None).status_code == 200
    served = post(vllm_qwen3, prompt, {XARG_KEY: encode_forced(good)})
    assert served.status_code == 200, served.text[:300]


def test_the_servers_refusal_reaches_the_client_by_name(vllm_qwen3: LiveServer) -> None:
    """A client that does not know the layout (no client-side check) gets the server's reason as ForcedRoutesError."""
    prompt = prompts(85, [10])[0]
    wrong = random_routes(vllm_qwen3.layout, 9, seed=5).select_layers([0, 2])
    with pytest.raises(ForcedRoutesError, match=r"the server refused the forced routes: .*layers \[0, 2\]"):
        client(vllm_qwen3, knows_layout=False).generate([prompt], SamplingParams(), prefix_routes=[wrong])


def test_weights_asked_with_json_true_are_served_on_completions_and_chat_and_other_values_refused(
    vllm_qwen3: LiveServer,
) -> None:
    """Issue 38 item 8: vLLM's OpenAI server turns JSON true / false in `vllm_xargs` into 1 / 0 before the plugin
    sees them; both endpoints serve a request asking with true, false or "true", and refuse 2 or "yes" by name."""
    prompt = prompts(87, [10])[0]
    for flag in (True, False, "true"):
        answer = post(vllm_qwen3, prompt, {WEIGHTS_KEY: flag})
        assert answer.status_code == 200, (flag, answer.text[:300])
        chat = httpx.post(
            vllm_qwen3.url + "/v1/chat/completions",
            json={
                "model": vllm_qwen3.served_model_name,
                "messages": [{"role": "user", "content": "w3 w4 w5"}],
                "max_tokens": 2,
                "vllm_xargs": {WEIGHTS_KEY: flag},
            },
            timeout=TIMEOUT,
        )
        assert chat.status_code == 200, (flag, chat.text[:300])
    for bad in (2, "yes"):
        answer = post(vllm_qwen3, prompt, {WEIGHTS_KEY: bad})
        assert answer.status_code == 400 and f"'routereplay_weights'={bad!r} must be true" in answer.text, answer.text
