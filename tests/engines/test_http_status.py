"""Issue 22: only HTTP 200 is an engine's answer; any other status below 400 is named, not parsed.

Before the fix every status below 400 counted as the answer: a redirect (which the client never
follows) or a 201 / 299 from a proxy, whose JSON body looked like a completion, was taken as the
engine's rollout. Each server here is a real socket on 127.0.0.1 (tests/engines/hostile_server.py).
"""

from __future__ import annotations

import pytest

from routereplay.engines.remote import EngineRequestError, SGLangClient
from tests.engines.hostile_server import answer, hostile_server
from tests.engines.test_remote_limits import PARAMS, client, vllm_answer


@pytest.mark.parametrize("status", [201, 203, 299, 300, 301, 302, 307, 308, 399])
def test_engine_like_answer_with_another_status_is_refused(status: int) -> None:
    """A well-formed completion body under a non-200 status is an EngineRequestError naming the
    status, and is not retried (the same request would get the same answer)."""
    body = vllm_answer([1, 2], [4, 5, 6])
    with hostile_server(answer(body, status=status)) as server:
        with pytest.raises(EngineRequestError, match=rf"answered HTTP {status}: .*not 200 \(not retried\)") as info:
            client(server.url, retries=3).generate([[1, 2]], PARAMS)
        assert len(server.requests) == 1, f"{len(server.requests)} attempts: a non-200 answer must not be retried"
    assert info.value.status == status
    assert info.value.url is not None and info.value.url.startswith(server.url)
    assert "token_ids" in info.value.body  # the body is kept for diagnosis, not parsed as the answer


def test_redirect_says_it_is_never_followed() -> None:
    """A 3xx names what it is and the fix (point url= at the engine itself)."""
    with hostile_server(answer({"model_path": "m"}, status=302)) as server:
        with pytest.raises(EngineRequestError, match=r"HTTP 302.*a redirect, which this client never follows"):
            SGLangClient(server.url, num_layers=2, top_k=2, num_experts=8, retries=1, backoff=0.0).check_server()


def test_200_is_still_the_answer() -> None:
    """The same body under 200 is parsed and used (the refusal is about the status alone)."""
    with hostile_server(answer(vllm_answer([1, 2], [4, 5, 6]))) as server:
        [rollout] = client(server.url).generate([[1, 2]], PARAMS)
    assert rollout.response_ids == [4, 5, 6]
