"""AReaL 1.0.4's own RLVR and multi-turn workflows, with the episode's routes added to the dict they return.

AReaL's `RLVRWorkflow.arun_episode` and `MultiTurnWorkflow.arun_episode` build `input_ids, loss_mask, logprobs,
versions, attention_mask, rewards` and drop the routes SGLang returned (`workflow/rlvr.py` l.163-178,
`workflow/multi_turn.py`). `RoutedRLVRWorkflow` and `RoutedMultiTurnWorkflow` are those classes: each episode
runs AReaL's own `arun_episode` on an `EpisodeEngine`, a per-episode view of the engine it was given whose
`agenerate` asks for the routes (`req.metadata["return_routed_experts"]`, what AReaL's
`rollout.return_routed_experts` sets) and adds each response to the episode's `EpisodeRoutes`. The returned dict
gets `ROUTES_KEY` `[1, S, M, K]` and `TOKENS_KEY` `[1, S]` (`columns.py`), aligned with its `input_ids`.

- The geometry (MoE layers, K, E) comes from the model's HF config: `route_geometry=` a `RouteGeometry`, an HF
  config, or the actor's model path (a string travels to AReaL's rollout workers in `workflow_kwargs`).
- The engine's backend is checked once per episode and, when it is AReaL's plain `SGLangBackend`, replaced by
  routereplay's (`backend.install`: each row kept once across a resumed request); a vLLM backend is refused
  by name. An engine with no AReaL backend inside (a user's proxy) is used as given: every response's row count
  is still checked.
- Nothing is shared between concurrent episodes: the recorder and its `EpisodeRoutes` live for one
  `arun_episode` call, and the backend pairs each pass per asyncio task (`backend.py`).
- A call that returns no routes raises `MissingRoutesError`; tokens that differ from what a call routed raise
  `TokenMismatchError` (`episode_routes.py`). A workflow that rejects the episode (returns None) returns None.

What a refusal does inside AReaL: called directly (`await workflow.arun_episode(engine, data)`), the episode raises
the routereplay error. Run by AReaL's `WorkflowExecutor` (`engine.submit` / `engine.wait`, what `rollout_batch` and
`prepare_batch` use), AReaL catches any exception of a workflow (`infra/workflow_executor.py` l.1143-1156), logs
`Workflow execution failed: <the routereplay error>` at ERROR with its traceback, counts it as `rollout/rejected`
and drops the episode: training goes on with fewer trajectories (`wait` hands back None in its place), so nothing
with wrong routes is trained on, but nothing stops either. So that it shows without reading the logs, every routed
episode records `REFUSED_METRIC` in AReaL's own `rollout` stats tracker (the one its `rollout/rejected` uses,
exported with the rollout's stats each step): 1 when routereplay refused it, 0 otherwise, so the exported
`rollout/router_replay/refused_rate` is the fraction of the step's routed episodes routereplay refused (and
AReaL dropped). A rate above 0 means the ERROR log names why.

This module imports AReaL. Legend: S tokens of the episode, M MoE layers, K top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from areal.api import ModelRequest, ModelResponse
from areal.utils import stats_tracker
from areal.workflow.multi_turn import MultiTurnWorkflow
from areal.workflow.rlvr import RLVRWorkflow

from routereplay.errors import BatchFieldError, RouteReplayError
from routereplay.integrations.areal import episode_routes
from routereplay.integrations.areal.backend import inner_engine, install
from routereplay.integrations.areal.episode_routes import EpisodeRoutes
from routereplay.integrations.verl.rollout import RouteGeometry

REFUSED_METRIC = "router_replay/refused_rate"  # in AReaL's "rollout" tracker: rollout/router_replay/refused_rate


class EpisodeEngine:
    """One episode's view of AReaL's inference engine: `agenerate` with routes, recorded; the rest is the engine's."""

    def __init__(self, engine: Any, routes: EpisodeRoutes) -> None:
        self.engine, self.routes = engine, routes

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        req = req.copy()  # the caller's request stays as it was
        req.metadata["return_routed_experts"] = True
        response = await self.engine.agenerate(req)
        self.routes.add_response(response)
        return response

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (copy, unpickle): no recursion through self.engine
            raise AttributeError(name)
        return getattr(self.engine, name)


def routed_engine(engine: Any, geometry: RouteGeometry) -> EpisodeEngine:
    """The episode's recorder around `engine`, after routereplay's backend is on it (when it has one of AReaL's)."""
    if inner_engine(engine) is not None:
        install(engine, geometry)
    return EpisodeEngine(engine, EpisodeRoutes(geometry))


def with_routes(episode: dict[str, torch.Tensor] | None, recorder: EpisodeEngine) -> dict[str, torch.Tensor] | None:
    """AReaL's episode dict with the two route columns over its `input_ids` (batch dim 1)."""
    if episode is None:
        return None
    input_ids = episode.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise BatchFieldError(
            "the workflow's episode has no [1, S] input_ids tensor to align the routes with (got "
            f"{type(input_ids).__name__}); routed workflows need AReaL's episode form"
        )
    return {**episode, **recorder.routes.columns(input_ids[0])}


@contextmanager
def refusals_counted() -> Iterator[None]:
    """One routed episode: `REFUSED_METRIC` 1 in AReaL's `rollout` stats tracker when a routereplay error leaves it
    (re-raised: AReaL's executor logs it and drops the episode), 0 when the episode comes back."""
    tracker = stats_tracker.get("rollout")
    try:
        yield
    except RouteReplayError:
        tracker.scalar(**{REFUSED_METRIC: 1.0})
        raise
    tracker.scalar(**{REFUSED_METRIC: 0.0})


class RoutedWorkflowMixin:
    """The routes part of a routed workflow, mixed in before an AReaL workflow class: `route_geometry=` taken at
    construction, each episode run on a per-episode recorder and returned with its two columns."""

    def __init__(self, *args: Any, route_geometry: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route_geometry = episode_routes.route_geometry(route_geometry)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        with refusals_counted():
            recorder = routed_engine(engine, self.route_geometry)
            return with_routes(await super().arun_episode(recorder, data), recorder)  # type: ignore[misc]


class RoutedRLVRWorkflow(RoutedWorkflowMixin, RLVRWorkflow):
    """AReaL's `RLVRWorkflow` whose episodes carry their routes (`ROUTES_KEY`, `TOKENS_KEY`)."""


class RoutedMultiTurnWorkflow(RoutedWorkflowMixin, MultiTurnWorkflow):
    """AReaL's `MultiTurnWorkflow` whose episodes carry their routes: every turn merged by position (KEEP)."""


__all__ = [
    "REFUSED_METRIC",
    "EpisodeEngine",
    "RoutedMultiTurnWorkflow",
    "RoutedRLVRWorkflow",
    "routed_engine",
    "with_routes",
]
