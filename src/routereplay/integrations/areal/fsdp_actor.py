"""R3 and R2 on AReaL 1.0.4's FSDP actor: `RouteReplayFSDPPPOActor`, a subclass of AReaL's own `FSDPPPOActor`.

AReaL's actor runs every model call through `FSDPEngine.forward_backward_batch`: per micro-batch
`_prepare_mb_inputs` (Ulysses SP pad + slice), `self.model(**inputs)`, the loss, `loss.backward()`. This class
keeps that loop and wraps it at three seams:
- `compute_logp` / `ppo_update` (whole calls, before AReaL splits anything): the mode (`replay_mode.mode_of`),
  every trajectory's routes checked (`packed_layout.read_columns`, the token check), the rows put in a
  `RouteTable` and the two contract columns replaced by `ROW_KEY`, which AReaL splits, packs and pads like
  `input_ids`. An update never half-steps on a bad batch: all of it is checked before its first mini-batch.
- `_prepare_mb_inputs` (each micro-batch): the model's slice of `ROW_KEY` (Ulysses: this rank's part) becomes
  `[1, T, M, K]` routes (-1 on AReaL's padding: the live router), the model's `input_ids` are checked against the
  tokens the rows were placed for, and the micro-batch's replay (or record) context opens;
- `forward_backward_batch`: the context of a micro-batch closes when the next one is prepared, after AReaL ran its
  forward, loss and backward (activation-checkpoint recompute replays the same routes), and at the end.

Modes: R3 replays the batch's `ROUTES_KEY` in compute_logp and every update micro-batch; R2 records the actor's
own routing in compute_logp (kept per sample, keyed by its tokens: `skyrl.recorded_routes.RecordedRoutes`,
all-gathered over the dp group) and replays it in every update micro-batch; a compute_logp after an update starts
a new recording. disabled: AReaL's actor, the route columns dropped before the model sees them; only when the
mode was chosen (`MODE_ENV=disabled`): routes on a batch while no mode was set are a `ConfigError`.

R3's token check is on by default; `UNCHECKED_ENV=1` in a worker's environment replays without comparing, counts
the samples (`router_replay/unchecked_samples`) and warns once per call; without `TOKENS_KEY` R3 refuses a batch
unless opted out. Metrics (ReplayStats deltas per call, `router_replay/...`) go to AReaL's `stats_tracker` under
`ppo_actor/compute_logp/` and `ppo_actor/update/`. Legend: B trajectories, S positions, T model-input positions,
M MoE layers, K top-k.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from areal.engine.fsdp_engine import FSDPPPOActor
from areal.utils import stats_tracker
from torch import nn

from routereplay.errors import ConfigError, MissingRoutesError, RowCountError, UncheckedRoutesError
from routereplay.integrations.areal.columns import ROUTES_KEY, TOKENS_KEY
from routereplay.integrations.areal.packed_layout import (
    ROW_KEY,
    UNCHECKED_ENV,
    RouteTable,
    attended_lengths,
    check_tokens,
    read_columns,
    ulysses_slice,
    unchecked_opt_out,
)
from routereplay.integrations.areal.replay_mode import (
    MODE_ENV,
    ROUTES_FLAG,
    AReaLReplayMode,
    check_columns_dropped,
    mode_of,
)
from routereplay.integrations.skyrl.policy_worker import model_geometry
from routereplay.integrations.skyrl.recorded_routes import RecordedRoutes
from routereplay.integrations.verl import RouteGeometry
from routereplay.runtime.stats import ReplayStats

METRIC_PREFIX = "router_replay/"
COLUMNS = (ROUTES_KEY, TOKENS_KEY)

logger = logging.getLogger("routereplay.integrations.areal")


@dataclass(slots=True)
class MicroBatchReplay:
    """The open replay / record context of the micro-batch AReaL is running."""

    stack: ExitStack
    row_xT: torch.Tensor
    recording: Any
    records: bool


@dataclass(slots=True)
class ActorRouting:
    """Per-actor replay state: the Replayer bound to the HF model, R2's recordings, the current call's table."""

    replayer: Any = None
    module: nn.Module | None = None
    geometry: RouteGeometry | None = None
    recorded: RecordedRoutes = field(default_factory=RecordedRoutes)
    recording: bool = False  # an R2 recording is being built (compute_logp since the last update)
    table: RouteTable | None = None  # the current compute_logp / ppo_update call's rows
    records: bool = False  # the current call records (R2 compute_logp)
    open: MicroBatchReplay | None = None
    checked_samples: int = 0
    unchecked_samples: int = 0

    def bind(self, module: nn.Module) -> Any:
        if self.module is not module:
            import routereplay

            if self.replayer is not None:
                self.replayer.detach()
            self.replayer, self.module = routereplay.attach(module), module
            self.geometry = model_geometry(module, self.replayer)
            self.recorded = RecordedRoutes(num_experts=self.geometry.num_experts)
        return self.replayer

    def close_micro_batch(self) -> None:
        """Leave the open micro-batch's context (its forward and backward have run); R2 keeps what it recorded."""
        current, self.open = self.open, None
        if current is None:
            return
        current.stack.close()
        if current.records and self.table is not None:
            self.table.fill(current.row_xT, current.recording.routes)


