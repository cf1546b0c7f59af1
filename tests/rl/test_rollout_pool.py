"""`RolloutPool`: what an aborted call keeps, how resumed prefixes merge under each policy, staleness,
hostile inputs and two threads. Engine outputs are built by hand so every row is known."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from routereplay.engines.hf import Rollout
from routereplay.errors import ConfigError
from routereplay.rl.rollout_pool import CallInputs, ResumeRoutes, RolloutPool
from routereplay.store.sample import MisalignedRoutesError
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace

LAYERS, TOP_K, EXPERTS = (0, 1), 2, 8
PROMPT = [5, 6, 7]


def _trace(tokens: list[int], first_expert: int) -> RouteTrace:
    """Rows for every fed token of `tokens` (all but the last), experts (first + t) % E and the next one."""
    rows = len(tokens) - 1
    experts = np.zeros((rows, len(LAYERS), TOP_K), np.int16)
    for t in range(rows):
        experts[t, :, 0] = (first_expert + t) % EXPERTS
        experts[t, :, 1] = (first_expert + t + 1) % EXPERTS
    experts.sort(axis=-1)  # the pool's store keeps route sets: rows read back ascending
    return RouteTrace(experts, EXPERTS, LAYERS, 0, (Segment(0, rows, "hf"),), tokens[:-1])


def _rollout(fed: list[int], new: list[int], first_expert: int, *, aborted: bool) -> Rollout:
    return Rollout(fed, new, [-0.5] * len(new), _trace(fed + new, first_expert), aborted=aborted)


def _pool(resume: str, max_new_tokens: int = 6) -> RolloutPool:
    pool = RolloutPool(group_size=1, max_new_tokens=max_new_tokens, resume=resume, eos_token_id=1)
    pool.admit(0, "problem", PROMPT)
    return pool


def _call(pool: RolloutPool) -> CallInputs:
    call = pool.next_call()
    assert call is not None
    return call


def _versions(trace: RouteTrace) -> list[int | None]:
    out: list[int | None] = [None] * trace.num_tokens
    for s in trace.segments:
        out[s.begin : s.end] = [s.policy_version] * (s.end - s.begin)
    return out


@pytest.mark.parametrize("resume", ["first", "latest", "prefix-replay"])
def test_resumed_prefix_merges_by_policy(resume: str) -> None:
    """Verl #6029/#6046: a resume re-sends the whole prefix, routed otherwise under the new weights. The
    final trace covers every position once; 'latest' takes the resumed call's rows and version, the
    others keep the rows (and versions) of the call that first fed each position."""
    pool = _pool(resume)
    first = _call(pool)
    assert first.prefix_routes is None and first.max_new_tokens == 6
    pool.receive(first, [_rollout(PROMPT, [20, 21], 0, aborted=True)], version=0)
    second = _call(pool)
    assert second.prompts == [[*PROMPT, 20, 21]] and second.max_new_tokens == 4
    if resume == "prefix-replay":
        assert second.prefix_routes is not None and second.prefix_routes[0] is not None
        assert second.prefix_routes[0].num_tokens == 4  # rows 0..3: the fed positions of the first call
    else:
        assert second.prefix_routes is None
    pool.receive(second, [_rollout(second.prompts[0], [22, 23, 24, 25], 3, aborted=False)], version=1)
    group = pool.take(1, current_version=1, max_staleness=1)
    assert group is not None
    (rollout,) = group[0].rollouts()
    assert rollout.response_ids == [20, 21, 22, 23, 24, 25] and rollout.logprobs == [-0.5] * 6
    trace = rollout.trace
    assert trace is not None and trace.num_tokens == 8 and list(trace.token_ids) == rollout.token_ids[:-1]
    resumed = _trace(rollout.token_ids, 3).experts
    sampled = _trace([*PROMPT, 20, 21], 0).experts
    if resume == "latest":
        assert np.array_equal(trace.experts, resumed) and _versions(trace) == [1] * 8
    else:
        assert np.array_equal(trace.experts[:4], sampled) and np.array_equal(trace.experts[4:], resumed[4:])
        assert _versions(trace) == [0] * 4 + [1] * 4
    assert pool.conflicting_rows(group) == 4  # the hand-built resume routes every prefix row otherwise
    sample = group[0].samples[0]
    assert (sample.aborts, sample.resumes, sample.resumed_rows, sample.versions) == (1, 1, 4, [0, 0, 1, 1, 1, 1])


def test_an_abort_before_any_output_changes_nothing() -> None:
    """Lost work: a call stopped before its prefill returns no tokens and no trace; the sample keeps
    everything it had, the abort is counted, and the next call resumes from the same tokens."""
    pool = _pool("first")
    call = _call(pool)
    pool.receive(call, [_rollout(PROMPT, [20], 0, aborted=True)], version=0)
    before = pool.next_call()
    assert before is not None
    pool.receive(before, [Rollout(before.prompts[0], [], [], None, aborted=True)], version=1)
    after = _call(pool)
    assert after.prompts == before.prompts == [[*PROMPT, 20]]
    sample = after.samples[0]
    assert (sample.aborts, sample.aborted_before_output, sample.response_ids) == (2, 1, [20])


def test_a_call_longer_than_a_samples_budget_is_cut_to_it() -> None:
    """Over-long samples: one call runs to the largest budget of its batch; a resumed sample keeps only
    its remaining tokens, and its trace is cut to match (rows = tokens - 1)."""
    pool = _pool("first", max_new_tokens=3)
    call = _call(pool)
    pool.receive(call, [_rollout(PROMPT, [20, 21], 0, aborted=True)], version=0)
    resumed = _call(pool)
    pool.receive(resumed, [_rollout(resumed.prompts[0], [22, 23, 24], 0, aborted=False)], version=0)
    group = pool.take(1, current_version=0, max_staleness=0)
    assert group is not None
    (rollout,) = group[0].rollouts()
    assert rollout.response_ids == [20, 21, 22] and rollout.trace is not None and rollout.trace.num_tokens == 5


def test_stale_groups_are_dropped_and_counted() -> None:
    """Staleness bound ignored: a finished group older than max_staleness versions is dropped, counted,
    and never returned; a fresh enough one is."""
    pool = RolloutPool(group_size=1, max_new_tokens=1, resume="first", eos_token_id=None)
    for index, version in ((0, 0), (1, 2)):
        pool.admit(index, index, PROMPT)
        call = _call(pool)
        pool.receive(call, [_rollout(PROMPT, [20], 0, aborted=False)], version=version)
    assert pool.take(2, current_version=3, max_staleness=1) is None
    assert pool.dropped_groups == 1 and len(pool) == 1
    taken = pool.take(1, current_version=3, max_staleness=1)
    assert taken is not None and taken[0].index == 1 and len(pool) == 0


def test_hostile_inputs_are_refused_with_named_errors() -> None:
    """Wrong inputs: a count mismatch, a twice-admitted group, an unknown policy, a trace whose token ids
    are not the sample's, each a named error naming the cause; nothing is stored by the failing call."""
    with pytest.raises(ConfigError, match="resume routes 'newest' must be one of"):
        RolloutPool(group_size=1, max_new_tokens=2, resume="newest", eos_token_id=None)
    with pytest.raises(ConfigError, match="must be >= 1"):
        RolloutPool(group_size=0, max_new_tokens=2, resume="first", eos_token_id=None)
    pool = _pool("first")
    with pytest.raises(ConfigError, match="group 0 is already in the pool"):
        pool.admit(0, "again", PROMPT)
    call = _call(pool)
    with pytest.raises(ConfigError, match="returned 2 rollouts for 1 inputs"):
        pool.receive(call, [_rollout(PROMPT, [20], 0, aborted=True)] * 2, version=0)
    forged = _rollout(PROMPT, [20], 0, aborted=True)
    forged.trace = _trace([9, 9, 9, 20], 0)  # routes of other tokens
    with pytest.raises(MisalignedRoutesError, match="captured for token id 9 at position 0"):
        pool.receive(call, [forged], version=0)
    again = _call(pool)
    assert again.prompts == [PROMPT] and again.samples[0].response_ids == []


