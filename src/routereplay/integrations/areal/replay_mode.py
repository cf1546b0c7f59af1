"""Which replay the AReaL actor runs (disabled / R2 / R3), read from AReaL's own config, and what is refused.

The mode is `MODE_ENV` = `ROUTEREPLAY_AREAL_ROUTER_REPLAY` in {disabled, R2, R3}: first from the actor config's own
`scheduling_spec[*].env_vars` (AReaL's config, so the same YAML works in SPMD mode and in single-controller mode,
where the scheduler hands those variables to the worker that builds the engine), then from the process
environment. A config value and a different environment value contradict each other: `ConfigError`. Unset (or
empty) is not the same as `disabled`: the actor drops a batch's route columns only under a chosen `disabled`; routes
on a batch while no mode was chosen are refused (`check_columns_dropped`), naming R3 and `disabled`.

`configure(config)` is the trainer's config step (`trainer.RouteReplayPPOTrainer` runs it before AReaL's own
`PPOTrainer.__init__`): AReaL's `rollout.return_routed_experts=true` (which already turns on SGLang's capture)
means R3 unless the user chose a mode; the chosen mode is written into `actor.scheduling_spec[0].env_vars`, so
every actor worker reads the same one. It refuses, by name, what cannot replay correctly:
- tree training (`actor.enable_tree_training`: shared prefixes packed once, positions are not one trajectory's);
- an Archon actor backend (`actor.backend=archon:...`): AReaL's experimental torchtitan-style engine routes with
  its own `TokenChoiceTopKRouter` (experimental/models/archon/moe/router.py), which routereplay does not bind;
- a Megatron actor backend with R2 / R3: AReaL's `MegatronEngine` is not wired to routereplay (AReaL's own
  Megatron R3 is AReaL #1207 / #1496, open); routereplay's Megatron adapter is `routereplay.runtime.megatron`;
- R3 with a vLLM rollout backend (AReaL captures routes from SGLang only) or without
  `rollout.return_routed_experts=true` (no routes would reach the batch);
- R2 with `rollout.return_routed_experts=true` (R2 replays the trainer's own routing: the rollout's routes would
  silently make it R3), and R2 when AReaL skips the old-log-prob pass that records
  (`actor.should_compute_prox_logp()` false: `actor.recompute_logprob=false` without the decoupled loss, or a
  `prox_logp_method` that skips the forward pass).

Nothing here imports AReaL at module top: `mode_of` reads any object with AReaL's attribute names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from routereplay.enums import StrEnum
from routereplay.errors import ConfigError

MODE_ENV = "ROUTEREPLAY_AREAL_ROUTER_REPLAY"
ROUTES_FLAG = "rollout.return_routed_experts"  # AReaL's own key: SGLang's route capture on
MEGATRON_ISSUES = "AReaL #1207 / #1496"


class AReaLReplayMode(StrEnum):
    DISABLED = "disabled"
    R2 = "R2"  # record in compute_logp, replay the recording in every ppo_update micro-batch
    R3 = "R3"  # replay the rollout's routes (the batch's routes column) in compute_logp and every update


def _parsed(value: str, where: str) -> AReaLReplayMode:
    text = value.strip()
    for mode in AReaLReplayMode:
        if text.lower() == mode.value.lower():
            return mode
    raise ConfigError(f"{MODE_ENV}={value!r} in {where}; use one of {[m.value for m in AReaLReplayMode]}")


def _spec_env(spec: Any) -> Mapping[str, Any]:
    env = getattr(spec, "env_vars", None)
    if env is None and isinstance(spec, Mapping):
        env = spec.get("env_vars")
    return env if isinstance(env, Mapping) else {}


def configured_mode(actor_config: Any) -> AReaLReplayMode | None:
    """The mode the actor config's `scheduling_spec[*].env_vars` set, None if none does (contradicting specs:
    `ConfigError`)."""
    found: dict[AReaLReplayMode, int] = {}
    for i, spec in enumerate(getattr(actor_config, "scheduling_spec", None) or ()):
        value = _spec_env(spec).get(MODE_ENV)
        if value is not None and str(value).strip():
            found.setdefault(_parsed(str(value), f"actor.scheduling_spec[{i}].env_vars"), i)
    if len(found) > 1:
        raise ConfigError(
            f"actor.scheduling_spec entries set {MODE_ENV} to {[m.value for m in found]} (specs "
            f"{list(found.values())}); set it once, in actor.scheduling_spec[0].env_vars"
        )
    return next(iter(found), None)


def chosen_mode(actor_config: Any) -> AReaLReplayMode | None:
    """The mode the user chose: the config's `scheduling_spec[*].env_vars`, then this process's environment; None
    when neither sets it (an empty value counts as unset). A config value and a different environment value are a
    `ConfigError`."""
    from_config = configured_mode(actor_config)
    env_value = os.environ.get(MODE_ENV, "")
    from_env = _parsed(env_value, "the environment") if env_value.strip() else None
    if from_config is not None and from_env is not None and from_config is not from_env:
        raise ConfigError(
            f"actor.scheduling_spec env_vars set {MODE_ENV}={from_config.value} but this process's environment has "
            f"{MODE_ENV}={from_env.value}; unset one of them"
        )
    return from_config or from_env


def mode_of(actor_config: Any) -> AReaLReplayMode:
    """The actor's mode: `chosen_mode`, else disabled."""
    return chosen_mode(actor_config) or AReaLReplayMode.DISABLED