def _without_columns(data: Any) -> Any:
    if isinstance(data, list):
        return [{k: v for k, v in d.items() if k not in COLUMNS} for d in data]
    return {k: v for k, v in data.items() if k not in COLUMNS}


def _missing_routes(where: str) -> MissingRoutesError:
    return MissingRoutesError(
        f"R3 ({MODE_ENV}=R3, or {ROUTES_FLAG}=true): {where} has no '{ROUTES_KEY}' column. AReaL's own workflows drop "
        f"the routes SGLang returns: run routereplay's RoutedRLVRWorkflow / RoutedMultiTurnWorkflow "
        f"(routereplay.integrations.areal.workflows) with {ROUTES_FLAG}=true, or set {MODE_ENV}=R2 / disabled"
    )


def _unchecked_refusal(where: str) -> UncheckedRoutesError:
    return UncheckedRoutesError(
        f"R3: {where} carries '{ROUTES_KEY}' without '{TOKENS_KEY}', so nothing ties its rows to its tokens (rows "
        "shifted, or equal-length trajectories swapped, would replay onto the wrong tokens). Fix: build the episode "
        f"dict with routereplay's AReaL workflows (both columns); or opt this worker out with {UNCHECKED_ENV}=1: it "
        "then replays such batches unchecked and counts them"
    )


