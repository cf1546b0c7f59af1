"""Router replay for verl's FSDP / FSDP2 training engine: a subclass of verl's `FSDPEngineWithLMHead`.

verl 0.9.1 replays routes on its Megatron and VeOmni engines only; for `strategy: fsdp|fsdp2`
`engine_workers.py` leaves router replay disabled. This engine wraps each micro-batch of
`forward_backward_batch` in routereplay's `attach(model)` contexts, reading the mode from the field
verl's Megatron engine reads too, `engine_config.router_replay.mode`:

- `R3`: every pass (old-log-prob and each update) replays the rollout's `routed_experts`;
- `R2`: `compute_log_prob` (forward only, no `routed_experts` in the batch) records the trainer's
  own routing and returns it as `routed_experts`, which verl's trainer merges into the batch
  (`ray_trainer.py` `_compute_old_log_prob`), and every update replays it. The rollout's routes on
  the batch are a `ConfigError` under R2, as verl refuses R2 with `enable_rollout_routing_replay`:
  the compact column in any pass, `routed_experts` in the forward-only pass, and in an update routes
  with -1 rows or a final-token row repeating an expert (verl's zero fill), which no recording has;
- `disabled`: exactly verl's engine.

Routes are laid out as verl lays out the micro-batch (packed THD, Ulysses SP shard, pad_to_length,
or right padding; `micro_batch.py`), and every forward checks that verl fed the model the tokens
the routes were placed for. A replay context spans a micro-batch's forward and its backward
(activation-checkpoint recomputes replay too): it opens in `forward_step` and closes when the next
micro-batch starts or `forward_backward_batch` ends.

Routes come from routereplay's compact column (`batch.ROUTES_KEY`: codec blobs whose token ids are
checked against the micro-batch) when the rollout side put one on the batch, else from verl's own
`routed_experts` tensor, read by the batch readers' dense reader (`routed_experts_for_batch`,
`routed_experts.py`). Both are checked against the model's geometry (`model_geometry`: top-k, experts,
MoE layers, an all-layer payload's dense columns) before anything is decoded. routereplay's dense form is
checked against its token digest. A `routed_experts` without a digest (`route_checks.py`):
- R3 (verl's own agent-loop form, no token ids): refused (`UncheckedRoutesError`) unless every worker sets
  `ROUTEREPLAY_VERL_UNCHECKED_ROUTES=1`; then replayed unchecked, as verl replays it, and the samples are
  counted and logged once per `forward_backward_batch`;
- R2 (what compute_log_prob recorded; verl's trainer keeps only that tensor): each sample whose token ids
  this rank recorded must carry exactly the rows recorded for them (`TokenMismatchError` otherwise);
  samples another rank recorded are counted as unverified.
verl's agent loop fills every row its engine did not route with zeros, which is not only each sequence's
final token: a multi-turn sample's tool-response tokens after its last engine call are zero rows too. Zero
rows are treated by that reader's rule (-1 where verl's own masks say no engine routed the position), not as
expert 0; R2's recorded rows are all routes and are kept.

-1 rows on attended positions (tool tokens) route live in both layouts verl feeds the model: packed
(`use_remove_padding=True`) and padded with an attention mask (`False`) dispatch the same experts.

Turning it on (every Ray worker imports the module through verl's `external_lib`, the agent-loop workers
too, or from `verl/__init__` with `VERL_USE_EXTERNAL_MODULES=routereplay.integrations.verl.fsdp_engine`; the
engine is registered for this platform's vendor and `VERL_ENGINE_VENDOR`'s, which `EngineRegistry` prefers,
as soon as verl's engines are imported, before or after this module, and routereplay's checked
`single_turn_agent` / `tool_agent` as soon as verl's agent loops are: `registration.py`, `checked_loops.py`):

    actor_rollout_ref.model.external_lib=routereplay.integrations.verl.fsdp_engine
    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3      # or R2
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True     # R3: the rollout returns routes

With verl's own agent loops that is all: each sample's routes reach the batch as a compact blob naming its
tokens. A loop of the user's own that returns verl's `routed_experts` is refused under R3 unless it mixes in
`checked_loops.RouteCheckedAgentLoop`, or every worker opts out of the token check with
`'+ray_kwargs.ray_init.runtime_env.env_vars.ROUTEREPLAY_VERL_UNCHECKED_ROUTES="1"'` (counted, logged).

Nothing here imports verl until verl's workers are loaded or `engine_class()` / `register_engine()` is
called. Legend: B = sequences, N = tokens of a micro-batch, P = payload layers, L = bound MoE
layers, K = top-k, S = positions of a model input row.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from routereplay.errors import ConfigError, MissingRoutesError
from routereplay.integrations.verl import tokenizer_routes
from routereplay.integrations.verl.batch import ROUTES_KEY as COMPACT_KEY
from routereplay.integrations.verl.batch import VERL_ROUTES_KEY
from routereplay.integrations.verl.micro_batch import (
    MicroBatchLayout,
    RouteSource,
    bound_layers,
    check_recorded,
    has_digest,
    offsets_of,
    r2_with_rollout_routes,
    recorded_batch_routes,
    rollout_routes,
    route_source,
    routes_of,
)
from routereplay.integrations.verl.registration import (
    register_agent_loops_when_verl_loads,
    register_sglang_replica_when_verl_loads,
    register_under,
    register_when_verl_loads,
)
from routereplay.integrations.verl.rollout import RouteGeometry
from routereplay.integrations.verl.route_checks import (
    RecordedRoutes,
    ReplayCounts,
    unchecked_opt_out,
    unchecked_refusal,
)
from routereplay.runtime.stats import METRIC_PREFIX, ReplayStats

MODES = ("disabled", "R2", "R3")
ENGINE_NAME = "RouteReplayFSDPEngine"


class Action(Enum):
    OFF = "off"
    RECORD = "record"
    REPLAY = "replay"


def action_for(mode: str, source: RouteSource | None, forward_only: bool) -> Action:
    """What one `forward_backward_batch` does with the routers, from the mode and the batch's routes."""
    if mode not in MODES:
        raise ConfigError(f"router_replay.mode={mode!r}; use one of {list(MODES)}")
    if mode == "disabled":
        return Action.OFF
    if mode == "R2" and source is RouteSource.COMPACT:
        raise ConfigError(r2_with_rollout_routes(f"the '{COMPACT_KEY}' column"))
    if mode == "R2" and forward_only and source is not None:
        raise ConfigError(r2_with_rollout_routes(f"'{VERL_ROUTES_KEY}' in the compute_log_prob (forward-only) pass"))
    if source is not None:
        return Action.REPLAY
    if mode == "R2" and forward_only:
        return Action.RECORD
    what = (
        "the rollout's routes (set actor_rollout_ref.rollout.enable_rollout_routing_replay=True)"
        if mode == "R3"
        else "the routes compute_log_prob recorded (run compute_log_prob before the update, without R3 routes)"
    )
    raise MissingRoutesError(
        f"router_replay.mode={mode}: a {'forward-only' if forward_only else 'training'} micro-batch has no "
        f"'{VERL_ROUTES_KEY}'; it needs {what}"
    )