def test_two_threads_receive_and_take_without_losing_a_sample() -> None:
    """Races: a rollout thread admits and finishes groups while the trainer thread takes them; every
    group is taken exactly once, whole."""
    pool = RolloutPool(group_size=2, max_new_tokens=1, resume=ResumeRoutes.FIRST, eos_token_id=None)
    total, taken, errors = 200, [], []

    def rollout_side() -> None:
        try:
            for index in range(total):
                pool.admit(index, index, PROMPT)
                call = _call(pool)
                pool.receive(call, [_rollout(p, [20], 0, aborted=False) for p in call.prompts], version=0)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=rollout_side)
    thread.start()
    while len(taken) < total and not errors:
        groups = pool.take(1, current_version=0, max_staleness=0)
        if groups is not None:
            taken.extend(groups)
    thread.join()
    assert not errors
    assert sorted(g.index for g in taken) == list(range(total))
    assert all(len(g.rollouts()) == 2 for g in taken)


def test_a_call_holds_at_most_the_engines_concurrency_oldest_first() -> None:
    """Wasted aborts: vLLM runs max_num_seqs requests at once and queues the rest; a weight sync then aborts
    the queue before any prefill. A call is capped at the engine's concurrency, the oldest samples first,
    so resumed samples are never starved by newer ones."""
    pool = RolloutPool(group_size=2, max_new_tokens=4, resume="first", eos_token_id=None)
    for index in range(3):
        pool.admit(index, index, PROMPT)
    call = pool.next_call(3)
    assert call is not None and [s.sample_id for s in call.samples] == [0, 1, 2]
    pool.receive(call, [_rollout(PROMPT, [20], 0, aborted=True)] * 3, version=0)
    resumed = pool.next_call(2)
    assert resumed is not None and [s.sample_id for s in resumed.samples] == [0, 1]
    assert resumed.max_new_tokens == 3  # the budget of the samples in the call, not of the ones waiting
    everything = pool.next_call()
    assert everything is not None and len(everything.samples) == 6 and everything.max_new_tokens == 4