class RouteReplayFSDPPPOActor(FSDPPPOActor):
    """AReaL's FSDP PPO actor with routereplay R3 / R2 in compute_logp and every ppo_update micro-batch."""

    def routing(self) -> ActorRouting:
        state = self.__dict__.get("_routereplay_routing")
        if state is None:
            state = ActorRouting()
            self.__dict__["_routereplay_routing"] = state
        return state

    def router_replay_mode(self) -> AReaLReplayMode:
        return mode_of(self.config)

    def routereplay_stats(self) -> dict[str, Any]:
        """The replayer's counters, the token-check counts, R2's recorded samples and the mode (a plain dict)."""
        state = self.routing()
        counts = dataclasses.asdict(state.replayer.stats) if state.replayer is not None else {}
        return {
            "mode": self.router_replay_mode().value,
            "recorded_samples": len(state.recorded),
            "checked_samples": state.checked_samples,
            "unchecked_samples": state.unchecked_samples,
            **counts,
        }

    def dropped_columns(self, data: Any, where: str) -> Any:
        """disabled: the batch without the route columns; routes on it while no mode was chosen: `ConfigError`."""
        episodes = data if isinstance(data, list) else [data]
        if any(episode.get(ROUTES_KEY) is not None for episode in episodes):
            check_columns_dropped(self.config, where)
        return _without_columns(data)

    # -- whole calls ------------------------------------------------------------------------------------------------
    def compute_logp(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        mode = self.router_replay_mode()
        if mode is AReaLReplayMode.DISABLED:
            return super().compute_logp(self.dropped_columns(data, "the compute_logp batch"), *args, **kwargs)
        with self.routed_call(data, mode, "compute_logp") as prepared:
            return super().compute_logp(prepared, *args, **kwargs)

    def ppo_update(self, data: Any, *args: Any, **kwargs: Any) -> None:
        mode = self.router_replay_mode()
        if mode is AReaLReplayMode.DISABLED:
            return super().ppo_update(self.dropped_columns(data, "the update batch"), *args, **kwargs)
        self.routing().recording = False  # the next compute_logp starts a new R2 recording
        with self.routed_call(data, mode, "update") as prepared:
            return super().ppo_update(prepared, *args, **kwargs)

    @contextmanager
    def routed_call(self, data: Any, mode: AReaLReplayMode, name: str) -> Iterator[Any]:
        """Check the whole batch, build the call's `RouteTable`, hand AReaL the batch with `ROW_KEY`; afterwards
        keep R2's recording and report the call's counts."""
        if getattr(self.config, "enable_tree_training", False):
            raise ConfigError(
                f"{MODE_ENV}={mode.value} with actor.enable_tree_training=true: tree training shares prefix tokens "
                "between sequences, so positions are not the rollout's; set actor.enable_tree_training=false"
            )
        state = self.routing()
        state.bind(self.model)
        assert state.geometry is not None
        records = mode is AReaLReplayMode.R2 and name == "compute_logp"
        if records and not state.recording:
            state.recorded.clear()
            state.recording = True
        episodes = data if isinstance(data, list) else [data]
        table = RouteTable(len(state.geometry.moe_layers), state.geometry.top_k)
        prepared, rows, unchecked, checked = [], [], 0, 0
        opted_out = mode is AReaLReplayMode.R3 and unchecked_opt_out()
        for i, episode in enumerate(episodes):
            where = f"the {name} batch's trajectory {i}"
            lengths_B = attended_lengths(episode, where)
            routes = self.episode_routes(episode, mode, records, where, lengths_B)
            if mode is AReaLReplayMode.R3:
                tokens = episode.get(TOKENS_KEY)
                if tokens is None and not opted_out:
                    raise _unchecked_refusal(where)
                if opted_out:
                    unchecked += int(lengths_B.shape[0])
                else:
                    check_tokens(tokens, episode["input_ids"], lengths_B, where)
                    checked += int(lengths_B.shape[0])
            row_BS = table.add(episode["input_ids"], lengths_B, routes)
            rows.append((episode, row_BS))
            prepared.append({**{k: v for k, v in episode.items() if k not in COLUMNS}, ROW_KEY: row_BS})
        if unchecked:
            logger.warning(
                "routereplay R3: %d trajectories of a %s call replayed without the token check (%s=1)",
                unchecked, name, UNCHECKED_ENV,
            )  # fmt: skip
        state.unchecked_samples += unchecked
        state.checked_samples += checked
        before = state.replayer.stats.copy()
        state.table, state.records = table, records
        try:
            yield prepared if isinstance(data, list) else prepared[0]
            if records:
                self.keep_recording(table, rows)
        finally:
            state.close_micro_batch()
            state.table, state.records = None, False
        recorded = table.size * len(state.geometry.moe_layers) if records else 0  # attended rows, not AReaL's pad
        self.report(state.replayer.stats.since(before), unchecked, recorded, name)

    def episode_routes(
        self, episode: dict[str, Any], mode: AReaLReplayMode, records: bool, where: str, lengths_B: torch.Tensor
    ) -> torch.Tensor | None:
        """The trajectory's `[B, S, M, K]` routes to replay (None: R2's recording call, rows still to record)."""
        state = self.routing()
        assert state.geometry is not None
        has_routes = episode.get(ROUTES_KEY) is not None
        if mode is AReaLReplayMode.R2:
            if has_routes:
                raise ConfigError(
                    f"{MODE_ENV}=R2 with the rollout's routes on the batch ({where} has '{ROUTES_KEY}'): R2 replays "
                    f"the trainer's own routing, so they would silently make it R3. Set {ROUTES_FLAG}=false for R2, or "
                    f"{MODE_ENV}=R3"
                )
            if records:
                return None
            return self.recorded_routes(episode, lengths_B, where)
        if not has_routes:
            raise _missing_routes(where)
        routes, _ = read_columns(episode, state.geometry, where, lengths_B=lengths_B, tokens_required=False)
        return routes

    def recorded_routes(self, episode: dict[str, Any], lengths_B: torch.Tensor, where: str) -> torch.Tensor:
        state = self.routing()
        if not len(state.recorded):
            raise MissingRoutesError(
                f"R2: nothing recorded on this actor for {where}; AReaL's compute_logp (the old-log-prob pass) records "
                "and must run on the batch before every ppo_update (actor.recompute_logprob=true)"
            )
        ids_BS = episode["input_ids"]
        mask_BS = torch.arange(ids_BS.shape[1]).unsqueeze(0) < lengths_B.unsqueeze(1)
        try:
            return state.recorded.routes_for(ids_BS, mask_BS)
        except MissingRoutesError as err:
            raise MissingRoutesError(
                f"R2: {where} was not in the compute_logp call that recorded routes (its tokens differ from every "
                "recorded sample's); R2 replays what compute_logp recorded for the same batch"
            ) from err

    def keep_recording(self, table: RouteTable, rows: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """R2: the recorded table (all SP ranks' parts) kept per sample by its tokens, shared over dp."""
        state = self.routing()
        routes_NMK, _ = table.rows()
        if self.parallel_helper.sp_size > 1:  # each position was routed on exactly one SP rank; -1 on the others
            gathered = routes_NMK.to(self.device)
            dist.all_reduce(gathered, op=dist.ReduceOp.MAX, group=self.sp_group)
            routes_NMK.copy_(gathered.cpu())
        if bool((routes_NMK < 0).any()):
            raise RowCountError(
                f"R2: compute_logp left {int((routes_NMK[:, 0, 0] < 0).sum())} attended tokens without a recorded "
                "route; AReaL laid the micro-batches out differently from routereplay (report it, with AReaL's version)"
            )
        for episode, row_BS in rows:
            routes_BSMK = table.model_routes(row_BS)
            state.recorded.remember(episode["input_ids"], row_BS > 0, routes_BSMK)
        state.recorded.share(self.dp_group if self.parallel_helper.dp_size > 1 else None)

    def report(self, delta: ReplayStats, unchecked: int, recorded: int, name: str) -> None:
        """The call's metrics into AReaL's stats tracker under `ppo_actor/<name>/router_replay/...`: counts summed
        over calls and dp ranks, rates (`*_rate`, per layer too) averaged."""
        metrics = delta.as_metrics()
        metrics[METRIC_PREFIX + "unchecked_samples"] = float(unchecked)
        metrics[METRIC_PREFIX + "recorded_rows"] = float(recorded)
        rates = {k: v for k, v in metrics.items() if "_rate" in k}
        counts = {k: torch.tensor([v], dtype=torch.float32) for k, v in metrics.items() if k not in rates}
        with stats_tracker.scope("ppo_actor"), stats_tracker.scope(name):
            calls = METRIC_PREFIX + "calls"
            stats_tracker.denominator(**{calls: torch.ones(1, dtype=torch.bool)})
            stats_tracker.stat(denominator=calls, reduce_type=stats_tracker.ReduceType.SUM, **counts)
            stats_tracker.scalar(**rates)

    # -- AReaL's micro-batch loop ---------------------------------------------------------------------------------
    def _prepare_mb_list(self, input_: dict[str, Any]) -> Any:
        if self.routing().table is None and any(input_.get(key) is not None for key in COLUMNS):
            if self.router_replay_mode() is not AReaLReplayMode.DISABLED:
                raise ConfigError(
                    f"the route columns reached AReaL's engine outside compute_logp / ppo_update (forward, "
                    f"train_batch or eval_batch called directly), where {MODE_ENV} does not replay them; call "
                    "compute_logp / ppo_update, or drop the columns"
                )
            input_ = self.dropped_columns(input_, "the engine's batch")
        return super()._prepare_mb_list(input_)

    def _prepare_mb_inputs(self, mb_item: Any) -> tuple[dict[str, Any], Any]:
        state = self.routing()
        row_1T = mb_item.padded_mb.pop(ROW_KEY, None)
        state.close_micro_batch()  # the previous micro-batch's forward and backward are done
        if state.table is None or row_1T is None:
            if state.table is not None:
                raise RowCountError(f"a micro-batch of this call lost the '{ROW_KEY}' column (AReaL dropped it)")
            return super()._prepare_mb_inputs(mb_item)
        inputs, ctx = super()._prepare_mb_inputs(mb_item)
        sp_size, sp_rank = self.parallel_helper.sp_size, 0
        if sp_size > 1:
            from areal.models.fsdp.ulysses import get_ulysses_sequence_parallel_rank

            sp_rank = get_ulysses_sequence_parallel_rank()
        row_xT = ulysses_slice(row_1T, sp_size, sp_rank, fill=0)
        ids_xT = inputs["input_ids"]
        state.table.check_fed(row_xT, ids_xT, f"packed micro-batch, Ulysses SP rank {sp_rank} of {sp_size}")
        self.open_micro_batch(row_xT, ids_xT.device)
        return inputs, ctx

    def open_micro_batch(self, row_xT: torch.Tensor, device: torch.device) -> None:
        state = self.routing()
        assert state.table is not None
        stack = ExitStack()
        if state.records:
            context = state.replayer.record()
        else:
            routes_xTMK = state.table.model_routes(row_xT).to(device)
            mask_xT = (row_xT > 0).to(device)
            # -1 on attended positions (each sequence's final token, tool spans) routes live on purpose: the
            # padding-side heuristic does not apply to a packed row
            context = state.replayer.replay(routes_xTMK, attention_mask=mask_xT, check_alignment=False)
        recording = stack.enter_context(context)
        state.open = MicroBatchReplay(stack, row_xT, recording, state.records)

    def forward_backward_batch(self, mb_list: Any, process_output_fn: Any, forward_only: bool = False) -> None:
        try:
            super().forward_backward_batch(mb_list, process_output_fn, forward_only=forward_only)
        finally:
            self.routing().close_micro_batch()


__all__ = ["METRIC_PREFIX", "UNCHECKED_ENV", "RouteReplayFSDPPPOActor", "unchecked_opt_out"]
