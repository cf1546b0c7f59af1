"""R3 and R2 on SkyRL 0.4.0's FSDP policy worker: a subclass of SkyRL's own `FSDPPolicyWorkerBase`.

SkyRL 0.4.0 replays routed experts on its Megatron workers only (`replay_utils.py`); its FSDP worker ignores
the `rollout_expert_indices` the batch carries. This worker wraps the two seams every FSDP pass goes through
in routereplay's `attach(model)` contexts, on the HF model inside SkyRL's `HFModelWrapper`:

- `_forward_micro_batch` (the old-log-prob pass, `forward()` without a loss, no grad);
- `_forward_backward_micro` (each update micro-batch: the forward AND its backward run inside the context,
  so activation-checkpoint recomputation replays the same routes).

Modes, switched the way SkyRL switches its Megatron replay:
- `R3` when `trainer.policy.megatron_config.moe_enable_routing_replay=true` (SkyRL's own key; with
  `generator.inference_engine.enable_return_routed_experts=true`, as SkyRL requires for Megatron): every pass
  replays the batch's `rollout_expert_indices`;
- `R2` when the workers' environment has `ROUTEREPLAY_SKYRL_ROUTER_REPLAY=R2` (SkyRL has no R2 key): the
  forward pass records the trainer's own routing (`recorded_routes.py`), every update replays it; rollout
  routes on the batch are refused under R2 (they would silently turn it into R3). One recording spans every
  `forward` call between two updates: SkyRL's default `trainer.recompute_old_logprobs_per_minibatch=true` runs
  the old-log-prob pass once per policy mini-batch (`trainer._execute_forward_pass`), all of them before the
  first `forward_backward`, so the first forward after an update starts a new recording and the following
  ones add to it;
- otherwise (`disabled`): exactly SkyRL's worker.

Routes are read by `packed_routes.routes_of_packed` (geometry, `cu_seqlens`, dtype vs E, ids, duplicates, all
checked before anything is allocated for the model; under R3 the whole batch is first checked against its
digest column, which routereplay's trainer adds: `token_check.py`, refused without it unless this worker opted
out, then counted), laid out as SkyRL's wrapper lays the micro-batch out
(`micro_batch.py`: packed `remove_microbatch_padding`, padded, Ulysses SP), and every forward checks that SkyRL
fed the model the tokens the routes were placed for. A position with no captured route (`router_padding_mask`:
the final sampled token, a synthetic EOS, tool tokens no later turn evaluated, SkyRL's padding micro-batch) is
-1: the live router picks it, counted in `Replayer.stats.fallback_rows`; SkyRL's Megatron path forces dummy
experts 0..K-1 there instead and masks them out of router accounting only.

Turning it on: `python -m routereplay.integrations.skyrl.entrypoint` (`entrypoint.py`: SkyRL's config check,
relaxed for FSDP R3, and `install(cfg)` in the trainer's Ray task); in an entrypoint of your own, call
`entrypoint.validate(cfg)` in the driver and `install(cfg)` in the Ray task before `BasePPOExp(cfg).run()`.
Nothing here imports SkyRL until `policy_worker_class()` / `install()` run. Legend: B = sequences, S = padded
positions, M = MoE layers, K = top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from routereplay.errors import ConfigError, MissingDependencyError, MissingRoutesError
from routereplay.integrations.skyrl.digest import DIGEST_KEY
from routereplay.integrations.skyrl.micro_batch import ModelInputLayout, layout_of
from routereplay.integrations.skyrl.packed_routes import routes_of_packed
from routereplay.integrations.skyrl.recorded_routes import RecordedRoutes
from routereplay.integrations.skyrl.token_check import (
    METRIC_PREFIX,
    TokenCheckCounts,
    unchecked_opt_out,
    unchecked_refusal,
)
from routereplay.integrations.verl import RouteGeometry
from routereplay.runtime.stats import ReplayStats

MODE_ENV = "ROUTEREPLAY_SKYRL_ROUTER_REPLAY"
MEGATRON_KEY = "trainer.policy.megatron_config.moe_enable_routing_replay"
MODES = ("disabled", "R2", "R3")
FSDP_STRATEGIES = ("fsdp", "fsdp2")  # SkyRL's validate_cfg renames fsdp2 to fsdp
WORKER_NAME = "RouteReplayFSDPPolicyWorker"


def replay_mode(cfg: Any) -> str:
    """The worker's mode from SkyRL's trainer config (`MEGATRON_KEY` turns on R3) and `MODE_ENV` (R2 / R3 /
    disabled). R2 is this FSDP worker's alone: with a `cfg.strategy` other than FSDP (SkyRL's own Megatron worker,
    which has no R2) it is refused."""
    chosen = os.environ.get(MODE_ENV, "").strip()
    if chosen and chosen not in MODES:
        raise ConfigError(f"{MODE_ENV}={chosen!r}; use one of {list(MODES)}")
    strategy = getattr(cfg, "strategy", None)
    if chosen == "R2" and isinstance(strategy, str) and strategy not in FSDP_STRATEGIES:
        raise ConfigError(
            f"{MODE_ENV}=R2 with trainer.strategy={strategy}: R2 runs in routereplay's FSDP policy worker only, and "
            f"SkyRL's own {strategy} worker has no R2, so nothing would record or replay. Set trainer.strategy=fsdp, "
            f"or unset {MODE_ENV} (for replay on Megatron use SkyRL's R3: {MEGATRON_KEY}=true)"
        )
    megatron_config = getattr(getattr(cfg, "policy", None), "megatron_config", None)
    if bool(getattr(megatron_config, "moe_enable_routing_replay", False)):
        if chosen and chosen != "R3":
            raise ConfigError(
                f"{MEGATRON_KEY}=true asks for R3 (replay the rollout's routes) but {MODE_ENV}={chosen}; unset one: "
                f"R2 replays the trainer's own recorded routing and needs {MEGATRON_KEY}=false and "
                "generator.inference_engine.enable_return_routed_experts=false"
            )
        return "R3"
    return chosen or "disabled"


def r2_with_rollout_routes(where: str) -> str:
    return (
        f"{MODE_ENV}=R2 with the rollout's routes on the batch ({where}): R2 records the trainer's own routing in "
        "the forward pass and replays that in the updates, so rollout routes would silently turn it into R3. Fix: "
        "for R2 set generator.inference_engine.enable_return_routed_experts=false; to replay the rollout's routes "
        f"set {MEGATRON_KEY}=true and unset {MODE_ENV}"
    )


@dataclass(slots=True)
class WorkerRouting:
    """Per-worker replay state: the Replayer bound to the HF model, its geometry, R2's recordings (`recording`:
    the forward passes since the last update add to one recording), R3's token-check counts (`unchecked`: the
    current call's batch replays unchecked)."""

    replayer: Any = None
    module: nn.Module | None = None
    geometry: RouteGeometry | None = None
    recorded: RecordedRoutes = field(default_factory=RecordedRoutes)
    recording: bool = False
    counts: TokenCheckCounts = field(default_factory=TokenCheckCounts)
    unchecked: bool = False

    def bind(self, module: nn.Module) -> Any:
        """`routereplay.attach` the HF model once (again if SkyRL swapped it), its geometry checked."""
        if self.module is not module:
            import routereplay

            if self.replayer is not None:
                self.replayer.detach()
            self.replayer, self.module = routereplay.attach(module), module
            self.geometry = model_geometry(module, self.replayer)
            self.recorded = RecordedRoutes(num_experts=self.geometry.num_experts)
        return self.replayer

    def detach(self) -> None:
        """Unbind the routers (the HF model is exactly as SkyRL built it) and drop R2's recordings."""
        if self.replayer is not None:
            self.replayer.detach()
        self.replayer, self.module, self.geometry = None, None, None
        self.recorded.clear()


