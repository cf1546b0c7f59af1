"""The built-in engine: seeded determinism, the vLLM trace contract, and agreement with the trainer."""

from __future__ import annotations

import pytest
import torch

from routereplay.engines.hf import HFEngine, SamplingParams, left_pad, position_ids_for
from routereplay.errors import ConfigError
from routereplay.metrics import routing_agreement
from routereplay.rl.scoring import engine_logprobs, engine_routes, score
from routereplay.runtime import attach
from tests.runtime.models import tiny_qwen3

pytestmark = pytest.mark.hf

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


def test_same_seed_same_rollouts_other_seed_differs() -> None:
    engine = HFEngine(tiny_qwen3())
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    again = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=4))
    assert [r.response_ids for r in first] == [r.response_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert [r.trace for r in first] == [r.trace for r in again]
    assert [r.response_ids for r in first] != [r.response_ids for r in other]


def test_trace_contract_and_eos() -> None:
    model = tiny_qwen3()
    engine = HFEngine(model, policy_version=7)
    eos = 3
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1, eos_token_id=eos, temperature=2.0))
    for prompt, rollout in zip(PROMPTS, rollouts, strict=True):
        assert rollout.prompt_ids == prompt
        assert len(rollout.logprobs) == len(rollout.response_ids) >= 1
        assert all(lp <= 0 for lp in rollout.logprobs)
        if rollout.finished:
            assert rollout.response_ids[-1] == eos and eos not in rollout.response_ids[:-1]
        else:
            assert len(rollout.response_ids) == 8 and eos not in rollout.response_ids
        trace = rollout.trace
        assert trace is not None and trace.num_tokens == len(prompt) + len(rollout.response_ids) - 1
        assert trace.layers == (0, 1, 2) and trace.top_k == 2 and trace.num_experts == 8
        assert trace.segments[0].source == "hf" and trace.segments[0].policy_version == 7
        trace.validate()


def test_fp32_engine_agrees_with_the_trainer() -> None:
    """With the engine in fp32 the only difference left is KV-cache vs full-sequence arithmetic."""
    model = tiny_qwen3()
    engine = HFEngine(model, dtype=torch.float32)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=2))
    replayer = attach(model)
    scored = score(model, rollouts, pad_token_id=0, replayer=replayer)
    infer = engine_logprobs(rollouts, scored.ids_BS.shape)
    assert torch.allclose(scored.logprobs_BS, infer, atol=1e-4)
    engine_BSLK = engine_routes(rollouts, scored.ids_BS.shape, 3, 2)
    agreement = routing_agreement(scored.routes_BSLK, engine_BSLK, scored.mask_BS.bool())
    assert agreement["routing_disagreement"] == 0.0 and agreement["compared_rows"] > 0


def test_r3_scoring_replays_engine_routes_exactly() -> None:
    model = tiny_qwen3()
    engine = HFEngine(model)  # bf16: its routes differ from fp32 ones somewhere
    rollouts = engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=6, seed=5))
    replayer = attach(model)
    scored = score(model, rollouts, pad_token_id=0, replayer=replayer, replay=True)
    engine_BSLK = engine_routes(rollouts, scored.ids_BS.shape, 3, 2)
    agreement = routing_agreement(scored.routes_BSLK, engine_BSLK, scored.mask_BS.bool())
    assert agreement["routing_disagreement"] == 0.0
    assert replayer.stats.fallback_rows == len(rollouts) * 3  # the last token of each sequence, per layer


def test_padding_helpers_and_params() -> None:
    ids, mask = left_pad([[1, 2], [3, 4, 5]], pad_token_id=0)
    assert ids.tolist() == [[0, 1, 2], [3, 4, 5]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert position_ids_for(mask).tolist() == [[0, 0, 1], [0, 1, 2]]
    with pytest.raises(ConfigError, match="temperature=0"):
        SamplingParams(temperature=0)
    with pytest.raises(ConfigError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError, match="at least one prompt"):
        HFEngine(tiny_qwen3()).generate([], SamplingParams())


def test_top_p_keeps_only_the_nucleus() -> None:
    from routereplay.engines.hf import sample_tokens

    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]]).repeat(200, 1)
    tokens, logprobs = sample_tokens(logits, SamplingParams(top_p=0.9), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # p = 0.71, 0.26, 0.01, ...: the nucleus of 0.9 is the top two
    renormalised = torch.log_softmax(torch.tensor([4.0, 3.0]), dim=0)
    assert torch.allclose(logprobs, renormalised[tokens], atol=1e-6)


@pytest.mark.parametrize("prompts", [[], [[]], [[1, 2], []]])
def test_every_engine_refuses_empty_prompts_before_any_work(prompts: list[list[int]]) -> None:
    """Error that is not a RouteReplayError: the built-in engine and the remote clients share one
    prompt check (`check_prompts`), so an empty batch or an empty prompt is the same ConfigError before
    any model call or request (the client here points at a port nothing listens on)."""
    from routereplay.engines.remote import SGLangClient, VLLMClient

    url = "http://127.0.0.1:1"
    engines = [
        HFEngine(tiny_qwen3()),
        VLLMClient(url, model="tiny", num_experts=4),
        SGLangClient(url, num_layers=2, top_k=2, num_experts=4),
    ]
    for engine in engines:
        with pytest.raises(ConfigError, match="at least one prompt"):
            engine.generate(prompts, SamplingParams())


def test_captured_weights_are_the_experts_and_replay_into_the_trainer() -> None:
    model = tiny_qwen3()
    engine = HFEngine(model, dtype=torch.float32, capture_weights=True)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=2))
    replayer = attach(model)
    scored = score(model, rollouts, pad_token_id=0, replayer=replayer)
    traces = [r.trace for r in rollouts]
    assert all(t is not None and t.weights is not None for t in traces)
    with torch.no_grad(), replayer.record(weights=True) as rec:  # the trainer's own full-sequence pass
        model(input_ids=scored.ids_BS, attention_mask=scored.mask_BS)
    live = rec.traces(scored.mask_BS)
    for trace, mine in zip(traces, live, strict=True):
        assert trace is not None and trace.weights is not None and mine.weights is not None
        rows = trace.num_tokens
        assert torch.allclose(torch.as_tensor(trace.weights), torch.as_tensor(mine.weights[:rows]), atol=1e-5)
    with pytest.raises(ConfigError, match="needs capture=True"):
        HFEngine(model, capture=False, capture_weights=True)
    assert HFEngine(model).generate(PROMPTS, SamplingParams(max_new_tokens=2))[0].trace.weights is None  # type: ignore[union-attr]
