"""Router replay for AReaL 1.0.4: routes carried from SGLang through AReaL's workflows, R3 / R2 on its FSDP actor.

AReaL turns on SGLang's route capture (`rollout.return_routed_experts`) and then drops the routes: its workflows
build no routes column, and a request resumed after a weight update carries its prefix rows twice. This package
keeps them per episode (rollout side) and replays them in AReaL's own actor (trainer side). The episode dict
carries two extra `[1, S, ...]` columns (rollout writes, trainer reads); the actor turns them into a row-index
column that AReaL's own padding, micro-batching, packing and Ulysses slicing carry beside `input_ids`.

Rollout side (docs/areal.md):
- `columns.py`        the contract: `ROUTES_KEY` `[1, S, M, K]` (int16 / int32, -1 rows where no call routed) and
                      `TOKENS_KEY` `[1, S]` (the token each row was routed for); `episode_columns` builds them,
                      `check_columns`, the one reader of both (episode or padded batch),
                      used by the trainer side too
- `episode_routes.py` `EpisodeRoutes`: one episode's `agenerate` calls merged by token position (KEEP, -1 rows,
                      `TokenMismatchError` on tokens that differ from what a call routed); `route_geometry`
- `backend.py`        `RoutedSGLangBackend`, `install(engine, geometry)`: AReaL's SGLang backend sending
                      `routed_experts_start_len` on resumed passes, each row kept once (imports AReaL)
- `workflows.py`      `RoutedRLVRWorkflow`, `RoutedMultiTurnWorkflow`: AReaL's own workflows, the two columns
                      added to each episode (imports AReaL)

Trainer side:
- `replay_mode.py`    the mode (`AReaLReplayMode`: disabled / R2 / R3) in `MODE_ENV`, read from the actor config's
                      `scheduling_spec[*].env_vars` then the environment (`mode_of`, `configured_mode`);
                      `configure(config)`: R3 when AReaL's `ROUTES_FLAG` (`rollout.return_routed_experts`) is on and
                      no mode was chosen, `refusal` names what cannot replay (Archon / Megatron actor, vLLM rollout
                      with routes, R2 with rollout routes, tree training)
- `packed_layout.py`  where each row goes in AReaL's packed / padded / Ulysses micro-batches: the actor swaps the
                      two columns for `ROW_KEY` (`[B, S]` table row + 1) that AReaL splits, packs and pads like
                      `input_ids`; reads the columns through `check_columns`; `check_tokens`, the token check (on by
                      default; a worker opts out with `UNCHECKED_ENV=1`: replayed unchecked, counted)
- `fsdp_actor.py`     `RouteReplayFSDPPPOActor(FSDPPPOActor)`: R3 / R2 in compute_logp and every update (imports AReaL)
- `trainer.py`        `RouteReplayPPOTrainer(PPOTrainer)`: `configure` before AReaL's init, the actor built from
                      `RouteReplayFSDPPPOActor` (imports AReaL)

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
from routereplay.integrations.areal.packed_layout import ROW_KEY, UNCHECKED_ENV, check_tokens
from routereplay.integrations.areal.replay_mode import (
    MODE_ENV,
    ROUTES_FLAG,
    AReaLReplayMode,
    configure,
    configured_mode,
    mode_of,
    refusal,
)

__all__: list[str] = [
    "MODE_ENV",
    "NO_ROUTE",
    "ROUTES_FLAG",
    "ROUTES_KEY",
    "ROW_KEY",
    "TOKENS_KEY",
    "UNCHECKED_ENV",
    "AReaLReplayMode",
    "EpisodeRoutes",
    "check_columns",
    "check_tokens",
    "configure",
    "configured_mode",
    "episode_columns",
    "mode_of",
    "refusal",
    "route_dtype",
    "route_geometry",
]
