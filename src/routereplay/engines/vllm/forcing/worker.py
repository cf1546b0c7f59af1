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

from routereplay.engines.vllm.forced_routes import XARG_KEY, ForcedRoutes, ServedRouting
from routereplay.engines.vllm.forcing.router import LayerForcing, StepRows
from routereplay.errors import ForcedRoutesError

RUNNER_ATTR = "_routereplay_forcing"
LOG = logging.getLogger("routereplay.vllm.forcing")
_UNFORCED = object()  # a request seen without forced routes


@dataclass(slots=True)
class ForcingWorker:
    """Forced routes of the requests in one model runner, and the MoE layers they are forced in."""

    layers: dict[int, LayerForcing]
    served: ServedRouting
    model_id: int
    plans: dict[str, Any] = field(default_factory=dict)  # request id -> ForcedRoutes | _UNFORCED | ForcedRoutesError
    refused_requests: int = 0
    forced_requests: int = 0
    steps_forced: int = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_experts: int, top_k: int, num_layers: int) -> ForcingWorker:
        """Find the model's MoE runners, wrap their routers, and record the MoE layers they route."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        layers: dict[int, LayerForcing] = {}
        for module in model.modules():
            if isinstance(module, MoERunner):
                forcing = LayerForcing.of(int(module.layer_id), module.router)
                forcing.install()
                layers[forcing.layer] = forcing
        served = ServedRouting(int(num_experts), int(top_k), int(num_layers), tuple(sorted(layers)))
        return cls(layers, served, id(model))

    # --- requests --------------------------------------------------------------------------------

    def plan_of(self, request_id: str, state: Any) -> ForcedRoutes | None:
        """The request's checked forced routes (parsed on first sight), or None to route it live."""
        plan = self.plans.get(request_id)
        if plan is None:
            plan = self._parse(request_id, state)
            self.plans[request_id] = plan
        return plan if isinstance(plan, ForcedRoutes) else None

    def _parse(self, request_id: str, state: Any) -> Any:
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if XARG_KEY not in extra:
            return _UNFORCED
        prompt = getattr(state, "prompt_token_ids", None)
        try:
            plan = ForcedRoutes.parse(extra[XARG_KEY], self.served, prompt, where=f"vLLM request {request_id!r}")
        except ForcedRoutesError as error:
            self.refused_requests += 1
            LOG.error("%s (routed live)", error)
            return error
        self.forced_requests += 1
        return plan

    def forget_finished(self, live: Any) -> None:
        """Drop the plans of requests the runner no longer holds."""
        for request_id in [r for r in self.plans if r not in live]:
            del self.plans[request_id]

    # --- steps -----------------------------------------------------------------------------------

    def begin_step(self, runner: Any, positions: torch.Tensor | None) -> bool:
        """Set each layer's forced rows for the step the runner is about to run; False when none is forced."""
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if self.plans and len(self.plans) > 4 * max(num_reqs, 1) + 64:
            self.forget_finished(runner.requests)
        plans = []
        for index, request_id in enumerate(batch.req_ids[:num_reqs]):
            plan = self.plan_of(request_id, runner.requests.get(request_id))
            if plan is not None:
                plans.append((index, plan))
        if not plans or positions is None:
            return False
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        positions_N = positions.detach().to("cpu").numpy()
        rows: list[np.ndarray] = []
        experts: list[np.ndarray] = []
        for index, plan in plans:
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

    def end_step(self) -> None:
        """Clear the step's forced rows (also when the forward raised)."""
        for forcing in self.layers.values():
            forcing.step = None

    # --- counters --------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """What was forced so far: requests, refused requests, forced and live-fallback rows, steps."""
        return {
            "forced_requests": self.forced_requests,
            "refused_requests": self.refused_requests,
            "forced_rows": sum(f.forced_rows for f in self.layers.values()),
            "live_fallback_rows": sum(f.live_fallback_rows for f in self.layers.values()),
            "steps_forced": self.steps_forced,
        }


__all__ = ["RUNNER_ATTR", "ForcingWorker"]
