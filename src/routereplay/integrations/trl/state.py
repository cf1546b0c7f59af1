"""What `RouterReplayGRPOTrainer` keeps between TRL's phases, and the routing each pass runs under.

No TRL import here. A generation batch goes through three phases of TRL's loop:
1. generation: the routes the completions were sampled with (`engine_traces`; R3 replays them);
2. scoring (`Phase.SCORE`, inside `_generate_and_score_completions`): the old-log-prob pass runs in
   chunks of `per_device_train_batch_size` (R2 and off: recorded; R3: the engine's routes replayed),
   and the reference model's pass routes naturally or replays the same routes as the policy;
3. updates (`Phase.UPDATE`, one per `training_step`): a context opened in `compute_loss` and closed
   after `Trainer.training_step`'s backward, so backward and activation-checkpoint recompute run
   inside it: R2 replays the old pass's routes, R3 the engine's, off records (to measure drift).

The routes travel in TRL's batch dict under `OLD_ROUTES_KEY` and `ENGINE_ROUTES_KEY`: (B, S, L, K)
tensors aligned with `cat(prompt_ids, completion_ids)`, so TRL's `shuffle_sequence_dict` and
`split_tensor_dict` move them with their rows. `IDS_KEY` holds the ids they were laid out for; every
update checks them against the batch's (`TokenMismatchError` if rows moved without their routes).
Every pass leaves a `RoutingCounts`; the trainer sums them over processes and logs the fractions.

Legend: B = completions, S = prompt + completion positions, L = bound layers, K = top-k.
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from routereplay.enums import StrEnum
from routereplay.errors import ConfigError, MissingRoutesError, ReplayStateError, TokenMismatchError
from routereplay.metrics import routing_agreement
from routereplay.runtime import Recording, Replayer, ReplayStats
from routereplay.trace.route_trace import RouteTrace

Member = TypeVar("Member", bound=StrEnum)

OLD_ROUTES_KEY = "router_replay_old_routes"  # (B, S, L, K): the routes the old-log-prob pass used
ENGINE_ROUTES_KEY = "router_replay_engine_routes"  # (B, S, L, K): the generation's routes, -1 where none
IDS_KEY = "router_replay_input_ids"  # (B, S): the ids the routes above were laid out for, checked at every update
METRIC_PREFIX = "router_replay/"


class RouterReplay(StrEnum):
    """Which routes the optimisation steps replay: the trainer's own old pass (R2) or the generation's (R3)."""

    R2 = "R2"
    R3 = "R3"


class ReferenceRouting(StrEnum):
    """How the reference model (beta != 0) routes: on its own, or replaying the policy's routes."""

    NATURAL = "natural"
    REPLAY = "replay"


class Phase(StrEnum):
    IDLE = "idle"
    SCORE = "score"  # inside _generate_and_score_completions: old-log-prob and reference passes
    UPDATE = "update"  # inside training_step: the optimisation forward and backward


def _member(kind: type[Member], value: str | None, refusal: str) -> Member | None:
    """`value` as a member of `kind` (None stays None); anything else is a `ConfigError` saying `refusal`."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(refusal) from None


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """`router_replay` (None: natural routing, still measured) and the reference model's routing."""

    router_replay: RouterReplay | None
    reference_routing: ReferenceRouting | None

    @classmethod
    def of(cls, router_replay: str | None, reference_routing: str | None) -> ReplaySettings:
        mode = _member(
            RouterReplay,
            router_replay,
            f"router_replay={router_replay!r}: pass 'R2' (replay the trainer's own old-log-prob routing), 'R3' "
            "(replay the routes the completions were generated with) or None (natural routing, measured)",
        )
        reference = _member(
            ReferenceRouting,
            reference_routing,
            f"reference_routing={reference_routing!r}: pass 'natural' (the reference model routes on its own) "
            "or 'replay' (it replays the same routes as the policy)",
        )
        if mode is None and reference is ReferenceRouting.REPLAY:
            raise ConfigError(
                "reference_routing='replay' with router_replay=None: there are no routes to replay; pass "
                "router_replay='R2' or 'R3', or reference_routing='natural'"
            )
        return cls(mode, reference)


