"""Fully-async GRPO: routes across aborts and resumes, judged against what the engine itself returned.

Every engine call's raw output is logged as it reaches the pool (the sample ids it continued, the
inputs, the rollouts and the engine's policy version), and every batch the trainer learns from is
captured. The expected routes of a row are those of the first call that fed it, with that call's
version: what the engine used when the token was sampled. The engine runs in fp32, so "the routing
the last chunk was computed with" can be checked to float tolerance by a full forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.hf import HFEngine
from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer
from routereplay.rl.grpo import GRPOConfig
from routereplay.rl.scoring import score
from routereplay.rl.tasks import AdditionTask
from routereplay.runtime import attach
from tests.rl.async_log import AsyncLog, row_versions, watch

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


@dataclass(kw_only=True)
class Run(AsyncLog):
    trainer: AsyncGRPOTrainer
    engine: WeightLog


def _run(trained: tuple[torch.nn.Module, object], resume: str, *, steps: int = 4) -> Run:
    model, tokenizer = trained
    policy = copy.deepcopy(model)
    config = GRPOConfig(
        mode="R3", steps=steps, prompts_per_step=4, group_size=2, mini_steps=2, lr=3e-3, max_new_tokens=6, seed=5
    )
    engine = WeightLog(policy)
    schedule = AsyncConfig(schedule="seeded", sync_tokens=(1, 2), resume_routes=resume, max_staleness=3)
    trainer = AsyncGRPOTrainer(policy, AdditionTask(tokenizer), engine, config, schedule)
    run = Run(trainer=trainer, engine=engine)
    watch(trainer, run)
    trainer.train()
    return run


def _last_chunk(run: Run, sample_id: int) -> tuple[int, int, list[float]]:
    """(version, first position, engine log-probs) of the last call that sampled tokens for the sample."""
    found = None
    for fed, rollout, version in run.fed_by(sample_id):
        if rollout.response_ids:
            found = (version, len(fed), rollout.logprobs)
    assert found is not None
    return found


def _matches_sampling(run: Run) -> list[bool]:
    """Per learnt sample: its trace is, row by row and version by version, the routes at sampling."""
    out = []
    for sample_id, rollout in run.learnt():
        assert rollout.trace is not None
        expected, versions = run.sampled_routes(sample_id, rollout.trace.num_tokens)
        same_routes = bool(np.array_equal(np.sort(rollout.trace.experts, -1), np.sort(expected, -1)))
        out.append(same_routes and row_versions(rollout.trace) == versions)
    return out


def _last_chunk_error(run: Run) -> float:
    """Largest |engine log-prob - forward log-prob| over the last chunks of resumed samples, where the
    forward uses the last chunk's weights (engine precision, fp32) and replays the final trace."""
    worst = 0.0
    resumed = run.resumed()
    for sample_id, rollout in run.learnt():
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
    learnt = run.learnt()
    aborts = {sid: 0 for sid, _ in learnt}
    for call, rollouts, _ in run.calls:
        for sample, rollout in zip(call.samples, rollouts, strict=True):
            if rollout.aborted and sample.sample_id in aborts:
                aborts[sample.sample_id] += 1
    assert max(aborts.values()) >= 2, f"no sample was aborted twice: {aborts}"
    multi = [r for sid, r in learnt if aborts[sid] >= 2]
    assert any(len({v for v in row_versions(r.trace)}) >= 3 for r in multi), "rows of 3+ versions in one trace"
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
        assert run.resumed(), f"{policy}: no sample was resumed, so nothing is tested"
    assert all(_matches_sampling(runs["prefix-replay"]))
    assert _last_chunk_error(runs["prefix-replay"]) < 1e-4
    assert all(_matches_sampling(runs["first"]))
    assert sum(r["prefix_conflicts"] for r in runs["first"].trainer.history) > 0
    assert _last_chunk_error(runs["first"]) > 1e-3, "first routes: the last chunk was computed on other routes"
    assert not all(_matches_sampling(runs["latest"])), "latest routes: rows re-routed by a resume replace sampling's"
    assert _last_chunk_error(runs["latest"]) < 1e-4
