"""Router replay for verl 0.9.1: rollout routes without zero padding, and R2 / R3 on verl's FSDP/FSDP2 engine.

Turn it on in a verl run (docs/verl.md): `actor_rollout_ref.model.external_lib=
routereplay.integrations.verl.fsdp_engine` (imported by verl in every worker, agent-loop workers included,
it registers the engine for `language_model` / fsdp, fsdp2 and routereplay's checked `single_turn_agent` /
`tool_agent` loops; `VERL_USE_EXTERNAL_MODULES` works too),
`+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3` (or R2) and, for R3,
`actor_rollout_ref.rollout.enable_rollout_routing_replay=True`. verl's own agent loops then put each sample's
routes, merged call by call and naming its tokens, in `AgentLoopOutput.extra_fields[ROUTES_KEY]`.

verl 0.9.1 replays routes on Megatron and VeOmni only, pads the engine's routes with zeros that mean
"no route" (expert 0 to any trainer that forces them), and merges partial-rollout resumes by slicing.
This package decodes each engine call's routes with routereplay's decoders, merges turns and resumes
by token position in a `RouteStore` (provenance kept, duplicated prefixes refused), and puts them on
verl's batch as compact per-sample blobs (default) or as verl's own `routed_experts` with -1.

Files:
- `rollout.py`         `RouteGeometry` (MoE layers of the model, from its HF config), `RolloutRoutes` (decode
                       vLLM / SGLang routes per engine call, `add_call` / `add_tokens` into a `RouteStore`)
- `call_routes.py` `AgentLoopRoutes` (one agent-loop sample's calls merged by token position, checked against
                       the sequence the loop returns, put on its `AgentLoopOutput`), `RecordingServer` (a loop's
                       `server_manager` whose `generate` adds each call)
- `checked_loops.py`     verl's `SingleTurnAgentLoop` / `ToolAgentLoop` with `RouteCheckedAgentLoop` mixed in, under
                       verl's names in its agent-loop registry (imports verl)
- `batch.py`           routes on verl's batch: `compact_blob` / `compact_routes` / `put_output_routes` (the
                       non-tensor column `ROUTES_KEY`, via `AgentLoopOutput.extra_fields`), `padded_routes` /
                       `dense_routed_experts` (verl's `routed_experts`, -1 for no route), `jagged_routed_experts`,
                       `routes_for_batch` (either form back for a micro-batch), `put_routes`
- `fields.py`          the batch fields those readers touch (`input_ids`, `attention_mask`, `prompts`, the
                       compact column), each checked before use (`BatchFieldError`)
- `dense_routes.py`    traces -> verl's dense `routed_experts` layouts, -1 (never 0) where nothing was routed
- `routed_experts.py`  verl's dense `routed_experts` read back for replay: token-checked, zero padding made -1
- `digest.py`          the per-sample digest (`DIGEST_KEY`) that ties dense `routed_experts` to the token ids
- `micro_batch.py`     the trainer side: a micro-batch's routes in the layout verl's FSDP engine feeds the model
- `fsdp_engine.py`     verl's FSDP/FSDP2 engine with routereplay R2 / R3 (R2 with rollout routes refused)
- `route_checks.py`    what that engine checks of digest-less `routed_experts`: R3's opt-out
                       (`ROUTEREPLAY_VERL_UNCHECKED_ROUTES`), R2's token -> routes digests of what it recorded
- `registration.py`    the engine in verl's `EngineRegistry` whenever verl's engines load (`external_lib`, or
                       an import hook when `VERL_USE_EXTERNAL_MODULES` / any process imports it before
                       `verl.workers`), and the checked agent loops whenever verl's agent loops load

Importing this package imports no verl: `rollout` / `batch` / `call_routes` take verl's objects
(`DataProto`, `TensorDict`, `AgentLoopOutput`, `TokenOutput`) duck-typed, and `fsdp_engine` imports verl inside
the functions that need it (neither it nor `checked_loops` is re-exported here: importing them inside a verl
process registers the engine and the loops, which is what `external_lib` does).
Tests: `make test-verl` (verl 0.9.1 in its own .venv-verl: it pins transformers<5.11, tensordict<=0.10).
"""

from routereplay.integrations.verl.batch import (
    DIGEST_KEY,
    ROUTES_KEY,
    VERL_ROUTES_KEY,
    BatchForm,
    BatchLimits,
    compact_blob,
    compact_routes,
    dense_routed_experts,
    jagged_routed_experts,
    padded_routes,
    put_output_routes,
    put_routes,
    routed_experts_for_batch,
    routes_for_batch,
    traces_of,
)
from routereplay.integrations.verl.call_routes import AgentLoopRoutes, RecordingServer
from routereplay.integrations.verl.rollout import Engine, RolloutRoutes, RouteGeometry

__all__ = [
    "DIGEST_KEY",
    "ROUTES_KEY",
    "VERL_ROUTES_KEY",
    "AgentLoopRoutes",
    "BatchForm",
    "BatchLimits",
    "Engine",
    "RecordingServer",
    "RolloutRoutes",
    "RouteGeometry",
    "compact_blob",
    "compact_routes",
    "dense_routed_experts",
    "jagged_routed_experts",
    "padded_routes",
    "put_output_routes",
    "put_routes",
    "routed_experts_for_batch",
    "routes_for_batch",
    "traces_of",
]