@dataclass(slots=True)
class RoutingCounts:
    """(token, layer) rows of one pass: forced / live, and how many differ from the old pass / the engine."""

    replayed_rows: int = 0
    fallback_rows: int = 0
    recompute_calls: int = 0  # router calls made during backward (activation-checkpoint recompute)
    drift_differ: int = 0  # rows whose experts differ from the old-log-prob pass's
    drift_rows: int = 0  # attended rows compared with it
    engine_differ: int = 0  # rows whose experts differ from the generation's, where it routed
    engine_rows: int = 0
    compared_rows: int = 0  # replayed rows compared with the trainer's live choice (`runtime/disagreement.py`)
    disagree_rows: int = 0  # of those, rows whose forced set differs from the live choice
    forced_disagree_rows: int = 0  # of those, rows replay forced (a threshold gave none back here)

    @classmethod
    def of(cls, stats: ReplayStats) -> RoutingCounts:
        """A pass's counts from the Replayer's stats (the comparisons with other routes are added after)."""
        return cls(
            stats.replayed_rows,
            stats.fallback_rows,
            stats.recompute_calls,
            compared_rows=stats.compared_rows,
            disagree_rows=stats.disagree_rows,
            forced_disagree_rows=stats.forced_disagree_rows,
        )

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in self.__slots__], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> RoutingCounts:
        return cls(*(int(v) for v in values.tolist()))


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """One pass's routing, summed over processes: fractions of compared rows (None: nothing to compare)."""

    phase: str  # "old" (old-log-prob pass of a generation batch) or "update" (one optimisation step)
    step: int  # trainer.state.global_step when it ran
    replayed_rows: int
    fallback_rows: int
    recompute_calls: int  # router calls recomputed in backward, inside the update's context
    drift: float | None  # update vs the old-log-prob pass (None for the old pass itself)
    engine_disagreement: float | None  # vs the generation's routes, on the rows it routed
    routes_digest: str  # digest of the routes used on attended positions (this process): equal means equal


def compared(a_BSLK: torch.Tensor, b_BSLK: torch.Tensor, mask_BS: torch.Tensor) -> tuple[int, int]:
    """(differing rows, compared rows) between two routings on attended positions where both route."""
    result = routing_agreement(a_BSLK.cpu(), b_BSLK.cpu(), mask_BS.cpu().bool())
    rows = int(result["compared_rows"])
    return round(result["routing_disagreement"] * rows), rows


def check_rows(inputs: dict[str, Any]) -> None:
    """The batch's ids are the ids its routes were laid out for (`TokenMismatchError` naming the first row)."""
    ids_BS = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    routed_BS = inputs.get(IDS_KEY)
    if routed_BS is None:
        raise MissingRoutesError(f"the training batch has no {IDS_KEY!r}: its routes cannot be checked against its ids")
    if tuple(routed_BS.shape) != tuple(ids_BS.shape) or not torch.equal(routed_BS.to(ids_BS.device), ids_BS):
        same = tuple(routed_BS.shape) == tuple(ids_BS.shape)
        rows = (routed_BS.to(ids_BS.device) != ids_BS).any(dim=1).nonzero().flatten().tolist() if same else []
        where = f"row {rows[0]} ({len(rows)} of {ids_BS.shape[0]} rows differ)" if rows else "the shapes differ"
        raise TokenMismatchError(
            f"the training batch's routes were laid out for other token ids than it holds: {where}, ids "
            f"{tuple(ids_BS.shape)}, routes laid out for {tuple(routed_BS.shape)}. Its rows were reordered or split "
            f"without the {IDS_KEY!r} / router_replay_* entries; move every key of the batch dict with one "
            "permutation (TRL's shuffle_sequence_dict and split_tensor_dict do)"
        )


def routes_digest(routes_BSLK: torch.Tensor, mask_BS: torch.Tensor) -> str:
    """A short hex digest of the routes on attended positions."""
    attended = routes_BSLK.detach().cpu()[mask_BS.detach().cpu().bool()].to(torch.int32)
    return hashlib.sha256(attended.contiguous().numpy().tobytes()).hexdigest()[:16]


