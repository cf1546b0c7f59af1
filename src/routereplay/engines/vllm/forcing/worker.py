"""The worker side of route forcing: which token rows of each engine step are forced, to which experts.

One `ForcingWorker` lives on each vLLM model runner (attribute `RUNNER_ATTR`), made by the plugin's
`_model_forward` wrapper on the first step. Each step, before the model runs, `begin_step` reads
the runner's persistent batch: its requests in batch order (`input_batch.req_ids`), where each
request's tokens sit in the flattened step (`query_start_loc`) and every token's position (the
`positions` the model is called with). A request that carries forced routes
(`extra_args[XARG_KEY]`) has them parsed and checked once, on first sight (`ForcedRoutes.parse`:
the same checks as the front end, now against the loaded model's own routers), and kept until the
request leaves the runner. Its tokens whose position the trace covers with a routed row are forced;
every other row routes live. Keying by (request, position) is what keeps chunked prefill, batches
mixing forced and unforced requests, and preemption followed by recompute right: whatever tokens a
step schedules, each finds its own row.

Nothing here runs for a step without forced requests but one dictionary lookup per request; the
routers are wrapped once (`forcing.router.LayerForcing`) and pass through when no row is forced.

Combine weights (`extra_args[WEIGHTS_KEY] = True`, forced or not): in a step where some request asks, every
wrapped router keeps the (weights, ids) it returned after forcing; once the forward has run, `keep_weights`
stores each asking request's rows, by position, in `weights` (`forcing.weights.WeightsStore`), and the
engine takes them after its call (`take_weights`); weights nobody takes (a server's requests) are dropped
once the request has left the runner, and all kept rows stay under a byte limit (`forcing.weights`: counted
in `weights_evicted` and `weights_over_limit`). A step where no request asks keeps nothing. The weights
kept are the model's combine weights as its HF definition has them: the router's, times the factor vLLM's
MoE runner scales the experts' output by where the model moves `routed_scaling_factor` from the weights to
the output (`output_scale`; DeepSeek-V2/V3 and GLM-4.5 in vLLM 0.30: their experts are called with
unscaled weights, then their output is scaled).

A request whose routes fail the worker's check (the front end passed it, so only a model whose MoE
layers its config does not describe) is not forced: the error is logged, counted in
`refused_requests`, and the request routes live; its client sees the capture differ from what it
asked and raises `ForcingNotAppliedError`. Nothing replays silently.

A request's checked rows stay in the trace's own dtype (int16 for E <= 32767, a quarter of int64) from
`ForcedRoutes.parse` through each step's `StepRows`; the router widens a step's forced ids to int64 only
for its gather.

Legend: N = token rows of one step, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from routereplay.engines.vllm.forced_routes import XARG_KEY, ForcedRoutes, ServedRouting, asks_weights
from routereplay.engines.vllm.forcing.router import LayerForcing, StepRows
from routereplay.engines.vllm.forcing.weights import RequestWeights, WeightsStore
from routereplay.errors import ForcedRoutesError

RUNNER_ATTR = "_routereplay_forcing"
LOG = logging.getLogger("routereplay.vllm.forcing")


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the plugin does for one request: force its routes (None: route live), keep its combine weights."""

    routes: ForcedRoutes | None
    weights: bool


@dataclass(frozen=True, slots=True)
class AskingRows:
    """One request's rows [first, last) of a step, whose combine weights it asked for, and their positions."""

    request_id: str
    first: int
    last: int
    positions_n: np.ndarray


