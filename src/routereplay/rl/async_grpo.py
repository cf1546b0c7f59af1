"""Fully-async GRPO: the engine keeps sampling while the trainer trains; weight syncs abort and resume.

The rollout side keeps `in_flight_groups` prompts' groups in flight (a `RolloutPool`), refilled as
the trainer takes finished ones. Each weight sync stops the running engine call at a token
boundary; the unfinished samples are resumed under the new version, prompt plus everything
generated so far as the new input, with their routes handled by the `ResumeRoutes` policy. The
trainer takes the `prompts_per_step` oldest finished groups whose oldest token is at most
`max_staleness` versions old (older ones are dropped and counted), and learns from them with the
synchronous trainer's `GRPOTrainer.learn` (off, R2 or R3).

Two schedules decide where aborts happen:
- `threaded` (the default, realistic): a rollout thread runs the engine (with the caller's intra-op
  thread count) while the caller's thread trains. The trainer publishes a copy of its weights after
  every step; the engine call sees that at its next token boundary, stops, loads the weights, and
  resumes. Wall-clock overlap is real, and where the aborts land depends on timing.
- `seeded` (deterministic, for tests and exact comparisons): one thread. A trainer step starts as soon
  as a batch is ready and lasts a seeded number of engine tokens (`sync_tokens`, inclusive bounds).
  The engine keeps the old weights for those tokens, then syncs, so the same seed gives the same
  aborts, the same rollouts and the same training.

Per step the record adds to `GRPOTrainer`'s: `k3_kl_current`, the engine-vs-trainer k3 KL over the
response tokens sampled by the version being trained (the plain `k3_kl` also holds the policy lag of
older tokens), the trainer's policy version, rows per policy version,
stale rows (routed by an older version than the one trained), samples aborted and resumed, aborts
before any output, the fraction of rows whose routing a resume re-computed, prefix conflicts (rows a
resumed prefill routed otherwise than stored), groups dropped as too stale, and samples per second.
Legend: G = group size.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from routereplay.engines.hf import Rollout, SamplingParams, TokenBudget
from routereplay.enums import StrEnum
from routereplay.errors import ConfigError, RouteReplayError
from routereplay.rl.grpo import Engine, GRPOConfig, GRPOTrainer
from routereplay.rl.rollout_pool import CallInputs, Group, ResumeRoutes, RolloutPool
from routereplay.rl.tasks import AdditionTask


class AsyncSchedule(StrEnum):
    """Where weight syncs abort the engine: realistic threads, or a seeded single-thread schedule."""

    THREADED = "threaded"
    SEEDED = "seeded"


class RolloutWorkerError(RouteReplayError, RuntimeError):
    """The rollout thread failed; the trainer stops with its error as the cause."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncConfig:
    """The async loop's knobs (the GRPO ones stay in `GRPOConfig`)."""

    max_staleness: int = 1  # the trainer takes groups whose oldest token is at most this many versions old
    in_flight_groups: int = 0  # groups kept in flight; 0 = 2 x prompts_per_step
    resume_routes: str | None = None  # None: prefix-replay where the engine supports it, else first
    schedule: str = AsyncSchedule.THREADED.value
    sync_tokens: tuple[int, int] = (1, 3)  # seeded: engine tokens one trainer step lasts (inclusive bounds)
    wait_seconds: float = 600.0  # threaded: the longest the trainer waits for a batch before giving up

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.in_flight_groups < 0:
            raise ConfigError(
                f"max_staleness={self.max_staleness} and in_flight_groups={self.in_flight_groups} must be >= 0"
            )
        try:
            AsyncSchedule(self.schedule)
        except ValueError:
            raise ConfigError(f"schedule={self.schedule!r} must be 'threaded' or 'seeded'") from None
        if self.resume_routes is not None:
            try:
                ResumeRoutes(self.resume_routes)
            except ValueError:
                raise ConfigError(
                    f"resume_routes={self.resume_routes!r} must be one of {[str(r) for r in ResumeRoutes]}"
                ) from None
        low, high = self.sync_tokens
        if not 0 <= low <= high:
            raise ConfigError(f"sync_tokens={self.sync_tokens} must be (low, high) with 0 <= low <= high")
        if self.wait_seconds <= 0:
            raise ConfigError(f"wait_seconds={self.wait_seconds} must be > 0")