class TrlRouting:
    """Per-trainer state: the phase, the generation's routes, the old pass's routes, the open update."""

    def __init__(self, settings: ReplaySettings, replayer: Replayer, reference: Replayer | None) -> None:
        self.settings, self.replayer, self.reference = settings, replayer, reference
        self.phase = Phase.IDLE
        self.engine_traces: list[RouteTrace] | None = None  # the last generation's, one per completion
        self.engine_routes_BSLK: torch.Tensor | None = None  # engine_traces on the batch being scored
        self.old_routes_BSLK: torch.Tensor | None = None  # the routes the old-log-prob pass used
        self.trl_old_pass = False  # TRL computes old_per_token_logps for this batch (l.2643)
        self.old_counts = RoutingCounts()
        self.forced_logps: torch.Tensor | None = None  # the old pass run here because TRL skipped it
        self.in_training_step = False  # compute_loss opens the update's context only inside training_step
        self._stack: ExitStack | None = None
        self._recording: Recording | None = None
        self._inputs: dict[str, Any] | None = None
        self.records: list[UpdateRecord] = []

    @property
    def mode(self) -> RouterReplay | None:
        return self.settings.router_replay

    # -- scoring ----------------------------------------------------------------------------------
    def begin_score(self, trl_old_pass: bool) -> None:
        if self.phase is not Phase.IDLE:
            raise ReplayStateError(f"a generation batch is scored while the trainer is in phase {self.phase}")
        self.phase, self.trl_old_pass = Phase.SCORE, trl_old_pass
        self.engine_routes_BSLK = self.old_routes_BSLK = self.forced_logps = None
        self.old_counts = RoutingCounts()

    def end_score(self) -> None:
        self.phase = Phase.IDLE
        self.engine_traces = None  # used once: the next batch brings its own

    def old_pass_routing(self, rows: slice, mask_BS: torch.Tensor) -> AbstractContextManager[Recording]:
        """The old-log-prob pass over batch rows `rows`: R3 replays the generation's routes, else records."""
        if self.mode is RouterReplay.R3:
            return self.replayer.replay(self._engine_rows(rows), attention_mask=mask_BS)
        return self.replayer.record()

    def reference_routing(
        self, replayer: Replayer | None, rows: slice, mask_BS: torch.Tensor
    ) -> AbstractContextManager[Recording | None]:
        """The reference pass over `rows`: natural, or replaying the routes the policy's pass uses."""
        if self.settings.reference_routing is not ReferenceRouting.REPLAY or self.mode is None:
            return nullcontext(None)
        if replayer is None:
            raise ReplayStateError("reference_routing='replay' but no Replayer is attached to the reference model")
        if self.mode is RouterReplay.R3:
            return replayer.replay(self._engine_rows(rows), attention_mask=mask_BS)
        if self.old_routes_BSLK is None:
            raise ReplayStateError("the reference model replays R2 routes before the old-log-prob pass recorded them")
        return replayer.replay(self.old_routes_BSLK[rows], attention_mask=mask_BS)

    def _engine_rows(self, rows: slice) -> torch.Tensor:
        if self.engine_routes_BSLK is None:
            raise MissingRoutesError(
                "R3 needs the routes the completions were generated with, and this batch has none: generate with "
                "use_vllm=False or vllm_mode='colocate' through RouterReplayGRPOTrainer, without tools or rollout_func"
            )
        return self.engine_routes_BSLK[rows]

    def note_old_pass(self, used_BSLK: torch.Tensor, mask_BS: torch.Tensor) -> None:
        """Keep the routes the old pass used (all chunks, in order) and count them against the engine's."""
        self.old_routes_BSLK = used_BSLK.to(torch.int16 if self.replayer.num_experts <= 32767 else torch.int32)
        stats = self.replayer.stats
        counts = RoutingCounts.of(stats)
        if self.engine_routes_BSLK is not None:
            counts.engine_differ, counts.engine_rows = compared(used_BSLK, self.engine_routes_BSLK, mask_BS)
        self.old_counts = counts

    # -- updates ----------------------------------------------------------------------------------
    def open_update(self, inputs: dict[str, Any]) -> None:
        """Open the update's routing context; it stays open until `close_update` (after the backward)."""
        if self.phase is not Phase.IDLE or self._stack is not None:
            raise ReplayStateError(f"an optimisation step starts while the trainer is in phase {self.phase}")
        old_BSLK = inputs.get(OLD_ROUTES_KEY)
        if old_BSLK is None:
            raise MissingRoutesError(
                f"the training batch has no {OLD_ROUTES_KEY!r}: it did not come from RouterReplayGRPOTrainer's "
                "_generate_and_score_completions (a subclass replaced it, or dropped the key)"
            )
        check_rows(inputs)
        mask_BS = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        context: AbstractContextManager[Recording]
        if self.mode is RouterReplay.R2:
            context = self.replayer.replay(old_BSLK, attention_mask=mask_BS)
        elif self.mode is RouterReplay.R3:
            engine_BSLK = inputs.get(ENGINE_ROUTES_KEY)
            if engine_BSLK is None:
                raise MissingRoutesError(f"R3: the training batch has no {ENGINE_ROUTES_KEY!r} (generation routes)")
            context = self.replayer.replay(engine_BSLK, attention_mask=mask_BS)
        else:
            context = self.replayer.record()
        stack = ExitStack()
        self.replayer.stats.reset()
        self._recording = stack.enter_context(context)
        self._stack, self._inputs, self.phase = stack, inputs, Phase.UPDATE

    def close_update(self) -> tuple[RoutingCounts, str] | None:
        """Close the update's context; its counts and routes digest (None when no update context was open)."""
        stack, recording, inputs = self._stack, self._recording, self._inputs
        self._stack = self._recording = self._inputs = None
        self.phase = Phase.IDLE
        if stack is None or recording is None or inputs is None:
            return None
        stack.close()
        if not recording.steps:
            return None  # compute_loss ran no forward (a subclass's early exit)
        used_BSLK = recording.routes
        mask_BS = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        stats = self.replayer.stats
        counts = RoutingCounts.of(stats)
        counts.drift_differ, counts.drift_rows = compared(used_BSLK, inputs[OLD_ROUTES_KEY], mask_BS)
        engine_BSLK = inputs.get(ENGINE_ROUTES_KEY)
        if engine_BSLK is not None:
            counts.engine_differ, counts.engine_rows = compared(used_BSLK, engine_BSLK, mask_BS)
        return counts, routes_digest(used_BSLK, mask_BS)

    # -- metrics ----------------------------------------------------------------------------------
    def log(
        self,
        phase: str,
        total: RoutingCounts,
        digest: str,
        metrics: dict[str, list[float]],
        *,
        step: int,
        forced: bool = False,
    ) -> UpdateRecord:
        """Append one pass's figures (`total`: summed over processes) to TRL's `metrics` and to `records`."""
        drift = total.drift_differ / total.drift_rows if total.drift_rows else None
        engine = total.engine_differ / total.engine_rows if total.engine_rows else None
        if phase == "update":
            metrics[METRIC_PREFIX + "replayed_rows"].append(float(total.replayed_rows))
            metrics[METRIC_PREFIX + "fallback_rows"].append(float(total.fallback_rows))
            if drift is not None:
                metrics[METRIC_PREFIX + "drift"].append(drift)
            if engine is not None:
                metrics[METRIC_PREFIX + "engine_disagreement"].append(engine)
            if total.compared_rows:  # the trainer's live router vs the forced routes (docs/metrics.md)
                metrics[METRIC_PREFIX + "disagree_rows"].append(float(total.disagree_rows))
                metrics[METRIC_PREFIX + "forced_disagree_rows"].append(float(total.forced_disagree_rows))
                metrics[METRIC_PREFIX + "disagree_rate"].append(total.disagree_rows / total.compared_rows)
        else:
            metrics[METRIC_PREFIX + "old_pass_forced"].append(float(forced))
            if engine is not None:
                metrics[METRIC_PREFIX + "old_engine_disagreement"].append(engine)
        record = UpdateRecord(
            phase, step, total.replayed_rows, total.fallback_rows, total.recompute_calls, drift, engine, digest
        )
        self.records.append(record)
        return record

    def abandon_update(self) -> None:
        """Close an update context left open by an exception (no counts)."""
        stack = self._stack
        self._stack = self._recording = self._inputs = None
        self.phase = Phase.IDLE
        if stack is not None:
            stack.close()


__all__ = [
    "ENGINE_ROUTES_KEY",
    "IDS_KEY",
    "METRIC_PREFIX",
    "OLD_ROUTES_KEY",
    "Phase",
    "ReferenceRouting",
    "ReplaySettings",
    "RouterReplay",
    "RoutingCounts",
    "TrlRouting",
    "UpdateRecord",
    "check_rows",
    "compared",
    "routes_digest",
]
