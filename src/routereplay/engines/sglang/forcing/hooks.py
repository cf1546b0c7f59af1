"""The SGLang hooks that force routes: one `SGLangForcing` per process holds the state, its methods are the hooks.

`install(registry)` registers them on SGLang 0.5.23's `HookRegistry` (the plugin's `load_plugins()` applies them in
every scheduler process and in the front end before anything is built):

- `TokenizerManager._create_tokenized_object` (AFTER, front end): a request's blob checked against the served
  model and prompt (`ForcedRoutesError`, a `ValueError`: HTTP 400 from SGLang's server); server set-ups that
  cannot force refused per request (`server_problems`); the cache salt set.
- `ModelRunner.__init__` (AFTER, start-up): every MoE layer's `TopKConfig` read (`rule_of`); layers that cannot
  be forced recorded by name (`layer_refusals`).
- `Scheduler._add_request_to_queue` (BEFORE): the blob checked again (own the bytes) and kept on the `Req`; a
  refusal aborts the request by name (`Req.set_finish_with_abort`, HTTP 400).
- `ForwardBatch.init_new` (AFTER, each forward): rows mapped to (request, position) from the `ScheduleBatch`
  host fields; forced ids + mask built once (`row_map.ForcedBatch`) and kept on the `ForwardBatch`.
- `ModelRunner.forward` (AROUND): the forward's `ForcedBatch` is current while it runs (cleared after, also
  when it raises).
- `topk._post_process_topk_ids` (BEFORE): forced rows substituted (`force_topk`, the vLLM plugin's op) before
  SGLang's routed-experts capture and the EPLB remap.
- `PrefillCudaGraphRunner.can_run_graph` (AFTER): False for a forward with forced rows (it runs eagerly, so the
  hook sees it).

A retracted request's re-prefill is forced with its sampling-time rows (the retraction hooks' `sampling_rows`,
over its own forced rows) when it asks (`custom_params[REPREFILL_KEY]`) or the server says so (`REPREFILL_ENV`), so
the KV it rebuilds is the KV its sampled tokens saw; off by default. Decided when the request is queued; the
merged `ForcedRoutes` is built once per retraction (`_plan_of`).

Inert for requests without `custom_params[CUSTOM_KEY]` (or a re-prefill to force): the top-k hook returns at once
when no forward is current.
What the request gets back is SGLang's own capture (`return_routed_experts`), taken after the substitution: the
forced experts are what was dispatched. Decode CUDA graphs are untouched (forced rows are prompt rows, run in
extend forwards; a decode forward has no `ForcedBatch`).

Legend: N = token rows of the forward, E = experts, K = top-k.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from routereplay.engines.sglang.forcing.requests import (
    asked_routes,
    asks_reprefill,
    parse_request,
    request_salt,
    served_routing,
    server_reprefill,
)
from routereplay.engines.sglang.forcing.row_map import ForcedBatch, step_rows
from routereplay.engines.sglang.forcing.rule import TopKRule, rule_of
from routereplay.engines.vllm.forced_routes import ForcedRoutes, ServedRouting
from routereplay.engines.vllm.forcing.op import force_topk
from routereplay.errors import ForcedRoutesError

if TYPE_CHECKING:
    from routereplay.engines.sglang.retraction import SavedRows

logger = logging.getLogger(__name__)

SRT = "sglang.srt."
REQ_ATTR = "_routereplay_forced"  # the checked ForcedRoutes kept on an SGLang Req
BATCH_ATTR = "_routereplay_forced"  # the ForcedBatch kept on a ForwardBatch
REPREFILL_ATTR = "_routereplay_reprefill"  # on a Req: whether its re-prefill after a retraction is forced
REPREFILL_PLAN_ATTR = "_routereplay_reprefill_plan"  # on a Req: (the kept SavedRows, the ForcedRoutes built from them)
TOPK_ARGS = (  # `_post_process_topk_ids`' parameters, in order (select_experts passes them by name)
    "topk_ids",
    "topk_weights",
    "topk_config",
    "router_logits",
    "layer_id",
    "num_token_non_padded",
    "expert_location_dispatch_info",
    "padded_rows_masked",
)
KERNEL_BACKENDS = ("triton_kernel", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_mxfp4")


@dataclass(slots=True)
class ForcingStats:
    """What the hooks did in this process (logged; read by tests)."""

    forwards_forced: int = 0
    rows_forced: int = 0  # (token, layer) rows substituted
    layers_unforced: int = 0  # top-k calls with forced rows that could not be forced (logged each time)
    requests_refused: int = 0
    reprefills_forced: int = 0  # retracted requests whose re-prefill is forced with their sampling-time rows
    reprefills_unforced: int = 0  # of those asking, kept rows that did not fit the model: re-prefilled live (logged)


@dataclass(slots=True)
class SGLangForcing:
    """The process's forcing state: served geometry, layers refused at start-up, the current forward; whether a
    retracted request's re-prefill is forced by default (`force_reprefill`, the server's `REPREFILL_ENV`) and
    where its kept sampling-time rows come from (`sampling_rows`: the retraction hooks' `sampling_rows`)."""

    served: ServedRouting | None = None
    refused_layers: dict[int, str] = field(default_factory=dict)
    refused_model: list[str] = field(default_factory=list)
    current: ForcedBatch | None = None
    stats: ForcingStats = field(default_factory=ForcingStats)
    force_reprefill: bool = False
    sampling_rows: Callable[[Any], SavedRows | None] | None = None

    # --- front end -------------------------------------------------------------------------------------
    def checked_tokenized(self, result: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER `TokenizerManager._create_tokenized_object`: refuse a bad request, salt a forced one."""
        custom = getattr(getattr(result, "sampling_params", None), "custom_params", None)
        value = asked_routes(custom)
        where = f"SGLang request {getattr(result, 'rid', None)!r}"
        asks = asks_reprefill(custom, False, where=where)  # only an explicit ask is refused by a server that cannot
        salt = request_salt(value, getattr(result, "cache_salt", None), where=where)
        if value is None and not asks:
            return
        problems = server_problems(manager.server_args)
        if problems:
            raise ForcedRoutesError(f"{where}: this SGLang server cannot force routes: {'; '.join(problems)}")
        if value is None:
            return
        served = self._served(manager.model_config)
        prompt = getattr(result, "input_ids", None)
        parse_request(value, served, None if prompt is None else list(prompt), where=where)
        result.cache_salt = salt

    # --- scheduler -------------------------------------------------------------------------------------
    def scanned_model(self, result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER `ModelRunner.__init__`: record the MoE layers whose top-k cannot be forced."""
        if getattr(runner, "is_draft_worker", False):
            return
        self.refused_layers.update(layer_refusals(runner.model))
        self.refused_model[:] = model_refusals(runner.model)
        if self.refused_layers or self.refused_model:
            logger.warning(
                "routereplay: routes cannot be forced here: %s", [*self.refused_model, str(self.refused_layers)]
            )

    def queued(self, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE `Scheduler._add_request_to_queue`: check a new request's blob and keep it on the Req; decide
        whether its re-prefill after a retraction is forced (its own ask, else the server's default)."""
        if getattr(req, "to_finish", None) is not None or hasattr(req, REPREFILL_ATTR):
            return  # aborted, or seen already (a re-queued request keeps what was checked)
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        value = asked_routes(custom)
        where = f"SGLang request {req.rid!r}"
        try:
            asks = asks_reprefill(custom, False, where=where)
            reprefill = asks_reprefill(custom, self.force_reprefill, where=where)
            if value is None and not reprefill:
                return
            problems = (
                server_problems(scheduler.server_args)
                + self.refused_model
                + [f"layer {layer}: {why}" for layer, why in sorted(self.refused_layers.items())]
            )
            if problems and value is None and not asks:
                logger.warning("routereplay: %s re-prefills live after a retraction: %s", where, "; ".join(problems))
                return  # the server's default, on a server that cannot force: nothing asked explicitly
            if problems:
                raise ForcedRoutesError(f"{where}: this SGLang server cannot force routes: {'; '.join(problems)}")
            served = self._served(scheduler.model_config)
            if value is not None:
                setattr(req, REQ_ATTR, parse_request(value, served, list(req.origin_input_ids), where=where))
            setattr(req, REPREFILL_ATTR, reprefill)
        except ForcedRoutesError as error:
            self.stats.requests_refused += 1
            req.set_finish_with_abort(str(error))

    def mapped_batch(self, result: Any, cls: Any, batch: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER `ForwardBatch.init_new`: the forward's forced rows, kept on the ForwardBatch it returned."""
        mode = batch.forward_mode
        if self.served is None or mode.is_decode_or_idle():
            return  # decode rows are new tokens: never forced (a blob covers prompt rows only)
        reqs = list(getattr(batch, "reqs", None) or ())
        routes: list[ForcedRoutes | None] = [self._plan_of(req) for req in reqs]
        if not any(plan is not None for plan in routes):
            return
        try:
            rows = step_rows(mode, len(reqs), batch.prefix_lens, batch.extend_lens, batch.seq_lens_cpu)
        except ForcedRoutesError as error:
            logger.error("routereplay: forced requests route live in this forward: %s", error)
            return
        if rows is None:
            logger.error(
                "routereplay: a %s forward holds forced requests %s; its rows are not mapped, they route live",
                getattr(mode, "name", mode),
                [req.rid for req, plan in zip(reqs, routes, strict=True) if plan is not None],
            )
            return
        forced = ForcedBatch.build(
            rows, routes, [req.rid for req in reqs], self.served.moe_layers, self.served.top_k, model_runner.device
        )
        setattr(result, BATCH_ATTR, forced)

    def around_forward(self, original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND `ModelRunner.forward`: the forward's ForcedBatch is current while it runs."""
        forced = getattr(forward_batch, BATCH_ATTR, None)
        if forced is None:
            return original(runner, forward_batch, *args, **kwargs)
        previous, self.current = self.current, forced
        try:
            result = original(runner, forward_batch, *args, **kwargs)
        finally:
            self.current = previous
        self.stats.forwards_forced += 1
        self.stats.rows_forced += forced.forced_rows
        return result

    def no_graph_when_forced(self, result: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """AFTER `PrefillCudaGraphRunner.can_run_graph`: a forward with forced rows runs eagerly."""
        return False if getattr(forward_batch, BATCH_ATTR, None) is not None else None

    def forced_topk(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """BEFORE `topk._post_process_topk_ids`: substitute the current forward's forced rows of this layer."""
        forced = self.current
        if forced is None:
            return None
        call = dict(zip(TOPK_ARGS, args, strict=False)) | kwargs
        ids_NK: torch.Tensor = call["topk_ids"]
        layer_id = call.get("layer_id")
        if layer_id is None or not call["topk_config"].allow_routed_experts_capture:
            return None  # a draft / MTP block: not one of the served model's MoE layers
        columns = forced.layer(int(layer_id))
        if columns is None:
            return None
        forced_NK, mask_N = columns
        rule, why = self._rule(call["topk_config"])
        if rule is None or ids_NK.shape[0] != forced.num_rows or ids_NK.shape[-1] != forced_NK.shape[-1]:
            self.stats.layers_unforced += 1
            logger.error(
                "routereplay: layer %s could not be forced for requests %s (%s); its rows route live",
                layer_id,
                list(forced.requests),
                why or f"{ids_NK.shape[0]} x {ids_NK.shape[-1]} top-k rows, {forced.num_rows} mapped",
            )
            return None
        weights_NK, ids_NK = force_topk(call["topk_weights"], ids_NK, call["router_logits"], forced_NK, mask_N, rule)
        call["topk_ids"], call["topk_weights"] = ids_NK, weights_NK
        return (), call

    def _plan_of(self, req: Any) -> ForcedRoutes | None:
        """What a request forces in this forward: its own checked routes and, for a retracted request whose
        re-prefill is forced, its kept sampling-time rows over them (built once per retraction)."""
        plan: ForcedRoutes | None = getattr(req, REQ_ATTR, None)
        if not getattr(req, REPREFILL_ATTR, False) or self.sampling_rows is None:
            return plan
        kept = self.sampling_rows(req)
        if kept is None:
            return plan
        cached = getattr(req, REPREFILL_PLAN_ATTR, None)
        if cached is not None and cached[0] is kept:
            return cached[1]
        merged = self._reprefill_plan(req, plan, kept)
        setattr(req, REPREFILL_PLAN_ATTR, (kept, merged))
        return merged

    def _reprefill_plan(self, req: Any, plan: ForcedRoutes | None, kept: SavedRows) -> ForcedRoutes | None:
        """The request's routes with its kept rows (positions `kept.start..kept.end - 1`, all decoder layers as
        SGLang's capturer holds them) written over them, MoE layers only; kept rows that do not fit the served
        model are not used (counted, logged)."""
        served = self.served
        assert served is not None  # set when the request was queued
        rows_NLK = kept.rows_NLK
        layers, top_k = served.moe_layers, served.top_k
        fits = rows_NLK.ndim == 3 and rows_NLK.shape[1] == served.num_layers and rows_NLK.shape[2] == top_k
        kept_NLK = rows_NLK[:, list(layers)].cpu().numpy().astype(np.int32) if fits else None
        if kept_NLK is not None:
            valid_NL = ((kept_NLK >= 0) & (kept_NLK < served.num_experts)).all(-1) | (kept_NLK == -1).all(-1)
            fits = bool(valid_NL.all())
        if kept_NLK is None or not fits:
            self.stats.reprefills_unforced += 1
            logger.error(
                "routereplay: request %s's kept rows (%s) do not fit the served model (%d layers, top-%d, E=%d); "
                "its re-prefill routes live",
                req.rid,
                tuple(rows_NLK.shape),
                served.num_layers,
                top_k,
                served.num_experts,
            )
            return plan
        lo, hi = kept.start, kept.end
        if plan is not None:
            lo, hi = min(lo, plan.start), max(hi, plan.stop)
        experts_TLK = np.full((hi - lo, len(layers), top_k), -1, dtype=np.int32)
        if plan is not None:
            experts_TLK[plan.start - lo : plan.stop - lo] = plan.experts_TLK
        experts_TLK[kept.start - lo : kept.end - lo] = kept_NLK
        self.stats.reprefills_forced += 1
        return ForcedRoutes(lo, experts_TLK, layers)

    def _rule(self, topk_config: Any) -> tuple[TopKRule | None, str]:
        return rule_of(topk_config, use_aiter=_sglang_uses_aiter())

    def _served(self, model_config: Any) -> ServedRouting:
        if self.served is None:
            self.served = served_routing(model_config.hf_text_config)
        return self.served


def server_problems(server_args: Any) -> list[str]:
    """The server set-ups under which the hooks cannot force (refused per request, by name)."""
    problems = []
    if getattr(server_args, "enable_dp_attention", False):
        problems.append("DP attention (--enable-dp-attention: the MoE sees the DP-gathered batch of all ranks)")
    if getattr(server_args, "speculative_algorithm", None):
        problems.append(f"speculative decoding ({server_args.speculative_algorithm}: verify rows are not mapped)")
    backend = str(getattr(server_args, "moe_a2a_backend", None) or "none")
    if backend != "none":
        problems.append(f"--moe-a2a-backend {backend} (tokens leave the rank before its top-k rows are mapped)")
    runner = str(getattr(server_args, "moe_runner_backend", None) or "auto")
    if runner in KERNEL_BACKENDS:
        problems.append(f"--moe-runner-backend {runner} (the MoE kernel routes itself)")
    if str(getattr(server_args, "device", None) or "") == "npu":
        problems.append("Ascend NPU (hardware_backend/npu/moe/topk.py routes and captures in a top-k of its own)")
    if getattr(server_args, "enable_two_batch_overlap", False) or getattr(
        server_args, "enable_single_batch_overlap", False
    ):
        problems.append("two/single-batch overlap (a forward is split into micro-batches the row map does not follow)")
    return problems


# SGLang 0.5.23 model files that capture routed experts at a site of their own, beside `_post_process_topk_ids`
# (research peers-2026-11-28.md 1a): the hook cannot vouch that what they capture is what it forced
OWN_CAPTURE_SITES: dict[str, str] = {
    "sglang.srt.models.llada2": "LLaDA2 (models/llada2.py captures its routes itself)",
    "sglang.srt.models.muse_spark": "Muse Spark (models/muse_spark.py captures its routes itself)",
    "sglang.srt.models.inkling_common.moe": "Inkling (models/inkling_common/moe.py captures its routes itself)",
}


def model_refusals(model: Any) -> list[str]:
    """The model's own route-capture sites (`OWN_CAPTURE_SITES`, by the module its layers' classes come from)."""
    found = {type(module).__module__ for module in model.modules()} & OWN_CAPTURE_SITES.keys()
    return [f"model {OWN_CAPTURE_SITES[name]}" for name in sorted(found)]


def layer_refusals(model: Any) -> dict[int, str]:
    """Each MoE layer (SGLang `TopK` module, by its `layer_id`) whose top-k cannot be forced, with the reason."""
    refused: dict[int, str] = {}
    uses_aiter = _sglang_uses_aiter()
    for module in model.modules():
        config = getattr(module, "topk_config", None)
        if config is None or not hasattr(module, "layer_id"):
            continue
        if not getattr(config, "allow_routed_experts_capture", True):
            continue  # draft blocks
        rule, why = rule_of(config, use_aiter=uses_aiter)
        if getattr(module, "enable_waterfill", False):
            rule, why = None, "Waterfill appends shared-expert columns after select_experts"
        if rule is None:
            refused[int(module.layer_id)] = why
    return refused


def _sglang_uses_aiter() -> bool:
    from sglang.srt.layers.moe import topk

    return bool(getattr(topk, "_use_aiter", False))


def install(
    registry: Any,
    forcing: SGLangForcing | None = None,
    *,
    sampling_rows: Callable[[Any], SavedRows | None] | None = None,
) -> SGLangForcing:
    """Register the forcing hooks on SGLang's `HookRegistry` (or anything with its `register(target, hook, kind)`);
    returns the state object whose methods they are. Call from the plugin's entry point, before `apply_hooks()`.

    A new state reads the server's re-prefill default from the environment (`REPREFILL_ENV`; a bad value is a
    `ForcedRoutesError` at start-up); `sampling_rows` (the retraction hooks') is where kept rows come from."""
    from sglang.srt.plugins.hook_registry import HookType

    state = forcing if forcing is not None else SGLangForcing(force_reprefill=server_reprefill(os.environ))
    if sampling_rows is not None:
        state.sampling_rows = sampling_rows
    hooks = (
        (
            "managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
            state.checked_tokenized,
            HookType.AFTER,
        ),
        ("model_executor.model_runner.ModelRunner.__init__", state.scanned_model, HookType.AFTER),
        ("managers.scheduler.Scheduler._add_request_to_queue", state.queued, HookType.BEFORE),
        ("model_executor.forward_batch_info.ForwardBatch.init_new", state.mapped_batch, HookType.AFTER),
        ("model_executor.model_runner.ModelRunner.forward", state.around_forward, HookType.AROUND),
        ("layers.moe.topk._post_process_topk_ids", state.forced_topk, HookType.BEFORE),
        (
            "model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
            state.no_graph_when_forced,
            HookType.AFTER,
        ),
    )
    for target, hook, kind in hooks:
        registry.register(SRT + target, hook, kind)
    return state


__all__ = [
    "BATCH_ATTR",
    "REPREFILL_ATTR",
    "REPREFILL_PLAN_ATTR",
    "REQ_ATTR",
    "ForcingStats",
    "SGLangForcing",
    "install",
    "layer_refusals",
    "model_refusals",
    "server_problems",
]
