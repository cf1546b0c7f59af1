"""`RouterReplayGRPOTrainer`: TRL's `GRPOTrainer` with router replay (R2 / R3) for MoE policies.

    from routereplay.integrations.trl import RouterReplayGRPOTrainer
    trainer = RouterReplayGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                      train_dataset=dataset, processing_class=tokenizer, router_replay="R3")
    trainer.train()  # TRL's own logs gain router_replay/* metrics

`router_replay`:
- "R2": the old-log-prob pass records the trainer's routing, and every optimisation step replays it.
  TRL skips that pass when generation and optimisation steps line up and importance sampling is off
  (`grpo_trainer.py` l.2642-2657 in TRL 1.16.0); under R2 it is run here instead, and its log-probs
  become the batch's `old_per_token_logps`.
- "R3": the routes the completions were generated with replay in the old-log-prob pass and every
  optimisation step. Generation routes come from `model.generate` (`use_vllm=False`: its forwards are
  recorded on the trainer's own model, nothing replayed there) or from TRL's colocated vLLM
  (`vllm_mode="colocate"`, built with `enable_return_routed_experts`: `colocated.py`). Refused, with the
  reason: `vllm_mode="server"` (TRL's `VLLMClient.generate` keeps only ids and log-probs of the
  server's /v1/completions choices, `vllm_client.py` l.455-466, so routes a server started with
  `--enable-return-routed-experts` sends are dropped), TRL's continuous batching, tools / environments
  and `rollout_func` (their completions hold tokens no generation routed).
- None: TRL's natural routing, measured (drift, engine disagreement) but not changed.

`reference_routing` ("natural" or "replay") says how the reference model (`beta != 0`) routes; with
`beta != 0` and R2/R3 it must be given. Routes travel in TRL's batch dict (`state.py`), so TRL's
shuffle and split (l.1542-1544) move them with their rows; the backward runs in
`transformers.Trainer.training_step` after `compute_loss`, so the update's context opens in
`compute_loss` and closes when `training_step` returns: backward and checkpoint recompute run inside.
Metrics go through TRL's `self._metrics[mode]`, summed over processes: `router_replay/replayed_rows`,
`fallback_rows`, `drift` (update vs old-log-prob pass), `engine_disagreement` (update vs generation, on
the rows it routed), `old_engine_disagreement`, `old_pass_forced`; `trainer.router_replay.records` keeps
one `UpdateRecord` per pass. Text-only batches; one Replayer per model (`routereplay.attach`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from routereplay.errors import (
    ConfigError,
    MissingRoutesError,
    RowCountError,
    UnsupportedByEngineError,
)
from routereplay.integrations.framework import Framework
from routereplay.integrations.trl.layout import engine_routes, generation_traces
from routereplay.integrations.trl.state import (
    ENGINE_ROUTES_KEY,
    IDS_KEY,
    OLD_ROUTES_KEY,
    Phase,
    ReplaySettings,
    RouterReplay,
    RoutingCounts,
    TrlRouting,
    routes_digest,
)
from routereplay.runtime import attach

INSTALL_HINT = "pip install 'routereplay[trl]'"
TESTED_TRL = "1.16"  # the private methods overridden here are those of TRL 1.16


TRL = Framework(
    module="trl",
    label="TRL",
    oldest=(1, 16),
    needed_by="routereplay.integrations.trl",
    requirement=f"overrides GRPOTrainer methods of TRL {TESTED_TRL}",
    install_hint=INSTALL_HINT,
)


def import_trl() -> Any:
    """`trl`, or `MissingDependencyError` naming the extra; refuses a TRL older than the one tested."""
    trl, version = TRL.imported()
    if not version.startswith(TESTED_TRL + "."):
        warnings.warn(
            f"routereplay.integrations.trl is tested with TRL {TESTED_TRL}.x and trl {version} is installed; the "
            "GRPOTrainer internals it overrides may have changed",
            stacklevel=2,
        )
    return trl


_trl = import_trl()
from trl import GRPOTrainer  # noqa: E402 - after the check above
from trl.models.utils import disable_gradient_checkpointing  # noqa: E402

from routereplay.integrations.trl.colocated import RoutedVLLMGeneration, routed_vllm_generation  # noqa: E402

MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes")


class RouterReplayGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with `router_replay` = "R2" | "R3" | None; see the module docstring."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *positional: Any,
        router_replay: str | None,
        reference_routing: str | None = None,
        **kwargs: Any,
    ) -> None:
        settings = ReplaySettings.of(router_replay, reference_routing)
        colocate = args is not None and bool(args.use_vllm) and args.vllm_mode == "colocate"
        if args is not None and args.use_vllm and not colocate and settings.router_replay is RouterReplay.R3:
            raise UnsupportedByEngineError(
                f"router_replay='R3' with vllm_mode={args.vllm_mode!r}: TRL's VLLMClient keeps only the token ids and "
                "log-probs of the server's /v1/completions choices, so no routes reach the trainer; use "
                "vllm_mode='colocate' (this trainer builds vLLM with enable_return_routed_experts) or use_vllm=False, "
                "or router_replay='R2'"
            )
        if colocate:  # TRL's own VLLMGeneration (l.1105) builds its LLM without routes: build ours instead
            args.use_vllm = False
        try:
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        finally:
            if colocate:
                args.use_vllm = True
        if colocate:
            self.use_vllm = True
            self.vllm_generation = routed_vllm_generation(self)
            self._last_loaded_step = -1
        self._refuse(settings)
        replayer = attach(self.accelerator.unwrap_model(self.model))
        reference = None
        if settings.reference_routing is not None and settings.router_replay is not None and self.ref_model is not None:
            if settings.reference_routing.value == "replay":
                reference = attach(self.accelerator.unwrap_model(self.ref_model))
        self.router_replay = TrlRouting(settings, replayer, reference)

    @property
    def policy(self) -> Any:
        """The policy model, untyped (TRL annotates `self.model` as Optional)."""
        return self.model

    @property
    def grpo_args(self) -> Any:
        """`self.args`, a GRPOConfig (TRL annotates it as TrainingArguments)."""
        return self.args

    def _refuse(self, settings: ReplaySettings) -> None:
        if settings.router_replay is RouterReplay.R3:
            what = [
                name
                for name, used in (
                    ("tools / environment_factory", bool(self.tools)),
                    ("rollout_func", self.rollout_func is not None),
                    ("use_transformers_continuous_batching", self.use_transformers_continuous_batching),
                )
                if used
            ]
            if what:
                raise UnsupportedByEngineError(
                    f"router_replay='R3' with {', '.join(what)}: those completions hold tokens no model.generate or "
                    "vLLM call routed (tool results, custom rollouts) or come from a paged batch whose forwards "
                    "cannot be recorded; use router_replay='R2', which records the trainer's own routing"
                )
        if self.beta != 0.0 and settings.router_replay is not None and settings.reference_routing is None:
            raise ConfigError(
                f"beta={self.beta} with router_replay={settings.router_replay.value!r}: say how the reference model "
                "routes, reference_routing='natural' (on its own: the KL term then also measures routing drift) or "
                "'replay' (the same routes as the policy)"
            )
        if self.beta == 0.0 and settings.reference_routing is not None:
            warnings.warn(
                f"reference_routing={settings.reference_routing.value!r} has no effect with beta=0.0 (TRL loads no "
                "reference model)",
                stacklevel=3,
            )

    # -- generation -------------------------------------------------------------------------------
    def _generate_single_turn(
        self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int, has_tool_images: bool = False
    ) -> Any:
        """TRL's generation; the routes each completion was generated with are kept for scoring."""
        state = self.router_replay
        generate = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm:
            result = super()._generate_single_turn(*generate)
            generation = self.vllm_generation
            state.engine_traces = generation.take_traces() if isinstance(generation, RoutedVLLMGeneration) else None
            return result
        if self.use_transformers_continuous_batching or self.tools:
            state.engine_traces = None
            return super()._generate_single_turn(*generate)
        with state.replayer.record() as recording:  # the trainer's own model generates: record, never replay
            result = super()._generate_single_turn(*generate)
        try:
            state.engine_traces = generation_traces(
                recording.steps,
                prompt_ids,
                result[0],
                layers=state.replayer.layers,
                num_experts=state.replayer.num_experts,
                policy_version=self.state.global_step,
                slots=state.replayer.slot_names,
            )
        except (MissingRoutesError, RowCountError) as exc:
            if state.mode is RouterReplay.R3:
                raise
            warnings.warn(f"no engine-vs-trainer metrics for this batch: {exc}", stacklevel=2)
            state.engine_traces = None
        return result

    # -- scoring: the old-log-prob and reference passes -------------------------------------------
    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        state, args = self.router_replay, self.grpo_args
        generate_every = args.steps_per_generation * self.num_iterations  # TRL's condition, l.2642-2645
        trl_old_pass = args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )
        state.begin_score(trl_old_pass)
        try:
            output: dict[str, Any] = super()._generate_and_score_completions(inputs)
            ids_BS = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            mask_BS = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            completion_width = int(output["completion_ids"].size(1))
            self._lay_out_engine_routes(ids_BS, mask_BS, completion_width)
            forced = state.old_routes_BSLK is None or state.forced_logps is not None
            if state.old_routes_BSLK is None:  # TRL skipped its old-log-prob pass: R2 needs it, drift is measured by it
                self._forced_old_pass(ids_BS, mask_BS, completion_width)
            if state.mode is RouterReplay.R2 and state.forced_logps is not None:
                output["old_per_token_logps"] = state.forced_logps
            assert state.old_routes_BSLK is not None
            output[OLD_ROUTES_KEY] = state.old_routes_BSLK
            output[IDS_KEY] = ids_BS
            if state.engine_routes_BSLK is not None:
                output[ENGINE_ROUTES_KEY] = state.engine_routes_BSLK
            digest = routes_digest(state.old_routes_BSLK, mask_BS)
            self._log_routing("old", state.old_counts, digest, forced=forced)
        finally:
            state.end_score()
        return output

    def _lay_out_engine_routes(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor, completion_width: int) -> None:
        state = self.router_replay
        if state.engine_routes_BSLK is None and state.engine_traces is not None:
            state.engine_routes_BSLK = engine_routes(
                state.engine_traces,
                ids_BS,
                mask_BS,
                completion_width,
                layers=state.replayer.layers,
                top_k=state.replayer.top_k,
                slots=state.replayer.slot_names,
            )

    def _forced_old_pass(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor, completion_width: int) -> None:
        """The old-log-prob pass TRL skipped, as TRL runs it (no grad, checkpointing off, chunked)."""
        model, args = self.policy, self.grpo_args
        size = args.per_device_train_batch_size if model.training else args.per_device_eval_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs):
            logps, _, _ = self._old_pass(model, ids_BS, mask_BS, completion_width, size, False, False)
        self.router_replay.forced_logps = logps

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        state = self.router_replay
        if state.phase is not Phase.SCORE:  # the update: its context is already open (compute_loss)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra
            )
        given = sorted(name for name, value in extra.items() if value is not None and name in MULTIMODAL)
        if given:
            raise ConfigError(
                f"RouterReplayGRPOTrainer scores text-only batches; this one carries {given}: vision inputs add "
                "positions whose routes neither engine returns here. Train a text-only dataset, or use GRPOTrainer"
            )
        self._lay_out_engine_routes(input_ids, attention_mask, logits_to_keep)
        policy = model is self.model or model is self.model_wrapped
        if policy and state.trl_old_pass and state.old_routes_BSLK is None:
            return self._old_pass(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
        if state.old_routes_BSLK is None and state.mode is RouterReplay.R2:
            self._forced_old_pass(input_ids, attention_mask, logits_to_keep)  # the reference replays its routes
        replayer = state.replayer if policy else state.reference  # the policy: a PEFT adapter switched off
        size = batch_size or input_ids.size(0)
        parts = []
        for start in range(0, input_ids.size(0), size):
            rows = slice(start, start + size)
            with state.reference_routing(replayer, rows, attention_mask[rows]):
                parts.append(
                    super()._get_per_token_logps_and_entropies(
                        model, input_ids[rows], attention_mask[rows], logits_to_keep, None, compute_entropy, False
                    )
                )
        return _joined(parts)

    def _old_pass(
        self,
        model: Any,
        ids_BS: torch.Tensor,
        mask_BS: torch.Tensor,
        completion_width: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The old-log-prob pass, chunk by chunk, each in its own context: recorded (R2, off) or R3-replayed."""
        state = self.router_replay
        state.replayer.stats.reset()
        size = batch_size or ids_BS.size(0)
        parts, used = [], []
        for start in range(0, ids_BS.size(0), size):
            rows = slice(start, start + size)
            with state.old_pass_routing(rows, mask_BS[rows]) as recording:
                parts.append(
                    super()._get_per_token_logps_and_entropies(
                        model, ids_BS[rows], mask_BS[rows], completion_width, None, compute_entropy, compute_aux_loss
                    )
                )
            used.append(recording.routes)
        state.note_old_pass(torch.cat(used), mask_BS)
        return _joined(parts)

    # -- the optimisation step --------------------------------------------------------------------
    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss; in `training_step` its forward opens the update's routing context (closed after backward)."""
        state = self.router_replay
        if state.in_training_step and self.policy.training:
            state.open_update(inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        state = self.router_replay
        state.in_training_step = True
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            state.abandon_update()
            raise
        finally:
            state.in_training_step = False
        closed = state.close_update()
        if closed is not None:
            self._log_routing("update", *closed)
        return loss

    # -- metrics ----------------------------------------------------------------------------------
    def _log_routing(self, phase: str, counts: RoutingCounts, digest: str, *, forced: bool = False) -> None:
        """Sum `counts` over processes, log them in TRL's metrics and keep an `UpdateRecord`."""
        values = counts.as_tensor().to(self.accelerator.device)
        total = RoutingCounts.from_tensor(self.accelerator.gather(values).reshape(-1, values.numel()).sum(0))
        metrics = self._metrics["train" if self.policy.training else "eval"]
        self.router_replay.log(phase, total, digest, metrics, step=self.state.global_step, forced=forced)


def _joined(
    parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Chunks of `_get_per_token_logps_and_entropies` put back together as TRL does (l.1505-1508)."""
    logps = torch.cat([p[0] for p in parts])
    entropies = None if parts[0][1] is None else torch.cat([p[1] for p in parts if p[1] is not None])
    aux = None if parts[0][2] is None else torch.stack([p[2] for p in parts if p[2] is not None]).mean()
    return logps, entropies, aux


__all__ = ["INSTALL_HINT", "RouterReplayGRPOTrainer", "import_trl"]
