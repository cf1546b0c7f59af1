"""Router replay for AReaL 1.0.4: routes carried from SGLang through AReaL's workflows, R3 / R2 on its FSDP actor.

AReaL turns on SGLang's route capture (`rollout.return_routed_experts`) and then drops the routes: its workflows
build no routes column, and a request resumed after a weight update carries its prefix rows twice. This package
keeps them per episode (rollout side) and replays them in AReaL's own actor (trainer side). The episode dict
carries two extra `[1, S, ...]` columns that AReaL's own padding and packing keep beside `input_ids`.

Rollout side (docs/areal.md):
- `columns.py`        the contract: `ROUTES_KEY` `[1, S, M, K]` (int16 / int32, -1 rows where no call routed) and
                      `TOKENS_KEY` `[1, S]` (the token each row was routed for); `episode_columns` builds them,
                      `check_columns` reads them back in any layout (episode, padded, packed)
- `episode_routes.py` `EpisodeRoutes`: one episode's `agenerate` calls merged by token position (KEEP, -1 rows,
                      `TokenMismatchError` on tokens that differ from what a call routed); `route_geometry`
- `backend.py`        `RoutedSGLangBackend`, `install(engine, geometry)`: AReaL's SGLang backend sending
                      `routed_experts_start_len` on resumed passes, each row kept once (imports AReaL)
- `workflows.py`      `RoutedRLVRWorkflow`, `RoutedMultiTurnWorkflow`: AReaL's own workflows, the two columns
                      added to each episode (imports AReaL)

Trainer side:
- `replay_mode.py`    the mode (disabled / R2 / R3) from AReaL's own config, refusals by name
- `packed_layout.py`  where each row goes in AReaL's packed / padded / Ulysses micro-batches, the token check
- `fsdp_actor.py`     `RouteReplayFSDPPPOActor(FSDPPPOActor)`: R3 / R2 in compute_logp and every update (imports AReaL)
- `trainer.py`        `RouteReplayPPOTrainer(PPOTrainer)` (imports AReaL)

Importing this package imports no AReaL: the modules marked above import it and are imported by name.
Tests: `make test-areal` (AReaL 1.0.4 in its own .venv-areal: it pins torch<2.11 and transformers<=5.3.0).
"""

from routereplay.integrations.areal.columns import (
    NO_ROUTE,
    ROUTES_KEY,
    TOKENS_KEY,
    check_columns,
    episode_columns,
    route_dtype,
)
from routereplay.integrations.areal.episode_routes import EpisodeRoutes, route_geometry

__all__: list[str] = [
    "NO_ROUTE",
    "ROUTES_KEY",
    "TOKENS_KEY",
    "EpisodeRoutes",
    "check_columns",
    "episode_columns",
    "route_dtype",
    "route_geometry",
]
