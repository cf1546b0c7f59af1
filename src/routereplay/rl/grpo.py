"""A small, readable GRPO with router replay: off, R2 or R3.

One step is:
1. the engine samples `group_size` answers per prompt (rewards come from the task);
2. advantages are normalised within each group;
3. the old-log-prob pass runs once, without grad;
4. several policy-update mini-steps follow, each on one mini-batch, so weights change between the
   old-log-prob pass and the later mini-steps. The loss is PPO's clipped ratio, plus an optional
   k3 KL to a frozen reference model.

Routing per mode:
- off: routers run naturally everywhere. Routes are still recorded, to measure drift.
- R2: the old-log-prob pass records the trainer's routing, and every mini-step replays it.
- R3: the old-log-prob pass and every mini-step replay the engine's routes (its traces). The last
  token of each sequence has no engine route and routes live (counted). Traces that carry token ids
  (the built-in engine's do) are checked against the trainer batch's ids at every replay, so a
  shifted sequence (an extra or stripped BOS) is a `TokenMismatchError`, never a silent misroute.
The reference model routes naturally, or, with `reference_routing="replay"`, like the policy.
Routing it naturally while the KL term is on is warned about, because its ratio then also
measures routing drift.

Per step the record holds:
- reward;
- rollout-vs-train routing disagreement and log-prob mismatch (old-log-prob pass vs engine);
- routing drift between the old-log-prob pass and each mini-step, and each mini-step's
  disagreement with the engine's routes on the rows the engine routed;
- ppo_kl, clip fraction, grad norm, fallback rows, and seconds per phase.
This is closer to REINFORCE with a PPO clip than to a tuned GRPO: small on purpose.
Legend: B = sequences, S = positions, L = layers, K = top-k, G = group size.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from routereplay.engines.hf import Rollout, SamplingParams
from routereplay.enums import StrEnum
from routereplay.errors import ConfigError
from routereplay.metrics import logprob_mismatch, routing_agreement
from routereplay.rl.scoring import Batch, batch_of, engine_logprobs, engine_routes, logprobs_of, routing, token_logprobs
from routereplay.rl.tasks import AdditionTask
from routereplay.runtime import Replayer, attach


class TrainMode(StrEnum):
    """Router replay in RL training: none, the trainer's own routing (R2), the engine's (R3)."""

    OFF = "off"
    R2 = "R2"
    R3 = "R3"


class Engine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Rollout]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOConfig:
    mode: str = TrainMode.OFF.value
    steps: int = 4
    prompts_per_step: int = 32
    group_size: int = 4
    mini_steps: int = 4
    lr: float = 3e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    reference_routing: str = "natural"  # or "replay": the reference replays the same routes as the policy
    max_new_tokens: int = 5
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if "R2" in self.mode and "R3" in self.mode:
            raise ConfigError(
                f"mode={self.mode!r}: R2 and R3 at once is contradictory - R2 replays the trainer's routing, R3 the "
                "engine's; pick one"
            )
        try:
            TrainMode(self.mode)
        except ValueError:
            raise ConfigError(f"mode={self.mode!r} must be one of off, R2, R3") from None
        if self.reference_routing not in ("natural", "replay"):
            raise ConfigError(f"reference_routing={self.reference_routing!r} must be 'natural' or 'replay'")
        batch = self.prompts_per_step * self.group_size
        if min(self.steps, self.prompts_per_step, self.group_size, self.mini_steps) < 1 or batch % self.mini_steps:
            raise ConfigError(
                f"steps, prompts_per_step, group_size and mini_steps must be >= 1, and mini_steps ({self.mini_steps}) "
                f"must divide the batch of prompts_per_step x group_size = {batch}"
            )


class GRPOTrainer:
    """Trains `model` on `task` with rollouts from `engine`, in one `TrainMode`."""

    def __init__(
        self,
        model: nn.Module,
        task: AdditionTask,
        engine: Engine,
        config: GRPOConfig,
        *,
        log_path: str | Path | None = None,
        tensorboard_dir: str | Path | None = None,
    ) -> None:
        self.model, self.task, self.engine, self.config = model, task, engine, config
        self.writer: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "tensorboard logging needs the tensorboard package: pip install tensorboard"
                ) from None
            self.writer = SummaryWriter(str(tensorboard_dir))
        self.mode = TrainMode(config.mode)
        self.replayer: Replayer = attach(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
        self.reference: nn.Module | None = None
        self.reference_replayer: Replayer | None = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            if config.reference_routing == "natural" and self.mode is not TrainMode.OFF:
                warnings.warn(
                    f"kl_coef > 0 with reference_routing='natural' under {self.mode}: the reference routes on its own, "
                    "so the KL term also measures routing drift; pass reference_routing='replay' to replay it too",
                    stacklevel=2,
                )
            if config.reference_routing == "replay":
                self.reference_replayer = attach(self.reference)
        self.log_path = Path(log_path) if log_path is not None else None
        self.history: list[dict[str, Any]] = []

    def train(self, progress: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
        for step in range(self.config.steps):
            self.step(step)
            if progress is not None:
                progress(f"training ({self.mode})", step + 1, self.config.steps)
        return self.history

    def step(self, step: int) -> dict[str, Any]:
        """Sample a batch from the engine (synced to the trainer's weights first), then `learn` from it."""
        config, task = self.config, self.task
        begin = time.perf_counter()
        sync = getattr(self.engine, "sync_weights", None)
        if callable(sync):  # colocated engines (built-in, vLLM) sample from the trainer's current weights
            sync(self.model, policy_version=step)
        problems = task.problems(config.prompts_per_step, seed=config.seed * 7919 + step)
        prompts = [ids for ids in task.prompt_ids(problems) for _ in range(config.group_size)]
        params = task.sampling(
            max_new_tokens=config.max_new_tokens, seed=config.seed * 104729 + step, temperature=config.temperature
        )
        rollouts = self.engine.generate(prompts, params)
        rewards = [task.reward(problems[i // config.group_size], r.response_ids) for i, r in enumerate(rollouts)]
        return self.learn(step, rollouts, rewards, seconds={"rollout": time.perf_counter() - begin})

    def learn(
        self,
        step: int,
        rollouts: Sequence[Rollout],
        rewards: Sequence[float],
        *,
        seconds: dict[str, float] | None = None,
        extra: dict[str, Any] | None = None,
        token_subsets: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """One GRPO update from sampled rollouts, `group_size` consecutive ones per prompt.

        Advantages are normalised within each group; the old-log-prob pass and the update mini-steps
        run under this trainer's mode. `extra` is merged into the step's record (the async loop's
        staleness and resume counts); the record is logged and returned. `token_subsets` maps a name
        to a (B, S) bool mask laid out like the batch (right-padded prompt + response): the record
        gets `k3_kl_<name>` over the response tokens it selects (None when it selects none)."""
        config, seconds = self.config, dict(seconds or {})
        if len(rollouts) != len(rewards) or not rollouts or len(rollouts) % config.group_size:
            raise ConfigError(
                f"learn needs one reward per rollout and whole groups of {config.group_size}; got {len(rollouts)} "
                f"rollouts and {len(rewards)} rewards"
            )
        if len(rollouts) % config.mini_steps:
            raise ConfigError(f"mini_steps={config.mini_steps} must divide the batch of {len(rollouts)} rollouts")
        rewards_B = torch.tensor([float(r) for r in rewards])
        grouped = rewards_B.reshape(-1, config.group_size)
        advantages_B = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
        batch = batch_of(rollouts, self.task.pad_token_id)

        begin = time.perf_counter()
        self.replayer.stats.reset()
        with torch.no_grad():
            old_routing = "engine" if self.mode is TrainMode.R3 else None
            old_BS, old_routes = token_logprobs(self.model, batch, replayer=self.replayer, routes=old_routing)
        assert old_routes is not None
        infer_BS = engine_logprobs(rollouts, batch.ids_BS.shape)
        engine_BSLK = engine_routes(rollouts, batch.ids_BS.shape, len(self.replayer.layers), self.replayer.top_k)
        rollout_routing = routing_agreement(old_routes, engine_BSLK, batch.mask_BS.bool())
        mismatch = logprob_mismatch(old_BS, infer_BS, batch.response_BS)
        subsets: dict[str, float | None] = {}
        for name, subset_BS in (token_subsets or {}).items():
            selected_BS = subset_BS[:, : batch.response_BS.shape[1]].bool() & batch.response_BS
            subsets[f"k3_kl_{name}"] = (
                logprob_mismatch(old_BS, infer_BS, selected_BS)["k3_kl"] if selected_BS.any() else None
            )
        seconds["old_logprob"] = time.perf_counter() - begin

        begin = time.perf_counter()
        updates = [
            self._mini_step(batch.select(rows), old_BS[rows], old_routes[rows], engine_BSLK[rows], advantages_B[rows])
            for rows in torch.arange(len(rollouts)).chunk(config.mini_steps)
        ]
        seconds["update"] = time.perf_counter() - begin
        record = {
            "step": step,
            "mode": str(self.mode),
            "reward_mean": float(rewards_B.mean()),
            "rollout_routing_disagreement": rollout_routing["routing_disagreement"],
            "rollout_token_disagreement": rollout_routing["token_disagreement"],
            "k3_kl": mismatch["k3_kl"],
            "extreme_frac_2": mismatch["extreme_frac_2"],
            "mean_abs_dlogp": mismatch["mean_abs_dlogp"],
            "drift_per_mini_step": [u["drift"] for u in updates],
            "max_drift": max(u["drift"] for u in updates),
            "rollout_disagreement_per_mini_step": [u["rollout_disagreement"] for u in updates],
            "ppo_kl": sum(u["ppo_kl"] for u in updates) / len(updates),
            "clip_frac": sum(u["clip_frac"] for u in updates) / len(updates),
            "grad_norm": sum(u["grad_norm"] for u in updates) / len(updates),
            "fallback_rows": self.replayer.stats.fallback_rows,
            **self.replayer.stats.as_metrics(),  # router_replay/... of the step's passes (docs/metrics.md)
            "seconds": seconds,
            **subsets,
            **(extra or {}),
        }
        self.history.append(record)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8") as stream:
                stream.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.writer.add_scalar(f"{self.mode}/{key}", value, step)
            self.writer.flush()
        return record

    def _mini_step(
        self,
        batch: Batch,
        old_BS: torch.Tensor,
        old_routes: torch.Tensor,
        engine_BSLK: torch.Tensor,
        advantages_B: torch.Tensor,
    ) -> dict[str, float]:
        """One policy update on a mini-batch; reports drift of its routing from the old-log-prob pass."""
        self.model.train()
        forced: torch.Tensor | str | None = {TrainMode.OFF: None, TrainMode.R2: old_routes, TrainMode.R3: "engine"}[
            self.mode
        ]
        response_BS = batch.response_BS
        tokens = response_BS.sum().clamp(min=1)
        with routing(self.replayer, batch, forced) as used:  # forward AND backward inside: recompute-safe
            new_BS = logprobs_of(self.model, batch)
            ratio_BS = (new_BS - old_BS).exp()
            advantage_BS = advantages_B[:, None].expand_as(ratio_BS)
            clipped_BS = ratio_BS.clamp(1 - self.config.clip_eps, 1 + self.config.clip_eps)
            surrogate_BS = torch.minimum(ratio_BS * advantage_BS, clipped_BS * advantage_BS)
            loss = -(surrogate_BS * response_BS).sum() / tokens
            if self.reference is not None:
                reference_routes = None if self.config.reference_routing == "natural" else forced
                with torch.no_grad(), routing(self.reference_replayer, batch, reference_routes):
                    reference_BS = logprobs_of(self.reference, batch)
                delta_BS = reference_BS - new_BS
                loss = loss + self.config.kl_coef * ((delta_BS.exp() - 1 - delta_BS) * response_BS).sum() / tokens
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self.model.eval()
        assert used is not None
        attended = batch.mask_BS.bool()
        drift = routing_agreement(used.routes, old_routes, attended)["routing_disagreement"]
        rollout = routing_agreement(used.routes, engine_BSLK, attended)["routing_disagreement"]
        with torch.no_grad():
            log_ratio = (old_BS - new_BS.detach())[response_BS]
        return {
            "drift": drift,
            "rollout_disagreement": rollout,
            "ppo_kl": float(log_ratio.mean()),
            "clip_frac": float(((ratio_BS.detach() - 1).abs() > self.config.clip_eps)[response_BS].float().mean()),
            "grad_norm": grad_norm,
        }


__all__ = ["GRPOConfig", "GRPOTrainer", "TrainMode"]
