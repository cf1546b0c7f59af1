"""verl's own agent loops with checked routes: `single_turn_agent` and `tool_agent`, registered under verl's names.

verl 0.9.1 builds each sample's agent loop with `hydra.utils.instantiate(_agent_loop_registry[agent_name])` in
`AgentLoopWorker._run_agent_loop`, and fills that registry with its `@register(name)` decorator. This module
subclasses verl's `SingleTurnAgentLoop` and `ToolAgentLoop` with `RouteCheckedAgentLoop` and registers them under
verl's names through that same decorator, so verl's default loop (`rollout.agent.default_agent_loop:
single_turn_agent`) and its tool loop (`agent_name: tool_agent` in the data) hand the trainer checked routes
with no user code:

- every `server_manager.generate` call's routes are added by token position as the call returns
  (`call_routes.RecordingServer` / `AgentLoopRoutes`): the engine is verl's `rollout.name`, the model's
  MoE layers come from its HF config (`actor_rollout_ref.model`, read once per process and path);
- when the loop returns, its `AgentLoopOutput` carries the merged routes as a codec blob with the token ids
  (`extra_fields["routereplay_routes"]`) and `routed_experts = None`: verl's `_postprocess` copies the blob into
  the batch's non-tensor column, and routereplay's FSDP engine checks each sample's tokens against it.

A loop with R3 off (no call returns routes) is exactly verl's. The names are taken only from verl's own classes:
a loop a user registered under either name (`rollout.agent.agent_loop_config_path`, loaded after this module) is
left alone and logged; mix `RouteCheckedAgentLoop` into such a loop (first base) for checked routes.

`fsdp_engine` (verl's `external_lib`, imported by `HFModelConfig` in every `AgentLoopWorker` too) imports this
module as soon as verl's agent-loop package is loaded (`registration.register_agent_loops_when_verl_loads`).
This module imports verl.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, _agent_loop_registry, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from routereplay.errors import ConfigError
from routereplay.integrations.verl.call_routes import AgentLoopRoutes, RecordingServer
from routereplay.integrations.verl.rollout import RouteGeometry

logger = logging.getLogger("routereplay.integrations.verl")


@functools.lru_cache(maxsize=8)
def geometry_at(path: str, trust_remote_code: bool, use_shm: bool) -> RouteGeometry:
    """The `RouteGeometry` of the model whose HF config is at `path` (verl's `copy_to_local` resolves remote paths).
    Memoised per process: a frozen value of a file's contents, read once instead of once per sample."""
    from transformers import AutoConfig
    from verl.utils.fs import copy_to_local

    local = copy_to_local(path, use_shm=use_shm)
    return RouteGeometry.from_hf_config(AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code))


def model_route_geometry(trainer_config: Any) -> RouteGeometry:
    """The routed geometry of verl's `actor_rollout_ref.model` (its `hf_config_path`, else its `path`)."""
    model = trainer_config.actor_rollout_ref.model
    path = model.get("hf_config_path", None) or model.get("path", None)
    if not path:
        raise ConfigError("actor_rollout_ref.model.path is not set: the rollout's routes need the model's HF config")
    return geometry_at(str(path), bool(model.get("trust_remote_code", False)), bool(model.get("use_shm", False)))


class RouteCheckedAgentLoop:
    """Mix in first, before a verl `AgentLoopBase` subclass: its `server_manager.generate` calls are recorded
    (`RecordingServer`) and its `AgentLoopOutput` leaves `run` with the sample's checked routes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route_recorder = RecordingServer(self.server_manager, self.new_routes)  # type: ignore[has-type]
        self.server_manager = self.route_recorder

    def new_routes(self) -> AgentLoopRoutes:
        """This sample's `AgentLoopRoutes`, made when its first engine call returns routes."""
        config = self.config  # type: ignore[attr-defined]
        return AgentLoopRoutes(model_route_geometry(config), engine=str(config.actor_rollout_ref.rollout.name))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)  # type: ignore[misc]
        self.route_recorder.put_on(output)
        return output


class RouteCheckedSingleTurnAgentLoop(RouteCheckedAgentLoop, SingleTurnAgentLoop):
    """verl's `SingleTurnAgentLoop` with checked routes."""


class RouteCheckedToolAgentLoop(RouteCheckedAgentLoop, ToolAgentLoop):
    """verl's `ToolAgentLoop` with checked routes."""


CHECKED_LOOPS: dict[str, tuple[type, type]] = {
    "single_turn_agent": (SingleTurnAgentLoop, RouteCheckedSingleTurnAgentLoop),
    "tool_agent": (ToolAgentLoop, RouteCheckedToolAgentLoop),
}


def target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"  # what verl's `register` writes as `_target_`


def register_checked_agent_loops() -> dict[str, str]:
    """Register the checked loops under verl's names wherever those names hold verl's own loops (or nothing), with
    verl's `register`; a name a user registered another loop under is kept and logged. Returns name -> target."""
    targets = {}
    for name, (verl_loop, checked_loop) in CHECKED_LOOPS.items():
        held = _agent_loop_registry.get(name)
        target = held.get("_target_") if held is not None else None
        if target in (None, target_of(verl_loop), target_of(checked_loop)):
            register(name)(checked_loop)
        else:
            logger.warning(
                "routereplay: agent loop %r is registered to %s, not verl's %s; it is left as is, so its routes are "
                "verl's unchecked routed_experts: mix "
                "routereplay.integrations.verl.checked_loops.RouteCheckedAgentLoop into it (first base) "
                "for checked routes",
                name,
                target,
                verl_loop.__name__,
            )
        targets[name] = str(_agent_loop_registry[name].get("_target_"))
    return targets


# imported (by fsdp_engine's hook, or by hydra instantiating a loop) after verl's loops registered themselves
register_checked_agent_loops()

__all__ = [
    "RouteCheckedAgentLoop",
    "RouteCheckedSingleTurnAgentLoop",
    "RouteCheckedToolAgentLoop",
    "model_route_geometry",
    "register_checked_agent_loops",
]
