"""Samples in flight in fully-async GRPO: partial rollouts, their routes across resumes, finished groups.

In fully-async RL the rollout engine keeps sampling while the trainer updates. When new weights
arrive, every in-flight request is aborted at a token boundary and resumed under the new version,
with its prompt plus everything generated so far as the new input. A `RolloutPool` holds what the
rollout side has started and the trainer has not taken yet:

- a `PartialRollout` per sample: its tokens, the engine's log-prob of each, the policy version each
  response token was sampled under, and counts of aborts and resumes;
- a `RouteStore` per group: every engine call's routes go through it with their policy version, so
  the sample's final trace covers every position exactly once, with per-row provenance. A group's
  store is dropped with the group once the trainer has taken it, so memory stays bounded.

Which routes a resumed prefix keeps is the `ResumeRoutes` policy. A resumed call re-prefills the
prefix under the new weights, and its routes there may differ from those used when the tokens
were sampled:
- `latest`: the resumed call's routes replace the prefix's (verl #6029's fix). The trace matches the
  last chunk's KV cache, not the routes used when the earlier tokens were sampled.
- `first`: each row keeps the routes of the call that first fed it (the store's default). The trace
  is the routes at sampling, but the last chunk was computed on a prefix routed otherwise.
- `prefix-replay`: `first`, and the engine's resumed prefill replays those routes (engine-side
  prefix replay, `HFEngine.generate(prefix_routes=...)`), so both hold at once. The resumed call
  then re-routes no stored row differently: `prefix_conflicts` stays 0.

Nothing received before an abort is lost (the verl #5344 defect): the tokens, log-probs and routes of
an aborted call are stored before the sample is resumed. A call aborted before its prefill changes
nothing and is counted (`aborted_before_output`).
Thread safety: every method holds the pool's lock; the rollout worker and the trainer share one pool.
Legend: G = group size, N = a sample's tokens (prompt + response), R = its response tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from routereplay.engines.hf import Rollout
from routereplay.enums import StrEnum
from routereplay.errors import ConfigError
from routereplay.store.route_store import RouteStore
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace


class ResumeRoutes(StrEnum):
    """Which routes a resumed prefix keeps (see the module docstring)."""

    LATEST = "latest"
    FIRST = "first"
    PREFIX_REPLAY = "prefix-replay"


@dataclass(slots=True)
class PartialRollout:
    """One sample on the rollout side: what has been sampled so far, under which policy versions."""

    sample_id: int
    group: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version each response token was sampled under
    finished: bool = False  # reached EOS or max_new_tokens
    ended_by_eos: bool = False
    aborts: int = 0  # calls that stopped it before it finished
    aborted_before_output: int = 0  # of those, calls stopped before their prefill (nothing computed)
    resumes: int = 0  # calls that re-fed a sampled prefix
    resumed_rows: int = 0  # rows re-fed by its last resume: the positions whose routing the resume policy decides

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def oldest_version(self) -> int | None:
        """The policy version of its first sampled token (None before any)."""
        return self.versions[0] if self.versions else None


@dataclass(slots=True)
class Group:
    """The `group_size` samples of one prompt, and the store of their routes."""

    index: int
    problem: Any
    samples: list[PartialRollout]
    store: RouteStore

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def oldest_version(self) -> int:
        return min(v for s in self.samples for v in s.versions[:1])

    def rollouts(self) -> list[Rollout]:
        """The finished samples as `Rollout`s, each with its merged trace (rows [0, N - 1), token ids named)."""
        return [
            Rollout(s.prompt_ids, s.response_ids, s.logprobs, self.store.trace(s.sample_id), s.ended_by_eos)
            for s in self.samples
        ]


@dataclass(frozen=True, slots=True)
class CallInputs:
    """What one engine call gets: the samples it continues, their inputs, its token budget, prefix routes."""

    samples: list[PartialRollout]
    prompts: list[list[int]]
    max_new_tokens: int
    prefix_routes: list[RouteTrace | None] | None


class RolloutPool:
    """Groups admitted by the rollout side, continued across aborts, taken whole by the trainer."""

    def __init__(
        self, *, group_size: int, max_new_tokens: int, resume: ResumeRoutes | str, eos_token_id: int | None
    ) -> None:
        if group_size < 1 or max_new_tokens < 1:
            raise ConfigError(f"group_size={group_size} and max_new_tokens={max_new_tokens} must be >= 1")
        try:
            self.resume = ResumeRoutes(resume)
        except ValueError:
            raise ConfigError(f"resume routes {resume!r} must be one of {[str(r) for r in ResumeRoutes]}") from None
        self.group_size, self.max_new_tokens, self.eos_token_id = group_size, max_new_tokens, eos_token_id
        self._groups: dict[int, Group] = {}
        self._next_sample = 0
        self._lock = threading.Lock()
        self.dropped_groups = 0  # groups the trainer refused as too stale

    def __len__(self) -> int:
        """Groups admitted and not yet taken (in flight or finished and waiting)."""
        with self._lock:
            return len(self._groups)

    def admit(self, index: int, problem: Any, prompt_ids: Sequence[int]) -> None:
        """Start a group of `group_size` samples of one prompt."""
        with self._lock:
            if index in self._groups:
                raise ConfigError(f"group {index} is already in the pool")
            samples = [
                PartialRollout(self._next_sample + g, index, [int(t) for t in prompt_ids])
                for g in range(self.group_size)
            ]
            self._next_sample += self.group_size
            self._groups[index] = Group(index, problem, samples, RouteStore())

    def next_call(self, limit: int | None = None) -> CallInputs | None:
        """The unfinished samples, continued in one engine call (None when every admitted sample finished).

        `limit` caps the call at the engine's concurrency (vLLM's `max_num_seqs`): the oldest samples go
        first, so the ones waiting are the newest and staleness stays bounded."""
        with self._lock:
            samples = [s for g in self._groups.values() for s in g.samples if not s.finished][:limit]
            if not samples:
                return None
            budget = max(self.max_new_tokens - len(s.response_ids) for s in samples)
            prefix: list[RouteTrace | None] | None = None
            if self.resume is ResumeRoutes.PREFIX_REPLAY and any(s.response_ids for s in samples):
                prefix = [self._prefix(s) if s.response_ids else None for s in samples]
            return CallInputs(samples, [s.token_ids for s in samples], budget, prefix)

    def _prefix(self, sample: PartialRollout) -> RouteTrace | None:
        store = self._groups[sample.group].store
        return store.trace(sample.sample_id) if store.geometry is not None else None

    def receive(self, call: CallInputs, rollouts: Sequence[Rollout], version: int) -> None:
        """Store what one engine call returned, aborted or not; `version` is the engine's policy version."""
        if len(rollouts) != len(call.samples):
            raise ConfigError(f"the engine returned {len(rollouts)} rollouts for {len(call.samples)} inputs")
        with self._lock:
            for sample, prompt, rollout in zip(call.samples, call.prompts, rollouts, strict=True):
                self._receive(sample, prompt, rollout, version)

    def _receive(self, sample: PartialRollout, fed: list[int], rollout: Rollout, version: int) -> None:
        if rollout.trace is None and not rollout.response_ids:  # stopped before its prefill: nothing computed
            sample.aborts += 1
            sample.aborted_before_output += 1
            return
        remaining = self.max_new_tokens - len(sample.response_ids)
        new = rollout.response_ids[:remaining]  # a call runs to the largest budget of its batch
        tokens = fed + new
        trace = rollout.trace
        if trace is not None and trace.stop > len(tokens) - 1:
            trace = trace.slice(trace.start, len(tokens) - 1)
        if sample.response_ids:
            sample.resumes += 1
            sample.resumed_rows = len(fed) - 1
        policy = MergePolicy.REPLACE if self.resume is ResumeRoutes.LATEST else MergePolicy.KEEP
        store = self._groups[sample.group].store
        store.add_turn(sample.sample_id, tokens, trace, policy=policy, policy_version=version)
        sample.response_ids += new
        sample.logprobs += rollout.logprobs[: len(new)]
        sample.versions += [version] * len(new)
        sample.ended_by_eos = self.eos_token_id is not None and self.eos_token_id in new
        sample.finished = sample.ended_by_eos or len(sample.response_ids) >= self.max_new_tokens
        if not sample.finished:
            sample.aborts += 1

    def take(self, count: int, *, current_version: int, max_staleness: int) -> list[Group] | None:
        """The `count` oldest finished groups, or None while fewer are ready.

        A finished group whose oldest token is more than `max_staleness` versions behind
        `current_version` is dropped (counted in `dropped_groups`) and never trained on."""
        with self._lock:
            ready = []
            for index, group in list(self._groups.items()):
                if not group.finished:
                    continue
                if current_version - group.oldest_version > max_staleness:
                    del self._groups[index]
                    self.dropped_groups += 1
                    continue
                ready.append(group)
            if len(ready) < count:
                return None
            taken = ready[:count]
            for group in taken:
                del self._groups[group.index]
            return taken

    def conflicting_rows(self, groups: Sequence[Group]) -> int:
        """Stored rows a later call re-routed differently (under `prefix-replay`, always 0)."""
        return sum(group.store.stats().conflicting_rows for group in groups)


__all__ = ["CallInputs", "Group", "PartialRollout", "ResumeRoutes", "RolloutPool"]