def model_geometry(module: nn.Module, replayer: Any) -> RouteGeometry:
    """The routed geometry the readers check routes against: experts, top-k and MoE layers of the routers the
    replayer bound, and the layer axis of an all-layer payload from the HF config (`num_hidden_layers`)."""
    config = getattr(module, "config", None)
    text = getattr(config, "text_config", None) or config
    moe_layers = tuple(sorted(set(replayer.layers)))
    num_layers = getattr(text, "num_hidden_layers", None)
    return RouteGeometry(
        num_experts=int(replayer.num_experts),
        num_layers=int(num_layers) if isinstance(num_layers, int) else moe_layers[-1] + 1,
        top_k=int(replayer.top_k),
        moe_layers=moe_layers,
    )


@dataclass(slots=True)
class EngineRouting:
    """Per-engine replay state: the Replayer bound to the engine's module, the model's geometry, the open context,
    what R2 recorded on this rank (`route_checks.RecordedRoutes`) and the samples replayed unchecked."""

    replayer: Any = None
    module: nn.Module | None = None
    geometry: RouteGeometry | None = None
    contexts: ExitStack = field(default_factory=ExitStack)
    layout: MicroBatchLayout | None = None
    recorded: RecordedRoutes = field(default_factory=RecordedRoutes)
    counts: ReplayCounts = field(default_factory=ReplayCounts)

    def replayer_for(self, module: nn.Module) -> Any:
        if self.module is not module:
            import routereplay

            if self.replayer is not None:
                self.replayer.detach()
            self.replayer, self.module = routereplay.attach(module), module
            self.geometry = model_geometry(module, self.replayer)
            self.recorded.clear()
        return self.replayer

    def close(self) -> None:
        """Leave the open record/replay context (its micro-batch's backward has run)."""
        self.layout = None
        self.contexts.close()

    def close_and_detach(self) -> None:
        """Leave any context and unbind the routers: the module is exactly as verl built it."""
        self.close()
        if self.replayer is not None:
            self.replayer.detach()
        self.replayer, self.module, self.geometry = None, None, None
        self.recorded.clear()