def check_columns_dropped(actor_config: Any, where: str) -> None:
    """Under disabled, the actor drops a batch's route columns. Refused (`ConfigError`) when nobody chose that:
    routes on the batch with no mode set mean a routed workflow fed an actor that was never switched on (routes
    would be dropped silently, the update trained on natural routing). An explicit `disabled` drops them."""
    if chosen_mode(actor_config) is not None:
        return
    raise ConfigError(
        f"{where} carries the rollout's routes ('routereplay_routes') but {MODE_ENV} is not set (not in "
        "actor.scheduling_spec[*].env_vars nor this process's environment), so the actor would drop them and train "
        f"with natural routing. Replay them: set {ROUTES_FLAG}=true and train with "
        f"routereplay.integrations.areal.trainer.RouteReplayPPOTrainer (it sets {MODE_ENV}=R3), or set "
        f"{MODE_ENV}=R3 in actor.scheduling_spec[0].env_vars. Or train with natural routing on purpose: set "
        f"{MODE_ENV}=disabled (the columns are then dropped)"
    )


def backend_of(spec: str, key: str) -> str:
    """The engine name of an AReaL allocation string (`fsdp:d4`, `sglang:d2t1`, `archon:d8`), as AReaL's
    `ModelAllocation.from_str` reads it when AReaL is importable."""
    try:
        from areal.api.alloc_mode import ModelAllocation
    except ImportError:
        return spec.split(":", 1)[0].strip().lower()
    return str(ModelAllocation.from_str(spec, name=key).backend)


def refusal(config: Any, mode: AReaLReplayMode) -> str | None:
    """Why `config` (AReaL's PPOConfig / GRPOConfig) cannot run `mode`, or None."""
    actor, rollout = config.actor, config.rollout
    actor_backend = backend_of(actor.backend, "actor")
    rollout_backend = backend_of(rollout.backend, "rollout") if getattr(rollout, "backend", "") else "sglang"
    captured = bool(getattr(rollout, "return_routed_experts", False))
    if mode is AReaLReplayMode.DISABLED:
        return None
    if actor_backend == "archon":
        return (
            f"{MODE_ENV}={mode.value} with actor.backend={actor.backend}: AReaL's experimental Archon engine routes "
            "with its own torchtitan-style TokenChoiceTopKRouter (areal/experimental/models/archon/moe/router.py), "
            "which routereplay does not bind, so nothing would replay. Use an FSDP actor (actor.backend=fsdp:...) "
            f"or {_way_off(captured)}"
        )
    if actor_backend == "megatron":
        return (
            f"{MODE_ENV}={mode.value} with actor.backend={actor.backend}: AReaL's MegatronEngine is not wired to "
            f"routereplay (AReaL's own Megatron R3 is {MEGATRON_ISSUES}, open; routereplay's Megatron adapter is "
            "routereplay.runtime.megatron, not plugged into AReaL). Use an FSDP actor (actor.backend=fsdp:...) or "
            f"{_way_off(captured)}"
        )
    if actor_backend != "fsdp":
        return (
            f"{MODE_ENV}={mode.value} with actor.backend={actor.backend}: routereplay replays on AReaL's FSDP actor "
            "only (actor.backend=fsdp:...)"
        )
    if getattr(actor, "enable_tree_training", False):
        return (
            f"{MODE_ENV}={mode.value} with actor.enable_tree_training=true: tree training packs shared prefixes once, "
            "so a position of the model input is not one token of one trajectory; set actor.enable_tree_training=false"
        )
    if mode is AReaLReplayMode.R3:
        if rollout_backend == "vllm":
            return (
                f"{MODE_ENV}=R3 with rollout.backend={rollout.backend}: AReaL captures rollout routes from SGLang only "
                f"({ROUTES_FLAG} is refused with vLLM), so the batch would carry no routes. Use an SGLang rollout "
                f"(rollout.backend=sglang:...), or R2 ({MODE_ENV}=R2 with {ROUTES_FLAG}=false: the trainer's own "
                "routing)"
            )
        if not captured:
            return (
                f"{MODE_ENV}=R3 without {ROUTES_FLAG}=true: SGLang would not return routes and the batch would carry "
                f"none. Set {ROUTES_FLAG}=true (an SGLang rollout), or use {MODE_ENV}=R2"
            )
    if mode is AReaLReplayMode.R2:
        if captured:
            return (
                f"{MODE_ENV}=R2 with {ROUTES_FLAG}=true: R2 records the trainer's own routing in compute_logp and "
                "replays it in the updates, so the rollout's routes on the batch would silently make it R3. Unset "
                f"one: {ROUTES_FLAG}=false for R2, or {MODE_ENV}=R3 (the default with {ROUTES_FLAG}=true)"
            )
        should = getattr(actor, "should_compute_prox_logp", None)
        if callable(should) and not should():
            return (
                f"{MODE_ENV}=R2 while AReaL skips the actor's compute_logp (actor.recompute_logprob="
                f"{actor.recompute_logprob}, actor.use_decoupled_loss={actor.use_decoupled_loss}, "
                f"actor.prox_logp_method={actor.prox_logp_method}): R2 records there, so the updates would have "
                f"nothing to replay. {_compute_logp_fix(actor)}"
            )
    return None


