"""Fully-async GRPO: routes across aborts and resumes, judged against what the engine itself returned.

Every engine call's raw output is logged as it reaches the pool (the sample ids it continued, the
inputs, the rollouts and the engine's policy version), and every batch the trainer learns from is
captured. The expected routes of a row are those of the first call that fed it, with that call's
version: what the engine used when the token was sampled. The engine runs in fp32, so "the routing
the last chunk was computed with" can be checked to float tolerance by a full forward.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.hf import HFEngine, Rollout
from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer
from routereplay.rl.grpo import GRPOConfig
from routereplay.rl.rollout_pool import CallInputs, Group
from routereplay.rl.scoring import score
from routereplay.rl.tasks import AdditionTask
from routereplay.runtime import attach

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, object]:
    from routereplay.rl.model import train_demo_model

    return train_demo_model("qwen3_moe", steps=300, num_experts=16, num_hidden_layers=3)


class WeightLog(HFEngine):
    """The built-in engine in fp32, keeping a copy of the weights of every policy version it loads."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, dtype=torch.float32)
        self.weights: dict[int | None, torch.nn.Module] = {}

    def sync_weights(self, model: torch.nn.Module, policy_version: int | None = None) -> None:
        super().sync_weights(model, policy_version)
        self.weights[policy_version] = copy.deepcopy(self.model)


@dataclass
class Run:
    trainer: AsyncGRPOTrainer
    engine: WeightLog
    calls: list[tuple[CallInputs, list[Rollout], int]] = field(default_factory=list)
    batches: list[tuple[list[int], list[Rollout]]] = field(default_factory=list)  # sample ids, rollouts learnt


def _run(trained: tuple[torch.nn.Module, object], resume: str, *, steps: int = 4) -> Run:
    model, tokenizer = trained
    policy = copy.deepcopy(model)
    config = GRPOConfig(
        mode="R3", steps=steps, prompts_per_step=4, group_size=2, mini_steps=2, lr=3e-3, max_new_tokens=6, seed=5
    )
    engine = WeightLog(policy)
    schedule = AsyncConfig(schedule="seeded", sync_tokens=(1, 2), resume_routes=resume, max_staleness=3)
    trainer = AsyncGRPOTrainer(policy, AdditionTask(tokenizer), engine, config, schedule)
    run = Run(trainer, engine)
    receive, take, learn = trainer.pool.receive, trainer.pool.take, trainer.trainer.learn
    taken: list[list[Group]] = []

    def logged_receive(call: CallInputs, rollouts: Sequence[Rollout], version: int) -> None:
        run.calls.append((call, copy.deepcopy(list(rollouts)), version))  # as the engine returned them
        receive(call, rollouts, version)

    def logged_take(count: int, **kwargs: Any) -> list[Group] | None:
        groups = take(count, **kwargs)
        if groups is not None:
            taken.append(groups)
        return groups

    def logged_learn(step: int, rollouts: Sequence[Rollout], rewards: Sequence[float], **kwargs: Any) -> Any:
        run.batches.append(([s.sample_id for g in taken[-1] for s in g.samples], list(rollouts)))
        return learn(step, rollouts, rewards, **kwargs)

    trainer.pool.receive = logged_receive  # type: ignore[method-assign]
    trainer.pool.take = logged_take  # type: ignore[method-assign]
    trainer.trainer.learn = logged_learn  # type: ignore[method-assign]
    trainer.train()
    return run


def _sampled_routes(run: Run, sample_id: int, rows: int) -> tuple[np.ndarray, list[int | None]]:
    """Per row, the routes and policy version of the first engine call that fed it (from the raw log)."""
    experts: list[np.ndarray | None] = [None] * rows
    versions: list[int | None] = [None] * rows
    for call, rollouts, version in run.calls:
        for sample, _fed, rollout in zip(call.samples, call.prompts, rollouts, strict=True):
            if sample.sample_id != sample_id or rollout.trace is None:
                continue
            for t in range(min(rollout.trace.num_tokens, rows)):
                if experts[t] is None:
                    experts[t], versions[t] = rollout.trace.experts[t], version
    assert all(e is not None for e in experts), "some row was never fed by any call"
    return np.stack(experts), versions  # type: ignore[arg-type]


def _row_versions(trace: Any) -> list[int | None]:
    versions: list[int | None] = [None] * trace.num_tokens
    for segment in trace.segments:
        versions[segment.begin : segment.end] = [segment.policy_version] * (segment.end - segment.begin)
    return versions


def _last_chunk(run: Run, sample_id: int) -> tuple[int, int, list[float]]:
    """(version, first position, engine log-probs) of the last call that sampled tokens for the sample."""
    found = None
    for call, rollouts, version in run.calls:
        for sample, fed, rollout in zip(call.samples, call.prompts, rollouts, strict=True):
            if sample.sample_id == sample_id and rollout.response_ids:
                found = (version, len(fed), rollout.logprobs)
    assert found is not None
    return found


