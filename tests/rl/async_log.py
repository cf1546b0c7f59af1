"""What an async GRPO run did, logged from outside its logic: every engine call's raw output and every
batch learnt, for tests that judge the final traces against what the engine itself returned.

`watch(trainer)` wraps the trainer's pool and learner (instance attributes, nothing global):
- every `pool.receive`: the call's inputs, a deep copy of the rollouts as the engine returned them
  (so a later mutation cannot hide in the log), the engine's policy version and the calling thread;
- every `pool.take` and `learn`: the sample ids of each learnt batch with the rollouts learnt.
The expected route of a row is that of the first call that fed it, with that call's version: what
the engine used when the token was sampled (`sampled_routes`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routereplay.engines.hf import Rollout
from routereplay.rl.async_grpo import AsyncGRPOTrainer
from routereplay.rl.rollout_pool import CallInputs, Group
from routereplay.trace.route_trace import RouteTrace


@dataclass
class AsyncLog:
    calls: list[tuple[CallInputs, list[Rollout], int]] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)  # the thread each engine call's output arrived on
    batches: list[tuple[list[int], list[Rollout]]] = field(default_factory=list)  # sample ids, rollouts learnt

    def fed_by(self, sample_id: int) -> Iterator[tuple[list[int], Rollout, int]]:
        """(input fed, rollout returned, engine version) of every call that continued the sample."""
        for call, rollouts, version in self.calls:
            for sample, fed, rollout in zip(call.samples, call.prompts, rollouts, strict=True):
                if sample.sample_id == sample_id:
                    yield fed, rollout, version

    def sampled_routes(self, sample_id: int, rows: int) -> tuple[np.ndarray, list[int | None]]:
        """Per row, the routes and policy version of the first call that fed it."""
        experts: list[np.ndarray | None] = [None] * rows
        versions: list[int | None] = [None] * rows
        for _fed, rollout, version in self.fed_by(sample_id):
            if rollout.trace is None:
                continue
            for t in range(min(rollout.trace.num_tokens, rows)):
                if experts[t] is None:
                    experts[t], versions[t] = rollout.trace.experts[t], version
        assert all(e is not None for e in experts), "some row was never fed by any call"
        return np.stack(experts), versions  # type: ignore[arg-type]

    def learnt(self) -> list[tuple[int, Rollout]]:
        return [(sid, r) for ids, rollouts in self.batches for sid, r in zip(ids, rollouts, strict=True)]

    def resumed(self) -> set[int]:
        """Samples some call continued after they had sampled tokens (their prefix was re-fed)."""
        return {
            sample.sample_id
            for call, rollouts, _ in self.calls
            for sample, fed, rollout in zip(call.samples, call.prompts, rollouts, strict=True)
            if rollout.trace is not None and len(fed) > len(sample.prompt_ids)
        }


def row_versions(trace: RouteTrace | None) -> list[int | None]:
    """The policy version of every row, from the trace's provenance segments."""
    assert trace is not None, "a learnt rollout without a trace"
    versions: list[int | None] = [None] * trace.num_tokens
    for segment in trace.segments:
        versions[segment.begin : segment.end] = [segment.policy_version] * (segment.end - segment.begin)
    return versions


def watch(trainer: AsyncGRPOTrainer, log: AsyncLog | None = None) -> AsyncLog:
    """Log `trainer`'s engine calls and learnt batches into `log` (a new one by default)."""
    log = AsyncLog() if log is None else log
    receive, take, learn = trainer.pool.receive, trainer.pool.take, trainer.trainer.learn
    taken: list[list[Group]] = []

    def logged_receive(call: CallInputs, rollouts: Sequence[Rollout], version: int) -> None:
        log.calls.append((call, copy.deepcopy(list(rollouts)), version))  # as the engine returned them
        log.threads.append(threading.current_thread().name)
        receive(call, rollouts, version)

    def logged_take(count: int, **kwargs: Any) -> list[Group] | None:
        groups = take(count, **kwargs)
        if groups is not None:
            taken.append(groups)
        return groups

    def logged_learn(step: int, rollouts: Sequence[Rollout], rewards: Sequence[float], **kwargs: Any) -> Any:
        log.batches.append(([s.sample_id for g in taken[-1] for s in g.samples], list(rollouts)))
        return learn(step, rollouts, rewards, **kwargs)

    trainer.pool.receive = logged_receive  # type: ignore[method-assign]
    trainer.pool.take = logged_take  # type: ignore[method-assign]
    trainer.trainer.learn = logged_learn  # type: ignore[method-assign]
    return log