class RouteReplayEngineMixin:
    """The routereplay part of the engine, mixed in before verl's `FSDPEngineWithLMHead`.

    Uses only what verl's engine sets up: `module`, `engine_config`, `use_ulysses_sp`,
    `ulysses_sequence_parallel_size`, `ulysses_parallel_group`, `_get_packed_pad_size`."""

    def routing(self) -> EngineRouting:
        state = getattr(self, "_routereplay_routing", None)
        if state is None:
            state = EngineRouting()
            self._routereplay_routing = state
        return state

    def router_replay_mode(self) -> str:
        config = getattr(getattr(self, "engine_config", None), "router_replay", None)
        mode = config.get("mode") if isinstance(config, Mapping) else getattr(config, "mode", None)
        return str(mode or "disabled")  # a dict when set with hydra's `+...router_replay.mode=R3`

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        state = self.routing()
        state.close()
        if forward_only and self.router_replay_mode() == "R2" and route_source(data) is None:
            state.recorded.clear()  # a new recording pass (compute_log_prob): what the last one recorded is done
        before = state.replayer.stats.copy() if state.replayer is not None else None  # this pass's counts: since
        try:
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)  # type: ignore[misc]
        finally:
            state.close()  # the last replay context closes: its device counts are read (once) here
            samples = (state.counts.unchecked, state.counts.unverified)  # this pass's (log_pass starts a new one)
            state.counts.log_pass()
        if not forward_only and isinstance(output, dict) and isinstance(output.get("metrics"), dict):
            add_replay_metrics(output["metrics"], state, before, samples)
        return output

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        state = self.routing()
        state.close()  # the previous micro-batch's backward has run: its context is done
        mode = self.router_replay_mode()
        action = action_for(mode, route_source(micro_batch), forward_only)
        if action is Action.OFF:
            return super().forward_step(micro_batch, loss_function, forward_only)  # type: ignore[misc]
        replayer = state.replayer_for(self.module)  # type: ignore[attr-defined]
        layout = self.micro_batch_layout(micro_batch)
        device = next(self.module.parameters()).device  # type: ignore[attr-defined]
        if action is Action.REPLAY:
            routes_NLK = self.checked_routes(micro_batch, mode, layout)
            placed = layout.place(routes_NLK.to(device), fill=-1)
            # The routes and the mask are laid out by one `MicroBatchLayout`, so the replayer's padding-side
            # heuristic has nothing to find, and it would refuse what R3 keeps on purpose: -1 rows on attended
            # positions (tool-response tokens, no route) route live. `check_tokens` checks the layout instead.
            context = replayer.replay(placed, attention_mask=layout.attention_mask(device), check_alignment=False)
        else:
            context = replayer.record()
        try:
            recording = state.contexts.enter_context(context)
            state.layout = layout
            loss, output = super().forward_step(micro_batch, loss_function, forward_only)  # type: ignore[misc]
            if action is Action.RECORD:
                routes_NLK = layout.recorded(recording.routes, getattr(self, "ulysses_parallel_group", None))
                recorded_BjLK = recorded_batch_routes(routes_NLK, layout.cu_seqlens, replayer.num_experts)
                state.recorded.remember(micro_batch["input_ids"], recorded_BjLK)
                output.setdefault("model_output", {})[VERL_ROUTES_KEY] = recorded_BjLK
                state.close()
        except BaseException:
            state.close()
            raise
        return loss, output

    def checked_routes(self, micro_batch: Any, mode: str, layout: MicroBatchLayout) -> torch.Tensor:
        """(N, L, K) routes of a replaying micro-batch, checked before any forward: against the model's geometry,
        the compact column's token ids or the dense form's digest; digest-less `routed_experts` against what this
        rank recorded (R2) or refused unless opted out (R3: `route_checks.unchecked_opt_out`), counted."""
        state = self.routing()
        assert state.geometry is not None and state.replayer is not None
        input_ids = micro_batch["input_ids"]
        unchecked = route_source(micro_batch) is RouteSource.VERL and not has_digest(micro_batch)
        if unchecked and mode == "R3" and not unchecked_opt_out():
            raise unchecked_refusal(int(input_ids.size(0)))
        routes = routes_of(micro_batch, geometry=state.geometry, unchecked=unchecked, recorded=mode == "R2")
        assert routes is not None
        routes_NPK = rollout_routes(routes, input_ids, final_token_live=mode == "R3")
        if mode == "R2":
            check_recorded(routes_NPK, layout.cu_seqlens)
            if unchecked:  # R2's own recording: verl's trainer brings it back without a digest
                state.counts.add(unverified=state.recorded.check(input_ids, micro_batch[VERL_ROUTES_KEY]))
        elif unchecked:
            state.counts.add(unchecked=int(input_ids.size(0)))
        return bound_layers(routes_NPK, state.geometry.num_layers, state.replayer.layers)

    def prepare_model_inputs(self, micro_batch: Any) -> Any:
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)  # type: ignore[misc]
        layout = self.routing().layout
        if layout is not None:
            layout.check_tokens(micro_batch["input_ids"], model_inputs["input_ids"])
        return model_inputs, output_args

    def micro_batch_layout(self, micro_batch: Any) -> MicroBatchLayout:
        """How verl's `prepare_model_inputs` will lay this micro-batch out on this rank."""
        from verl.utils import tensordict_utils as tu

        input_ids = micro_batch["input_ids"]
        if not getattr(input_ids, "is_nested", False):
            raise ConfigError(
                "micro-batch input_ids is not a jagged NestedTensor; the routereplay FSDP engine reads verl's "
                "no-padding batches (verl.workers.utils.padding.left_right_2_no_padding)"
            )
        cu_B1 = offsets_of(input_ids)
        remove_padding = bool(tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True))
        sp_size = int(getattr(self, "ulysses_sequence_parallel_size", 1) or 1) if remove_padding else 1
        sp_rank = 0
        if sp_size > 1:
            sp_rank = torch.distributed.get_rank(getattr(self, "ulysses_parallel_group", None))
        tail = 0
        pad_size = getattr(self, "_get_packed_pad_size", None)
        if remove_padding and pad_size is not None and getattr(self, "pad_to_length", False):
            tail = int(pad_size(int(cu_B1[-1])))
        return MicroBatchLayout(
            remove_padding=remove_padding, cu_seqlens=cu_B1, tail_pad=tail, sp_size=sp_size, sp_rank=sp_rank
        )