@dataclass(slots=True)
class ForcingWorker:
    """Forced routes of the requests in one model runner, and the MoE layers they are forced in."""

    layers: dict[int, LayerForcing]
    served: ServedRouting
    model_id: int
    plans: dict[str, RequestPlan] = field(default_factory=dict)  # request id -> what to do for it
    refused_requests: int = 0
    forced_requests: int = 0
    steps_forced: int = 0
    weights: WeightsStore = field(default_factory=WeightsStore)
    weights_requests: int = 0
    weights_rows: int = 0
    asking: list[AskingRows] = field(default_factory=list)  # this step's rows whose weights are kept
    # per MoE layer, the factor vLLM's MoE runner scales the experts' output by (its `routed_scaling_factor` when the
    # model applies that scale to the output instead of the weights: DeepSeek-V2/V3, GLM-4.5), else 1
    output_scale: dict[int, float] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_experts: int, top_k: int, num_layers: int) -> ForcingWorker:
        """Find the model's MoE runners, wrap their routers, and record the MoE layers they route."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        layers: dict[int, LayerForcing] = {}
        scale: dict[int, float] = {}
        for module in model.modules():
            if isinstance(module, MoERunner):
                forcing = LayerForcing.of(int(module.layer_id), module.router)
                forcing.install()
                layers[forcing.layer] = forcing
                scale[forcing.layer] = float(getattr(module, "routed_scaling_factor", 1.0) or 1.0)
        served = ServedRouting(int(num_experts), int(top_k), int(num_layers), tuple(sorted(layers)))
        return cls(layers, served, id(model), output_scale=scale)

    # --- requests --------------------------------------------------------------------------------

    def plan_of(self, request_id: str, state: Any) -> ForcedRoutes | None:
        """The request's checked forced routes (parsed on first sight), or None to route it live."""
        return self.request_plan(request_id, state).routes

    def request_plan(self, request_id: str, state: Any) -> RequestPlan:
        """What to do for the request (decided on first sight, kept while the runner holds it)."""
        plan = self.plans.get(request_id)
        if plan is None:
            plan = self._parse(request_id, state)
            self.plans[request_id] = plan
        return plan

    def _parse(self, request_id: str, state: Any) -> RequestPlan:
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        where = f"vLLM request {request_id!r}"
        try:
            weights = asks_weights(extra, where)
        except ForcedRoutesError as error:  # the front end refuses it; only a request that bypassed it lands here
            LOG.error("%s (no weights kept)", error)
            weights = False
        self.weights_requests += int(weights)
        if XARG_KEY not in extra:
            return RequestPlan(None, weights)
        prompt = getattr(state, "prompt_token_ids", None)
        try:
            routes = ForcedRoutes.parse(extra[XARG_KEY], self.served, prompt, where=where)
        except ForcedRoutesError as error:
            self.refused_requests += 1
            LOG.error("%s (routed live)", error)
            return RequestPlan(None, weights)
        self.forced_requests += 1
        return RequestPlan(routes, weights)

    def forget_finished(self, live: Any) -> None:
        """Drop the plans of requests the runner no longer holds."""
        for request_id in [r for r in self.plans if r not in live]:
            del self.plans[request_id]

    # --- steps -----------------------------------------------------------------------------------

    def begin_step(self, runner: Any, positions: torch.Tensor | None) -> bool:
        """Set each layer's forced rows for the step the runner is about to run, and whether its routers keep
        their weights; False when the step neither forces nor keeps anything."""
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if self.plans and len(self.plans) > 4 * max(num_reqs, 1) + 64:
            self.forget_finished(runner.requests)
        if self.weights.live:
            self.weights.retire(runner.requests)
        forced: list[tuple[int, ForcedRoutes]] = []
        asking: list[tuple[int, str]] = []
        for index, request_id in enumerate(batch.req_ids[:num_reqs]):
            plan = self.request_plan(request_id, runner.requests.get(request_id))
            if plan.routes is not None:
                forced.append((index, plan.routes))
            if plan.weights and self.weights.accepts(request_id):  # not once dropped over the byte limit
                asking.append((index, request_id))
        if not (forced or asking) or positions is None:
            return False
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        positions_N = positions.detach().to("cpu").numpy()
        self.asking = [
            AskingRows(request_id, starts[i], starts[i + 1], positions_N[starts[i] : starts[i + 1]].copy())
            for i, request_id in asking
            if starts[i + 1] > starts[i]
        ]
        for forcing in self.layers.values():
            forcing.keep = bool(self.asking)
        return self._force(forced, starts, positions_N) or bool(self.asking)

    def _force(self, forced: list[tuple[int, ForcedRoutes]], starts: list[int], positions_N: np.ndarray) -> bool:
        """Each layer's `StepRows` for the forced requests' rows of this step; False when none is forced."""
        rows: list[np.ndarray] = []
        experts: list[np.ndarray] = []
        for index, plan in forced:
            first, last = starts[index], starts[index + 1]
            if last <= first or positions_N[first] >= plan.stop or positions_N[last - 1] < plan.start:
                continue  # a decode step past the forced prefix (positions grow within a request's rows)
            inside_n, experts_nLK = plan.rows_at(positions_N[first:last])
            rows.append(np.arange(first, last)[inside_n])
            experts.append(experts_nLK)
        if not rows:
            return False
        rows_N = np.concatenate(rows)
        if rows_N.size == 0:
            return False
        experts_NLK = np.concatenate(experts)
        for column, layer in enumerate(self.served.moe_layers):
            routed_N = experts_NLK[:, column, 0] >= 0
            self.layers[layer].step = StepRows(
                torch.from_numpy(rows_N[routed_N]),
                torch.from_numpy(np.ascontiguousarray(experts_NLK[routed_N, column])),
            )
        self.steps_forced += 1
        return True

    def keep_weights(self) -> None:
        """After the step's forward: store the asking requests' rows of what every router returned (positions,
        ids and combine weights, MoE layers side by side). A layer that did not route this step keeps nothing."""
        if not self.asking:
            return
        kept = [self.layers[layer].kept for layer in self.served.moe_layers]
        if any(k is None for k in kept):
            missing = [layer for layer, k in zip(self.served.moe_layers, kept, strict=True) if k is None]
            LOG.error("routereplay: MoE layers %s did not route this step; no combine weights kept for it", missing)
            return
        rows = max(r.last for r in self.asking)  # one host copy of the step's rows up to the last asking one
        scale_L = [self.output_scale.get(layer, 1.0) for layer in self.served.moe_layers]
        weights_NLK = torch.stack([k[0][:rows].float() * s for k, s in zip(kept, scale_L, strict=True) if k], 1)
        ids_NLK = torch.stack([k[1][:rows] for k in kept if k is not None], dim=1).to(torch.int32)
        weights_host = weights_NLK.detach().cpu().numpy()
        ids_host = ids_NLK.cpu().numpy()
        for asked in self.asking:  # `keep` checks the byte limit before it copies the views
            span = slice(asked.first, asked.last)
            if self.weights.keep(asked.request_id, asked.positions_n, ids_host[span], weights_host[span]):
                self.weights_rows += asked.last - asked.first

    def end_step(self) -> None:
        """Clear the step's forced rows and kept weights (also when the forward raised)."""
        for forcing in self.layers.values():
            forcing.step = None
            forcing.keep = False
            forcing.kept = None
        self.asking = []

    def take_weights(self, request_ids: list[str]) -> dict[str, RequestWeights]:
        """Pop the kept combine weights of these requests (`WeightsStore.take`: by the runner's or the given id)."""
        return self.weights.take(request_ids)

    # --- counters --------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """What was forced so far: requests, refused requests, forced and live-fallback rows, steps."""
        return {
            "forced_requests": self.forced_requests,
            "refused_requests": self.refused_requests,
            "forced_rows": sum(f.forced_rows for f in self.layers.values()),
            "live_fallback_rows": sum(f.live_fallback_rows for f in self.layers.values()),
            "steps_forced": self.steps_forced,
            "weights_requests": self.weights_requests,
            "weights_rows": self.weights_rows,
            "weights_evicted": self.weights.evicted,
            "weights_over_limit": self.weights.over_limit,
            "weights_kept_bytes": self.weights.kept_bytes,
        }


__all__ = ["RUNNER_ATTR", "AskingRows", "ForcingWorker", "RequestPlan"]