def model_geometry(module: nn.Module, replayer: Any) -> RouteGeometry:
    """The HF config's routed geometry (every hidden layer on the wire, its MoE layers), which must be the one
    the replayer bound, its route columns in the same (ascending) layer order: the rows SkyRL carries are checked
    against it and replayed column for column."""
    config = getattr(module, "config", None)
    geometry = RouteGeometry.from_hf_config(getattr(config, "text_config", None) or config)
    bound = (int(replayer.num_experts), int(replayer.top_k), tuple(replayer.layers))  # column order as replayed
    if bound != (geometry.num_experts, geometry.top_k, geometry.moe_layers):
        raise ConfigError(
            f"the model's config names experts/top-k/MoE layers {geometry.num_experts}/{geometry.top_k}/"
            f"{list(geometry.moe_layers)} but routereplay bound {bound[0]}/{bound[1]}/{list(bound[2])}; the routers "
            "found are not the config's (a custom MoE block?): see `routereplay.attach(model).describe()`"
        )
    return geometry


class RouteReplayPolicyWorkerMixin:
    """The routereplay part of the worker, mixed in before SkyRL's `FSDPPolicyWorkerBase`.

    Reads only what SkyRL's worker sets up: `cfg`, `model` (its `HFModelWrapper`), `device_mesh`."""

    def routing(self) -> WorkerRouting:
        state = getattr(self, "_routereplay_routing", None)
        if state is None:
            state = WorkerRouting()
            self._routereplay_routing = state
        return state

    def router_replay_mode(self) -> str:
        return replay_mode(getattr(self, "cfg", None))

    def routereplay_stats(self) -> dict[str, Any]:
        """The replayer's counters (`ReplayStats`: replayed rows, live -1 rows per layer, recomputations) and the mode;
        a plain dict, so a Ray caller can read them (`worker.routereplay_stats.remote()`)."""
        state = self.routing()
        counts = dataclasses.asdict(state.replayer.stats) if state.replayer is not None else {}
        checks = dataclasses.asdict(state.counts)
        return {"mode": self.router_replay_mode(), "recorded_samples": len(state.recorded), **checks, **counts}

    def hf_model(self) -> nn.Module:
        wrapper = self.model  # type: ignore[attr-defined]
        return getattr(wrapper, "model", wrapper)

    def forward(self, data: Any, loss_fn: Any = None, **kwargs: Any) -> Any:
        """SkyRL's forward; under R2 the old-log-prob pass (no `loss_fn`) records, the first forward after an update
        starting a new recording (one per train batch, however many mini-batches SkyRL forwards), shared over dp."""
        mode = self.router_replay_mode()
        recording = loss_fn is None and mode == "R2"
        if loss_fn is None:
            self.check_batch(data, mode, "forward")
        state = self.routing()
        if recording and not state.recording:
            state.recorded.clear()
            state.recording = True
        out = super().forward(data, loss_fn=loss_fn, **kwargs)  # type: ignore[misc]
        if recording:
            mesh = getattr(self, "device_mesh", None)
            state.recorded.share(mesh.get_group("dp") if mesh is not None else None)
        return out

    def forward_backward(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """SkyRL's forward_backward, the whole batch's routes checked before its first micro-batch runs; the next
        old-log-prob pass starts a new R2 recording."""
        self.routing().recording = False
        self.check_batch(data, self.router_replay_mode(), "update")
        return super().forward_backward(data, *args, **kwargs)  # type: ignore[misc]

    def check_batch(self, data: Any, mode: str, where: str) -> None:
        """Refuse a batch whose routes contradict the mode or are bad (`routes_of_packed`'s checks), with batch-wide
        trajectory numbers, before any micro-batch runs the model (and before an update has half-stepped). Under R3
        the batch's rows are checked against its tokens with the digest column; without the column the batch is
        refused unless this worker opted out (`token_check.UNCHECKED_ENV`), then counted."""
        packed = data.get("rollout_expert_indices")
        if mode == "R2" and packed is not None:
            raise ConfigError(r2_with_rollout_routes(f"rollout_expert_indices in the {where} pass"))
        state = self.routing()
        state.unchecked = False
        if mode != "R3":
            return
        sequences = data["sequences"]
        digests = data.get(DIGEST_KEY)
        samples = int(sequences.shape[0])
        if digests is None and packed is not None and not unchecked_opt_out():
            raise unchecked_refusal(samples, where)
        padding_mask = data.get("router_padding_mask")
        self.rollout_routes(packed, sequences, data["attention_mask"], padding_mask, where, digests=digests)
        state.unchecked = digests is None
        state.counts.add(samples, checked=digests is not None, where=where)

    def _forward_micro_batch(self, micro_batch: Any) -> Any:
        mode = self.router_replay_mode()
        if mode == "disabled":
            return super()._forward_micro_batch(micro_batch)  # type: ignore[misc]
        packed = micro_batch.get("rollout_expert_indices")
        if mode == "R2" and packed is not None:
            raise ConfigError(r2_with_rollout_routes("rollout_expert_indices in the forward (old-log-prob) pass"))
        sequences, mask = micro_batch["sequences"], micro_batch["attention_mask"]
        routes = None
        if mode == "R3":
            routes = self.rollout_routes(packed, sequences, mask, micro_batch.get("router_padding_mask"), "forward")
        with self.routed(sequences, mask, routes) as (recording, layout):
            out = super()._forward_micro_batch(micro_batch)  # type: ignore[misc]
        if routes is None:  # R2: what the routers chose, kept per sample for the updates
            group = None
            if layout.sp_size > 1:
                from skyrl.backends.skyrl_train.distributed.ulysses.utils import get_ulysses_sequence_parallel_group

                group = get_ulysses_sequence_parallel_group()
            self.routing().recorded.remember(sequences, mask, layout.recorded(recording.routes, group))
        return out

    def _forward_backward_micro(self, experience: Any, microbatch_weight: float, **kwargs: Any) -> Any:
        mode = self.router_replay_mode()
        if mode == "disabled":
            return super()._forward_backward_micro(experience, microbatch_weight, **kwargs)  # type: ignore[misc]
        state = self.routing()
        before = state.replayer.stats.copy() if state.replayer is not None else ReplayStats()
        metrics = self._replayed_micro(experience, microbatch_weight, mode, **kwargs)
        unchecked = int(experience.sequences.shape[0]) if state.unchecked else 0
        metrics[METRIC_PREFIX + "unchecked_samples"] = float(unchecked)
        # this micro-batch's counts (its replay context has closed: device counts read), docs/metrics.md
        metrics.update(state.replayer.stats.since(before).as_metrics())
        return metrics

    def _replayed_micro(self, experience: Any, microbatch_weight: float, mode: str, **kwargs: Any) -> Any:
        """SkyRL's `_forward_backward_micro` under R3 (the rollout's routes) or R2 (this worker's recording)."""
        packed = experience.rollout_expert_indices
        sequences, mask = experience.sequences, experience.attention_mask
        if mode == "R3":
            routes = self.rollout_routes(packed, sequences, mask, experience.router_padding_mask, "update")
        else:
            if packed is not None:
                raise ConfigError(r2_with_rollout_routes("rollout_expert_indices in an update micro-batch"))
            self.routing().bind(self.hf_model())
            padding = bool((experience.metadata or {}).get("is_padding_batch", False))
            routes = self.routing().recorded.routes_for(sequences, mask, live=padding)
        with self.routed(sequences, mask, routes):
            return super()._forward_backward_micro(experience, microbatch_weight, **kwargs)  # type: ignore[misc]

    def rollout_routes(
        self, packed: Any, sequences: torch.Tensor, mask: torch.Tensor, padding_mask: Any, where: str,
        digests: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        """R3: the micro-batch's `rollout_expert_indices` as (B, S, M, K), -1 where no route was captured; with
        `digests` (the batch's digest column) each trajectory's rows checked against its tokens first."""
        if packed is None:
            raise MissingRoutesError(
                f"{MEGATRON_KEY}=true (R3): a micro-batch of the {where} pass has no rollout_expert_indices; set "
                "generator.inference_engine.enable_return_routed_experts=true so the rollout returns its routes"
            )
        state = self.routing()
        state.bind(self.hf_model())
        assert state.geometry is not None
        return routes_of_packed(
            packed, mask, geometry=state.geometry, router_padding_mask=padding_mask, sequences=sequences,
            digests=digests,
        ).to(torch.int64)  # fmt: skip

    @contextmanager
    def routed(
        self, sequences: torch.Tensor, mask: torch.Tensor, routes_BSMK: torch.Tensor | None
    ) -> Iterator[tuple[Any, ModelInputLayout]]:
        """Replay `routes_BSMK` (or record, when None) around one micro-batch's forward (and backward), laid out
        as SkyRL's wrapper lays it out; the HF model's input ids are checked against that layout at every call."""
        module = self.hf_model()
        replayer = self.routing().bind(module)
        layout = layout_of(self.model, mask)  # type: ignore[attr-defined]
        device = next(module.parameters()).device
        if routes_BSMK is None:
            context = replayer.record()
        else:
            placed = layout.place(routes_BSMK, fill=-1).to(device)
            # laid out by one ModelInputLayout with the mask, so the replayer's padding-side heuristic has nothing
            # to find and would refuse what R3 keeps on purpose (-1 on attended positions routes live)
            context = replayer.replay(placed, attention_mask=layout.replay_mask(device), check_alignment=False)

        def check(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = args[0] if args else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor):
                layout.check_tokens(sequences, ids)

        hook = module.register_forward_pre_hook(check, with_kwargs=True, prepend=True)  # before the replayer's
        try:
            with context as recording:
                yield recording, layout
        finally:
            hook.remove()


@functools.cache
def policy_worker_class() -> type:
    """SkyRL's `FSDPPolicyWorkerBase` with routereplay R3 / R2 (imports SkyRL)."""
    try:
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
    except ImportError as err:
        raise MissingDependencyError(
            f"the routereplay SkyRL worker subclasses SkyRL's FSDPPolicyWorkerBase, which did not import ({err}); "
            "install skyrl 0.4.x with its FSDP extra beside routereplay (make .venv-skyrl for the CPU test venv)"
        ) from err
    cls = type(
        WORKER_NAME,
        (RouteReplayPolicyWorkerMixin, FSDPPolicyWorkerBase),
        {"__doc__": "SkyRL's FSDP policy worker with routereplay R3 / R2 (routereplay.integrations.skyrl)."},
    )
    return cls


def install(cfg: Any = None) -> type:
    """Make SkyRL's FSDP entrypoint build this worker: rebinds `PolicyWorker` in SkyRL's `fsdp_worker` module
    (which `main_base._setup_trainer` imports when it builds the models) to the Ray actor of this class, with
    SkyRL's own actor options. Call it in the process that builds the trainer; idempotent. Returns the class.

    `MODE_ENV` is checked here (and against `cfg`'s `MEGATRON_KEY` when SkyRL's config is passed), not first at
    the workers' first forward; `entrypoint.validate` checks it in the driver too."""
    replay_mode(getattr(cfg, "trainer", cfg))
    import ray
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    cls = policy_worker_class()
    if getattr(fsdp_worker.PolicyWorker, "_routereplay", False):
        return cls
    actor: Any = ray.remote(num_gpus=1)(cls)
    actor._routereplay = True
    fsdp_worker.PolicyWorker = actor
    return cls


__all__ = [
    "FSDP_STRATEGIES",
    "MODE_ENV",
    "RouteReplayPolicyWorkerMixin",
    "install",
    "policy_worker_class",
    "replay_mode",
]