def resume_policy(engine: Any, requested: str | None) -> ResumeRoutes:
    """The resume policy to run: `requested`, or the best the engine supports; refuse what it cannot do."""
    supports = bool(getattr(engine, "supports_prefix_replay", False))
    if requested is None:
        return ResumeRoutes.PREFIX_REPLAY if supports else ResumeRoutes.FIRST
    policy = ResumeRoutes(requested)
    if policy is ResumeRoutes.PREFIX_REPLAY and not supports:
        raise ConfigError(
            f"resume routes 'prefix-replay' needs an engine that forces routes on a resumed prefill; "
            f"{type(engine).__name__} cannot. Use the built-in engine (HFEngine), or resume routes 'first' or 'latest'"
        )
    return policy


class AsyncGRPOTrainer:
    """Fully-async GRPO on `task`: `engine` samples on while `model` trains (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        task: AdditionTask,
        engine: Engine,
        config: GRPOConfig,
        async_config: AsyncConfig | None = None,
        *,
        log_path: str | Path | None = None,
        tensorboard_dir: str | Path | None = None,
    ) -> None:
        self.config, self.async_config = config, async_config or AsyncConfig()
        if not callable(getattr(engine, "sync_weights", None)):
            raise ConfigError(
                f"async training syncs weights into the engine while it samples; {type(engine).__name__} has no "
                "sync_weights (a remote server's weights are never synced): use the built-in or colocated vLLM engine"
            )
        self.resume = resume_policy(engine, self.async_config.resume_routes)
        self.engine, self.task = engine, task
        self.trainer = GRPOTrainer(model, task, engine, config, log_path=log_path, tensorboard_dir=tensorboard_dir)
        self.pool = RolloutPool(
            group_size=config.group_size,
            max_new_tokens=config.max_new_tokens,
            resume=self.resume,
            eos_token_id=task.eos_token_id,
        )
        self.capacity = self.async_config.in_flight_groups or 2 * config.prompts_per_step
        if self.capacity < config.prompts_per_step:
            raise ConfigError(
                f"in_flight_groups={self.capacity} is fewer than prompts_per_step={config.prompts_per_step}: "
                "the trainer could never take a batch"
            )
        # a call holds at most the engine's concurrent sequences (vLLM's max_num_seqs; the built-in engine: all)
        self.concurrency: int | None = getattr(engine, "max_concurrent_sequences", None)
        self.version = 0  # the trainer's policy version: updates done
        self.engine_version = 0
        self.calls = 0
        self._admitted = 0
        self._dropped_seen = 0
        self._began = 0.0
        self._last_step_at = 0.0

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.trainer.history

    def train(self, progress: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
        """Run `config.steps` trainer steps; return the per-step records."""
        self.engine.sync_weights(self.trainer.model, policy_version=0)  # type: ignore[attr-defined]
        self._began = self._last_step_at = time.perf_counter()
        if AsyncSchedule(self.async_config.schedule) is AsyncSchedule.SEEDED:
            self._train_seeded(progress)
        else:
            self._train_threaded(progress)
        return self.history

    # --- the rollout side ---------------------------------------------------------------------------
    def _refill(self) -> None:
        config = self.config
        while len(self.pool) < self.capacity:
            index = self._admitted
            problem = self.task.problems(1, seed=config.seed * 7919 + index)[0]
            self.pool.admit(index, problem, self.task.prompt_ids([problem])[0])
            self._admitted += 1

    def _params(self, call: CallInputs) -> SamplingParams:
        return self.task.sampling(
            max_new_tokens=call.max_new_tokens,
            seed=self.config.seed * 104729 + self.calls,
            temperature=self.config.temperature,
        )

    def _run_call(self, call: CallInputs, stop: Callable[[int], bool] | None) -> None:
        rollouts = self.engine.generate(  # type: ignore[call-arg]
            call.prompts, self._params(call), stop=stop, prefix_routes=call.prefix_routes
        )
        self.calls += 1
        self.pool.receive(call, rollouts, self.engine_version)

    # --- the trainer side ---------------------------------------------------------------------------
    def _take(self) -> list[Group] | None:
        return self.pool.take(
            self.config.prompts_per_step,
            current_version=self.version,
            max_staleness=self.async_config.max_staleness,
        )

    def _learn(self, groups: list[Group]) -> nn.Module:
        """One trainer step on `groups`; returns a copy of the new weights for the engine."""
        rollouts = [r for g in groups for r in g.rollouts()]
        rewards = [self.task.reward(g.problem, s.response_ids) for g in groups for s in g.samples]
        extra = self._async_record(groups, rollouts)
        began = time.perf_counter()
        self.trainer.learn(
            len(self.history), rollouts, rewards, extra=extra, token_subsets={"current": self._current(groups)}
        )
        record = self.history[-1]
        record["seconds"]["learn"] = time.perf_counter() - began
        self.version += 1
        now = time.perf_counter()
        record["samples_per_second"] = len(rollouts) / max(now - self._last_step_at, 1e-9)
        record["elapsed"] = now - self._began
        self._last_step_at = now
        return copy.deepcopy(self.trainer.model)  # attached models deep-copy as inert, unattached copies

    def _current(self, groups: list[Group]) -> torch.Tensor:
        """(B, S) mask of the response tokens sampled by the version being trained: their engine-vs-trainer
        k3 KL has no policy lag in it, only the numerics and routing mismatch R3 is about."""
        samples = [s for g in groups for s in g.samples]
        width = max(len(s.token_ids) for s in samples)
        current_BS = torch.zeros((len(samples), width), dtype=torch.bool)
        for b, sample in enumerate(samples):
            start = len(sample.prompt_ids)
            current_BS[b, start : start + len(sample.versions)] = torch.tensor(
                [v == self.version for v in sample.versions], dtype=torch.bool
            )
        return current_BS

    def _async_record(self, groups: list[Group], rollouts: list[Rollout]) -> dict[str, Any]:
        """The step's async counts; `rollouts` are the groups' samples in order, with their merged traces."""
        samples = [s for g in groups for s in g.samples]
        rows_by_version: Counter[str] = Counter()
        stale = rows = resumed_rows = 0
        for sample, rollout in zip(samples, rollouts, strict=True):
            resumed_rows += sample.resumed_rows
            trace = rollout.trace
            if trace is None:  # an engine without route capture: no rows to count
                continue
            routed_T = np.asarray(trace.routed_mask.all(axis=1))
            rows += trace.num_tokens
            for segment in trace.segments:
                count = int(routed_T[segment.begin - trace.start : segment.end - trace.start].sum())
                rows_by_version[str(segment.policy_version)] += count
                if segment.policy_version is not None and segment.policy_version < self.version:
                    stale += count
        dropped = self.pool.dropped_groups - self._dropped_seen
        self._dropped_seen = self.pool.dropped_groups
        return {
            "policy_version": self.version,
            "resume_routes": str(self.resume),
            "rows_by_version": dict(sorted(rows_by_version.items())),
            "stale_rows": stale,
            "stale_row_fraction": stale / rows if rows else 0.0,
            "aborted_samples": sum(1 for s in samples if s.aborts),
            "aborts": sum(s.aborts for s in samples),
            "aborted_before_output": sum(s.aborted_before_output for s in samples),
            "resumed_samples": sum(1 for s in samples if s.resumes),
            "resumed_row_fraction": resumed_rows / rows if rows else 0.0,
            "prefix_conflicts": self.pool.conflicting_rows(groups),
            "max_sample_staleness": max(self.version - g.oldest_version for g in groups),
            "dropped_stale_groups": dropped,
        }

    # --- seeded: one thread, aborts where a seeded trainer-step length says ------------------------
    def _train_seeded(self, progress: Callable[[str, int, int], None] | None) -> None:
        rng = random.Random(self.config.seed)
        low, high = self.async_config.sync_tokens
        clock = 0  # engine tokens sampled so far: the schedule's time
        pending: tuple[nn.Module, int, int] | None = None  # (weights, version, due clock)
        while len(self.history) < self.config.steps:
            if pending is None:
                groups = self._take()
                if groups is not None:
                    weights = self._learn(groups)
                    pending = (weights, self.version, clock + rng.randint(low, high))
                    if progress is not None:
                        progress(f"async GRPO ({self.trainer.mode}, seeded)", len(self.history), self.config.steps)
                    continue
            self._refill()
            call = self.pool.next_call(self.concurrency)
            if call is None:  # every admitted group finished and waits for the trainer: the engine idles
                if pending is None:
                    raise ConfigError("the pool is full of finished groups but none is ready: this is a bug")
                clock = pending[2]
                self._sync(pending[0], pending[1])
                pending = None
                continue
            budget = None if pending is None else pending[2] - clock
            stop = None if budget is None else TokenBudget(budget)  # data: exact in an engine process too
            self._run_call(call, stop)
            clock += call.max_new_tokens if budget is None else min(budget, call.max_new_tokens)
            if pending is not None and clock >= pending[2]:
                self._sync(pending[0], pending[1])
                pending = None

    def _sync(self, weights: nn.Module, version: int) -> None:
        self.engine.sync_weights(weights, policy_version=version)  # type: ignore[attr-defined]
        self.engine_version = version

    # --- threaded: a rollout thread, the trainer here ----------------------------------------------
    def _train_threaded(self, progress: Callable[[str, int, int], None] | None) -> None:
        published: list[tuple[nn.Module, int]] = []  # newest weights not yet loaded by the engine
        fresh = threading.Event()  # set when `published` holds weights: the engine call stops
        done = threading.Event()
        changed = threading.Condition()  # the pool changed: a batch may be ready
        failure: list[BaseException] = []
        # OpenMP's thread count is per thread: a new thread starts at the default (every core, or
        # OMP_NUM_THREADS), not at the caller's choice (routereplay.threads.ThreadPolicy). Left there, the
        # engine would oversubscribe a busy machine, and vLLM's CPU attention aborts when the count its
        # scheduler metadata saw differs from its kernel's ("thread_num (2 vs. 1)").
        threads = torch.get_num_threads()

        def stop(sampled: int) -> bool:
            return fresh.is_set() or done.is_set()

        def worker() -> None:
            try:
                torch.set_num_threads(threads)
                while not done.is_set():
                    with changed:
                        if published:
                            weights, version = published.pop()
                            published.clear()
                            fresh.clear()
                        else:
                            weights = None
                    if weights is not None:
                        self._sync(weights, version)
                    self._refill()
                    call = self.pool.next_call(self.concurrency)
                    if call is None:  # everything admitted is finished: wait for the trainer to take some
                        with changed:
                            changed.wait_for(lambda: fresh.is_set() or done.is_set(), timeout=0.05)
                        continue
                    self._run_call(call, stop)
                    with changed:
                        changed.notify_all()
            except BaseException as error:  # handed to the trainer thread, which raises it
                failure.append(error)
                with changed:
                    changed.notify_all()

        thread = threading.Thread(target=worker, name="routereplay-rollout", daemon=True)
        thread.start()
        try:
            while len(self.history) < self.config.steps:
                groups = self._wait_for_batch(changed, failure)
                weights = self._learn(groups)
                with changed:
                    published[:] = [(weights, self.version)]
                    fresh.set()
                    changed.notify_all()
                if progress is not None:
                    progress(f"async GRPO ({self.trainer.mode})", len(self.history), self.config.steps)
        finally:
            done.set()
            with changed:
                changed.notify_all()
            thread.join()
        if failure:
            raise RolloutWorkerError(f"the rollout thread failed: {failure[0]!r}") from failure[0]

    def _wait_for_batch(self, changed: threading.Condition, failure: Sequence[BaseException]) -> list[Group]:
        deadline = time.monotonic() + self.async_config.wait_seconds
        while True:
            if failure:
                raise RolloutWorkerError(f"the rollout thread failed: {failure[0]!r}") from failure[0]
            groups = self._take()
            if groups is not None:
                return groups
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutWorkerError(
                    f"no batch of {self.config.prompts_per_step} groups within {self.async_config.wait_seconds:.0f} s "
                    f"(max_staleness={self.async_config.max_staleness} may drop every group: raise it)"
                )
            with changed:
                changed.wait(timeout=min(left, 0.05))


__all__ = ["AsyncConfig", "AsyncGRPOTrainer", "AsyncSchedule", "RolloutWorkerError", "resume_policy"]