def _learnt(run: Run) -> list[tuple[int, Rollout]]:
    return [(sid, r) for ids, rollouts in run.batches for sid, r in zip(ids, rollouts, strict=True)]


def _resumed(run: Run) -> set[int]:
    resumed: set[int] = set()
    for call, rollouts, _ in run.calls:
        for sample, fed, rollout in zip(call.samples, call.prompts, rollouts, strict=True):
            if rollout.trace is not None and len(fed) > len(sample.prompt_ids):
                resumed.add(sample.sample_id)
    return resumed


def _matches_sampling(run: Run) -> list[bool]:
    """Per learnt sample: its trace is, row by row and version by version, the routes at sampling."""
    out = []
    for sample_id, rollout in _learnt(run):
        assert rollout.trace is not None
        expected, versions = _sampled_routes(run, sample_id, rollout.trace.num_tokens)
        same_routes = bool(np.array_equal(np.sort(rollout.trace.experts, -1), np.sort(expected, -1)))
        out.append(same_routes and _row_versions(rollout.trace) == versions)
    return out


def _last_chunk_error(run: Run) -> float:
    """Largest |engine log-prob - forward log-prob| over the last chunks of resumed samples, where the
    forward uses the last chunk's weights (engine precision, fp32) and replays the final trace."""
    worst = 0.0
    resumed = _resumed(run)
    for sample_id, rollout in _learnt(run):
        if sample_id not in resumed:
            continue
        version, begin, logprobs = _last_chunk(run, sample_id)
        model = run.engine.weights[version]
        replayer = attach(model)
        try:
            scored = score(model, [rollout], pad_token_id=0, replayer=replayer, replay=True)
        finally:
            replayer.detach()
        forward = scored.logprobs_BS[0, begin : begin + len(logprobs)]
        worst = max(worst, float((forward - torch.tensor(logprobs)).abs().max()))
    return worst


def test_routes_survive_repeated_aborts_with_versions_and_r3_disagreement_zero(trained: Any) -> None:
    """Issue 13 must-show 1. Defects guarded: routes lost at an abort (verl #5344), a resumed prefix
    sliced or concatenated wrongly (#6029/#6046), rows stamped with the wrong policy version, and a
    trainer that replays anything other than the engine's routes."""
    run = _run(trained, "prefix-replay")
    learnt = _learnt(run)
    aborts = {sid: 0 for sid, _ in learnt}
    for call, rollouts, _ in run.calls:
        for sample, rollout in zip(call.samples, rollouts, strict=True):
            if rollout.aborted and sample.sample_id in aborts:
                aborts[sample.sample_id] += 1
    assert max(aborts.values()) >= 2, f"no sample was aborted twice: {aborts}"
    multi = [r for sid, r in learnt if aborts[sid] >= 2]
    assert any(len({v for v in _row_versions(r.trace)}) >= 3 for r in multi), "rows of 3+ versions in one trace"
    assert all(_matches_sampling(run))
    for _sample_id, rollout in learnt:
        assert rollout.trace is not None and rollout.trace.num_tokens == len(rollout.token_ids) - 1
        assert rollout.trace.token_ids is not None and list(rollout.trace.token_ids) == rollout.token_ids[:-1]
    for record in run.trainer.history:
        assert record["rollout_routing_disagreement"] == 0.0
        assert record["rollout_disagreement_per_mini_step"] == [0.0, 0.0]
        assert record["prefix_conflicts"] == 0
    assert sum(r["aborts"] for r in run.trainer.history) >= sum(aborts.values())


def test_prefix_replay_is_both_the_sampling_routes_and_the_last_chunks_routing(trained: Any) -> None:
    """Issue 13 must-show 2. With engine-side prefix replay the final trace is (a) the routes used when
    each token was sampled and (b) the routing the engine computed the last chunk with. 'first' keeps
    (a) but fails (b): the resumed prefill re-routed the prefix. 'latest' keeps (b) but fails (a)."""
    runs = {policy: _run(trained, policy) for policy in ("prefix-replay", "first", "latest")}
    for policy, run in runs.items():
        assert _resumed(run), f"{policy}: no sample was resumed, so nothing is tested"
    assert all(_matches_sampling(runs["prefix-replay"]))
    assert _last_chunk_error(runs["prefix-replay"]) < 1e-4
    assert all(_matches_sampling(runs["first"]))
    assert sum(r["prefix_conflicts"] for r in runs["first"].trainer.history) > 0
    assert _last_chunk_error(runs["first"]) > 1e-3, "first routes: the last chunk was computed on other routes"
    assert not all(_matches_sampling(runs["latest"])), "latest routes: rows re-routed by a resume replace sampling's"
    assert _last_chunk_error(runs["latest"]) < 1e-4
