"""verl's SGLang server with routereplay's route decoding: R3 on SGLang 0.5.23 without verl's broken route code.

`RouteReplaySGLangHttpServer` is verl 0.9.1's own `SGLangHttpServer` (launch, sleep / wake-up, weight sync,
`generate`: all verl's) with one change where the routes leave SGLang (`tokenizer_routes`):

- `launch_server` runs verl's (which starts SGLang with `--enable-return-routed-experts` when verl's
  `rollout.enable_rollout_routing_replay` is on); then, with R3 on, it keeps verl's rollout config on this server
  with `enable_rollout_routing_replay=False` (verl's branch that imports SGLang 0.5.12's
  `routed_experts_capturer` or calls `.numpy()` on 0.5.23's base64 str never runs) and wraps SGLang's
  tokenizer manager in `RouteRequestingTokenizerManager` (each request asks `return_routed_experts`);
- `generate` runs verl's, then decodes the call's routes from SGLang's own output with `routed_experts_array`
  (`decode_sglang`: any SGLang form, rows / layers / top-k / ids checked) into `TokenOutput.routed_experts`:
  int32 (prompt + output - 1, num_hidden_layers, top_k), -1 in dense layers. A call whose output has no routes,
  or whose token ids verl emptied (its logprob-count fallback), gets `routed_experts=None`, counted in
  `route_stats` and logged; routes that do not fit the model raise routereplay's named errors.

verl's agent loops (routereplay's checked `single_turn_agent` / `tool_agent`, or verl's own) receive that array as
from SGLang 0.5.12 or vLLM. `RouteReplaySGLangReplica` is verl's `SGLangReplica` launching this server; verl's
`get_rollout_replica_class("sglang")` returns it once `tokenizer_routes.register_sglang_replica` ran (`fsdp_engine`
does, when verl's replica registry loads). Not covered: PD disaggregation (`rollout.disaggregation.enabled`: verl
imports its `SGLangPDReplica` directly, with verl's own server).

This module imports verl's SGLang server, hence SGLang.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from routereplay.integrations.verl.rollout import RouteGeometry
from routereplay.integrations.verl.tokenizer_routes import (
    RouteRequestingTokenizerManager,
    SGLangRouteStats,
    routed_experts_array,
)

logger = logging.getLogger("routereplay.integrations.verl")


class RouteReplaySGLangHttpServer(SGLangHttpServer):
    """verl's `SGLangHttpServer` whose `TokenOutput.routed_experts` routereplay decodes (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route_stats = SGLangRouteStats()
        self.route_geometry: RouteGeometry | None = None  # set by launch_server when R3 is on

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        await super().launch_server(*args, **kwargs)
        config: Any = self.config  # type: ignore[has-type]  # verl's RolloutConfig (its copy on this server)
        if not config.enable_rollout_routing_replay:
            return
        # the model's routed geometry, checked now rather than at the first rollout
        self.route_geometry = RouteGeometry.from_hf_config(self.model_config.hf_config)
        self.config = dataclasses.replace(config, enable_rollout_routing_replay=False)  # verl's route code off
        manager: Any = self.tokenizer_manager  # type: ignore[has-type]  # SGLang's, set by verl's launch_server
        self.tokenizer_manager = RouteRequestingTokenizerManager(manager)

    async def generate(
        self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args: Any, **kwargs: Any
    ) -> TokenOutput:
        if self.route_geometry is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        manager = self.tokenizer_manager
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            raw = manager.take(request_id)
        if raw is None:  # nothing went through this server's manager (a PD prefill's peer answered): verl's as is
            return output
        routes = routed_experts_array(raw, list(prompt_ids), self.route_geometry, request_id=request_id)
        if routes is None:
            self.route_stats.missing += 1
            logger.warning("routereplay: SGLang returned no routes for request %s; routed_experts=None", request_id)
        elif list(output.token_ids) != list(raw.get("output_ids") or []):
            routes = None
            self.route_stats.dropped += 1
            logger.warning(
                "routereplay: verl dropped request %s's token ids (logprob count mismatch); its routes name tokens "
                "the agent loop will not hold, routed_experts=None",
                request_id,
            )
        else:
            self.route_stats.decoded += 1
        output.routed_experts = routes
        return output

    async def get_route_stats(self) -> dict[str, int]:
        """This server's `SGLangRouteStats` (a Ray actor method: `server.get_route_stats.remote()`)."""
        return dataclasses.asdict(self.route_stats)


class RouteReplaySGLangReplica(SGLangReplica):
    """verl's `SGLangReplica`, launching `RouteReplaySGLangHttpServer`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(RouteReplaySGLangHttpServer)


__all__ = ["RouteReplaySGLangHttpServer", "RouteReplaySGLangReplica"]
