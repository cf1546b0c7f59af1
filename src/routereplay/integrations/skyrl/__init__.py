"""Router replay for SkyRL 0.4.0: rollout routes from SkyRL's forms, and R3 / R2 on SkyRL's FSDP policy worker.

SkyRL 0.4.0 replays routed experts (R3) on its Megatron workers only; its FSDP worker has no routed-expert
code although the batch already carries `rollout_expert_indices`. This package reads SkyRL's route forms
into routereplay's traces (rollout side) and replays them on SkyRL's own FSDP worker (trainer side).

Rollout side (docs/skyrl.md):
- `wire_form.py`     `decode_skyrl`: the `/skyrl/v1/generate` `{data, shape, dtype}` envelope, the in-process
                     array and vLLM's forms of one engine call, checked before decoding
- `rollout.py`       `RolloutRoutes`: calls merged per trajectory by `routed_experts_prompt_start` in a
                     `RouteStore`; `generator_routes` (SkyRL's generator form, one dtype from E), compact column
- `packed_routes.py` `routes_of_packed`: SkyRL's batch `PackedTensor` back to (B, S, M, K) with -1, checked
- `digest.py`        the digest column (`DIGEST_KEY`) that ties packed rows to their tokens: from the generator
                     output (`generator_digests`) or the merged traces (`route_digests`)

Trainer side:
- `policy_worker.py`   SkyRL's `FSDPPolicyWorkerBase` with R3 / R2 (`policy_worker_class`, `install` behind
                       SkyRL's `fsdp_worker.PolicyWorker`); R3 by SkyRL's own key
                       `trainer.policy.megatron_config.moe_enable_routing_replay`, R2 by
                       `ROUTEREPLAY_SKYRL_ROUTER_REPLAY=R2` in the workers' environment (`entrypoint.runtime_env`)
- `micro_batch.py`     `ModelInputLayout`: routes and token ids laid out as SkyRL's `HFModelWrapper` feeds the model
                       (packed `remove_microbatch_padding`, padded, Ulysses SP), its input ids checked
- `recorded_routes.py` R2's recordings (one per train batch, over every mini-batch's forward), found again by
                       each sample's tokens, shared over SkyRL's dp group
- `token_check.py`     R3's token check against the digest column: on by default, the per-worker opt-out
                       `ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES=1`, the unchecked samples counted
- `trainer.py`         SkyRL's `RayPPOTrainer` adding the digest column from the generator output (`trainer_class`)
- `entrypoint.py`      `python -m routereplay.integrations.skyrl.entrypoint`: SkyRL's `main_base` with its config
                       check relaxed only for FSDP R3 (`validate`), the workers' switches in the Ray runtime env,
                       `install`, and routereplay's trainer

Importing this package imports no SkyRL: SkyRL is imported inside the functions that need it.
Tests: `make test-skyrl` (SkyRL 0.4.0 in its own .venv-skyrl: it pins transformers<=5.16.1, hydra-core==1.3.4).
"""

from routereplay.integrations.skyrl.digest import DIGEST_KEY, route_digests
from routereplay.integrations.skyrl.packed_routes import routes_of_packed
from routereplay.integrations.skyrl.policy_worker import MODE_ENV, install, policy_worker_class, replay_mode
from routereplay.integrations.skyrl.rollout import RolloutRoutes, RouteGeometry, generator_routes, route_dtype
from routereplay.integrations.skyrl.token_check import UNCHECKED_ENV
from routereplay.integrations.skyrl.trainer import RouteReplayTrainerMixin, trainer_class
from routereplay.integrations.skyrl.wire_form import decode_skyrl, unpack_envelope

__all__: list[str] = [
    "DIGEST_KEY",
    "MODE_ENV",
    "UNCHECKED_ENV",
    "RolloutRoutes",
    "RouteGeometry",
    "RouteReplayTrainerMixin",
    "decode_skyrl",
    "generator_routes",
    "install",
    "policy_worker_class",
    "replay_mode",
    "route_digests",
    "route_dtype",
    "routes_of_packed",
    "trainer_class",
    "unpack_envelope",
]
