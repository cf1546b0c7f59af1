"""Router replay for SkyRL 0.4.0: rollout routes from SkyRL's forms, and R3 / R2 on SkyRL's FSDP policy worker.

SkyRL 0.4.0 replays routed experts (R3) on its Megatron workers only; its FSDP worker has no routed-expert
code although the batch already carries `rollout_expert_indices`. This package reads SkyRL's route forms
into routereplay's traces (rollout side) and replays them on SkyRL's own FSDP worker (trainer side).

Rollout side (docs/skyrl.md):
- `wire_form.py`     `decode_skyrl`: the `/skyrl/v1/generate` `{data, shape, dtype}` envelope, the in-process
                     array and vLLM's forms of one engine call, checked before decoding
- `rollout.py`       `RolloutRoutes`: calls merged per trajectory by `routed_experts_prompt_start` in a
                     `RouteStore`; `generator_routes` (SkyRL's generator form, one dtype from E), compact column
- `packed_routes.py` `routes_of_packed`: SkyRL's batch `PackedTensor` back to (B, S, M, K) with -1, checked;
                     `route_digests` tie packed rows to their tokens

Trainer side:
- `policy_worker.py`   SkyRL's `FSDPPolicyWorkerBase` with R3 / R2 (`policy_worker_class`, `install` behind
                       SkyRL's `fsdp_worker.PolicyWorker`); R3 by SkyRL's own key
                       `trainer.policy.megatron_config.moe_enable_routing_replay`, R2 by
                       `ROUTEREPLAY_SKYRL_ROUTER_REPLAY=R2` in the workers' environment (`entrypoint.runtime_env`)
- `micro_batch.py`     `ModelInputLayout`: routes and token ids laid out as SkyRL's `HFModelWrapper` feeds the model
                       (packed `remove_microbatch_padding`, padded, Ulysses SP), its input ids checked
- `recorded_routes.py` R2's recordings, found again by each sample's tokens, shared over SkyRL's dp group
- `entrypoint.py`      `python -m routereplay.integrations.skyrl.entrypoint`: SkyRL's `main_base` with its config
                       check relaxed only for FSDP R3 (`validate`), the R2 switch in the Ray runtime env, `install`

Importing this package imports no SkyRL: SkyRL is imported inside the functions that need it.
Tests: `make test-skyrl` (SkyRL 0.4.0 in its own .venv-skyrl: it pins transformers<=5.16.1, hydra-core==1.3.4).
"""

from routereplay.integrations.skyrl.packed_routes import route_digests, routes_of_packed
from routereplay.integrations.skyrl.policy_worker import MODE_ENV, install, policy_worker_class, replay_mode
from routereplay.integrations.skyrl.rollout import RolloutRoutes, RouteGeometry, generator_routes, route_dtype
from routereplay.integrations.skyrl.wire_form import decode_skyrl, unpack_envelope

__all__: list[str] = [
    "MODE_ENV",
    "RolloutRoutes",
    "RouteGeometry",
    "decode_skyrl",
    "generator_routes",
    "install",
    "policy_worker_class",
    "replay_mode",
    "route_digests",
    "route_dtype",
    "routes_of_packed",
    "unpack_envelope",
]