def _way_off(captured: bool) -> str:
    """How to turn replay off: with `ROUTES_FLAG` on, R3 was inferred from it (the user may never have set
    `MODE_ENV`)."""
    if captured:
        return (
            f"turn replay off: {MODE_ENV}=disabled, or {ROUTES_FLAG}=false ({ROUTES_FLAG}=true alone means R3 under "
            "RouteReplayPPOTrainer)"
        )
    return f"turn replay off: {MODE_ENV}=disabled (or unset it)"


def _compute_logp_fix(actor: Any) -> str:
    """How to make AReaL run compute_logp, from the actor's own values (AReaL's `should_compute_prox_logp`: the
    decoupled loss runs it unless `prox_logp_method` skips the forward pass (loglinear); otherwise
    `recompute_logprob` decides)."""
    if getattr(actor, "use_decoupled_loss", False):
        return (
            f"With the decoupled loss, actor.prox_logp_method={actor.prox_logp_method} approximates the proximal "
            "log-probs without a forward pass: set actor.prox_logp_method=recompute (or metrics), or "
            "actor.use_decoupled_loss=false with actor.recompute_logprob=true"
        )
    return "Set actor.recompute_logprob=true (or actor.use_decoupled_loss=true with actor.prox_logp_method=recompute)"


def configure(config: Any) -> AReaLReplayMode:
    """The trainer's config step on AReaL's PPOConfig / GRPOConfig: R3 when `ROUTES_FLAG` is on and no mode was
    chosen, the mode written into `actor.scheduling_spec[0].env_vars`, refusals raised (`ConfigError`)."""
    actor = config.actor
    chosen = chosen_mode(actor)
    mode = chosen or AReaLReplayMode.DISABLED
    if chosen is None and bool(getattr(config.rollout, "return_routed_experts", False)):
        mode = AReaLReplayMode.R3
    reason = refusal(config, mode)
    if reason is not None:
        raise ConfigError(reason)
    specs = getattr(actor, "scheduling_spec", None) or ()
    if mode is not AReaLReplayMode.DISABLED:
        if not specs:
            raise ConfigError(f"actor.scheduling_spec is empty: AReaL needs one SchedulingSpec to carry {MODE_ENV}")
        env = getattr(specs[0], "env_vars", None)
        if not isinstance(env, MutableMapping):
            raise ConfigError(
                f"actor.scheduling_spec[0].env_vars is {type(env).__name__}; AReaL's SchedulingSpec holds a dict there"
            )
        env[MODE_ENV] = mode.value
    return mode


__all__ = [
    "MODE_ENV",
    "ROUTES_FLAG",
    "AReaLReplayMode",
    "backend_of",
    "check_columns_dropped",
    "chosen_mode",
    "configure",
    "configured_mode",
    "mode_of",
    "refusal",
]
