"""`RouteReplayPPOTrainer`: AReaL 1.0.4's `PPOTrainer` whose actor is routereplay's `RouteReplayFSDPPPOActor`.

Two changes to AReaL's trainer, nothing else:
- before AReaL's own `__init__` runs, `replay_mode.configure(config)`: the mode from AReaL's config
  (`rollout.return_routed_experts=true` means R3 unless `ROUTEREPLAY_AREAL_ROUTER_REPLAY` says otherwise), written
  into `actor.scheduling_spec[0].env_vars` so every actor worker reads it, and the refusals (Archon or Megatron
  actor, vLLM rollout with routes, R2 with rollout routes, R2 without compute_logp), raised before any worker,
  model or engine starts;
- `_create_train_engine` builds the actor (`config.actor` on an FSDP backend) from `RouteReplayFSDPPPOActor`, in
  SPMD mode directly and in single-controller mode through its inherited `as_controller` (AReaL's workers import
  the engine class by module and name, so the class is module-level). The reference model and the teacher keep
  AReaL's own `FSDPPPOActor`: natural routing (the route columns reach their HF model as keyword arguments the
  model ignores). The critic is untouched.

Use it where an AReaL script builds `PPOTrainer(config, train_dataset=..., valid_dataset=...)`; the rest of the
script (`trainer.train(workflow=...)`) is unchanged, with routereplay's route-carrying workflows
(`routereplay.integrations.areal.workflows`) for R3.
"""

from __future__ import annotations

from typing import Any

from areal.trainer.rl_trainer import PPOTrainer
from areal.utils.environ import is_single_controller

from routereplay.integrations.areal.fsdp_actor import RouteReplayFSDPPPOActor
from routereplay.integrations.areal.replay_mode import AReaLReplayMode, configure


class RouteReplayPPOTrainer(PPOTrainer):
    """AReaL's PPOTrainer with routereplay R3 / R2 on its FSDP actor."""

    router_replay_mode: AReaLReplayMode

    def __init__(self, config: Any, train_dataset: Any = None, valid_dataset: Any = None) -> None:
        self.router_replay_mode = configure(config)
        super().__init__(config, train_dataset=train_dataset, valid_dataset=valid_dataset)

    def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
        if actor_config is not self.config.actor or alloc.backend != "fsdp":
            return super()._create_train_engine(actor_config, alloc)
        if is_single_controller():
            actor = RouteReplayFSDPPPOActor.as_controller(actor_config, self.scheduler)
        else:
            actor = RouteReplayFSDPPPOActor(config=actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor


__all__ = ["RouteReplayPPOTrainer"]