def add_replay_metrics(
    metrics: dict[str, Any], state: EngineRouting, before: ReplayStats | None, samples: tuple[int, int]
) -> None:
    """An update pass's `router_replay/...` metrics (docs/metrics.md) into verl's own: one value per pass, as a
    one-item list like the loss function's per-micro-batch metrics, so verl's worker gathers them over DP ranks
    and its trainer reduces and logs them through `Tracking` (console, wandb, tensorboard)."""
    if state.replayer is None:
        return  # replay disabled
    # this pass only (the replayer's own counters keep running); a replayer bound during this pass counted only it
    stats = state.replayer.stats.since(before) if before is not None else state.replayer.stats.copy()
    if stats.replayed_rows + stats.fallback_rows == 0:
        return  # a pass that replayed nothing (recorded)
    for name, value in stats.as_metrics().items():
        metrics[name] = [value]
    metrics[METRIC_PREFIX + "unchecked_samples"] = [float(samples[0])]  # R3 opt-out: replayed without a token check
    metrics[METRIC_PREFIX + "unverified_samples"] = [float(samples[1])]  # R2: samples this rank did not record


@functools.cache
def engine_class() -> type:
    """verl's `FSDPEngineWithLMHead` with router replay (imports verl)."""
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError as err:
        from routereplay.errors import MissingDependencyError

        raise MissingDependencyError(
            f"the routereplay FSDP engine subclasses verl's FSDPEngineWithLMHead, which did not import ({err}); "
            "install verl 0.9.x beside routereplay (make venv-verl)"
        ) from err
    return type(
        ENGINE_NAME,
        (RouteReplayEngineMixin, FSDPEngineWithLMHead),
        {"__doc__": "verl's FSDP/FSDP2 language-model engine with routereplay R2/R3 (routereplay.integrations.verl)."},
    )


def register_engine(vendor: str | None = None, devices: tuple[str, ...] = ("cuda", "npu")) -> type:
    """Register the engine in verl's `EngineRegistry` (language_model, fsdp and fsdp2) under `vendor`; by default
    under this platform's (e.g. "nvidia") and the one `VERL_ENGINE_VENDOR` names, which
    `EngineRegistry.get_engine_cls` looks up before the device-only default. Idempotent; returns the class."""
    from verl.utils.device import get_vendor

    cls = engine_class()
    vendors = [vendor] if vendor else [v for v in dict.fromkeys((get_vendor(), os.getenv("VERL_ENGINE_VENDOR"))) if v]
    for name in vendors:
        register_under(cls, name, devices)
    return cls


def register_agent_loops() -> None:
    """routereplay's checked `single_turn_agent` / `tool_agent` under verl's names (`checked_loops.py`, which
    imports verl)."""
    import routereplay.integrations.verl.checked_loops as checked_loops

    checked_loops.register_checked_agent_loops()


# verl's `external_lib` / `VERL_USE_EXTERNAL_MODULES` import this module: register now, or when verl's engines load;
# and verl's agent loops (an AgentLoopWorker imports `external_lib` too) now, or when verl's agent loops load
register_when_verl_loads(register_engine)
register_agent_loops_when_verl_loads(register_agent_loops)
register_sglang_replica_when_verl_loads(tokenizer_routes.register_sglang_replica)  # SGLang 0.5.23 R3 (sglang_server.py)
