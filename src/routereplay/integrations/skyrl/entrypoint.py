"""SkyRL 0.4.0's training entrypoint with routereplay's FSDP policy worker, in place of SkyRL's `main_base`:
`python -m routereplay.integrations.skyrl.entrypoint <SkyRL's overrides>`.

SkyRL's `main_base.main()` checks the config in the driver (`validate_cfg`) before its Ray task builds the
trainer, and `validate_inference_engine_cfg` asserts, for `generator.inference_engine.enable_return_routed_experts
=true`: the vLLM `mp` executor backend ("r3 can hang with the ray backend"), `trainer.strategy=megatron` ("only
supported with Megatron training backend") and `moe_enable_routing_replay=true`. Calling `install()` in the Ray
task comes too late for the second assertion. This module keeps SkyRL's checks and drops only that one, for the
FSDP strategy, where routereplay's worker replays the routes:

- `validate(cfg)`: SkyRL's `validate_cfg` unchanged for every config but FSDP + rollout routes; R3 (SkyRL's key or
  `ROUTEREPLAY_SKYRL_ROUTER_REPLAY=R3`) without `enable_return_routed_experts=true`, and R2 with a strategy other
  than FSDP (SkyRL's Megatron worker has no R2), are refused with a ConfigError; for FSDP + rollout routes, the
  `mp` backend and `moe_enable_routing_replay=true` are required (ConfigError, SkyRL's reasons), `validate_cfg`
  runs with the routes flag off, and the one other check the flag gates in `validate_cfg` (no
  `merge_stepwise_output`) is made here. SkyRL's files are not edited;
- `runtime_env()`: `ROUTEREPLAY_SKYRL_ROUTER_REPLAY` and `ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES` for the Ray task
  (SkyRL's `prepare_runtime_environment` forwards only variables it names, and `SKYRL_*`); actors the task
  creates (SkyRL's workers) inherit them;
- `experiment_class()`: SkyRL's `BasePPOExp` whose `get_trainer` builds routereplay's trainer (`trainer.py`: SkyRL's
  `RayPPOTrainer` plus the digest column that turns the worker's token check on);
- `run_trainer(cfg)`: the Ray task, SkyRL's `skyrl_entrypoint` with `install(cfg)` before
  `experiment_class()(cfg).run()`;
- `main(argv)`: parse with `SkyRLTrainConfig.from_cli_overrides`, `validate`, SkyRL's `initialize_ray`, run the task.

Nothing here imports SkyRL or Ray until a function runs.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

from routereplay.errors import ConfigError
from routereplay.integrations.skyrl.policy_worker import (
    FSDP_STRATEGIES,
    MEGATRON_KEY,
    MODE_ENV,
    install,
    replay_mode,
)
from routereplay.integrations.skyrl.token_check import UNCHECKED_ENV, unchecked_opt_out
from routereplay.integrations.skyrl.trainer import trainer_class

WORKER_ENV = (MODE_ENV, UNCHECKED_ENV)  # what the workers read, carried to them in the Ray runtime env

ROUTES_KEY = "generator.inference_engine.enable_return_routed_experts"
BACKEND_KEY = "generator.inference_engine.distributed_executor_backend"


def replays_on_fsdp(cfg: Any) -> bool:
    """Whether `cfg` asks for rollout routes on an FSDP trainer: the config only routereplay's worker can run."""
    return cfg.trainer.strategy in FSDP_STRATEGIES and bool(cfg.generator.inference_engine.enable_return_routed_experts)


def validate(cfg: Any) -> None:
    """SkyRL's `validate_cfg(cfg)` (which may update `cfg`, as SkyRL's does), relaxing only its Megatron-only R3
    assertion for the FSDP strategy; the worker's mode (`MODE_ENV` against `MEGATRON_KEY`) is checked too."""
    from skyrl.train.utils.utils import validate_cfg

    # a bad ROUTEREPLAY_SKYRL_ROUTER_REPLAY, R2 with the R3 key, or R2 off FSDP: refused in the driver
    mode = replay_mode(cfg.trainer)
    unchecked_opt_out()  # a bad ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES, likewise
    if mode == "R3" and not cfg.generator.inference_engine.enable_return_routed_experts:
        # SkyRL asserts this for its key; the env's R3 would fail only at the worker's first pass
        asked = (
            f"{MEGATRON_KEY}=true" if cfg.trainer.policy.megatron_config.moe_enable_routing_replay else f"{MODE_ENV}=R3"
        )
        raise ConfigError(
            f"{asked} (R3) but {ROUTES_KEY}=false: the rollout would return no routes to replay; set "
            f"{ROUTES_KEY}=true (and {BACKEND_KEY}=mp)"
        )
    if not replays_on_fsdp(cfg):
        validate_cfg(cfg)
        return
    engine = cfg.generator.inference_engine
    if engine.distributed_executor_backend != "mp":
        raise ConfigError(
            f"{ROUTES_KEY}=true with {BACKEND_KEY}={engine.distributed_executor_backend}: SkyRL refuses rollout routes "
            f"on vLLM's ray executor backend (it can hang); set {BACKEND_KEY}=mp"
        )
    if not cfg.trainer.policy.megatron_config.moe_enable_routing_replay:
        raise ConfigError(
            f"{ROUTES_KEY}=true but {MEGATRON_KEY}=false: nothing would consume the rollout's routes (SkyRL's "
            f"condition too). Set {MEGATRON_KEY}=true for R3, or {ROUTES_KEY}=false"
        )
    if cfg.generator.merge_stepwise_output:  # validate_cfg's other check behind the routes flag
        raise ConfigError(
            f"{ROUTES_KEY}=true with generator.merge_stepwise_output=true: SkyRL's prefix-aware merging does not "
            "merge routed experts; set generator.merge_stepwise_output=false"
        )
    engine.enable_return_routed_experts = False  # skips exactly the R3 block of validate_inference_engine_cfg
    try:
        validate_cfg(cfg)
    finally:
        engine.enable_return_routed_experts = True


def runtime_env() -> dict[str, Any]:
    """The Ray runtime env that carries `WORKER_ENV` (the mode, the token-check opt-out) to the trainer task and the
    workers it creates (empty when neither is set); pass it as `skyrl_entrypoint.options(runtime_env=runtime_env())`
    in an entrypoint of your own."""
    values = {name: os.environ[name] for name in WORKER_ENV if os.environ.get(name)}
    return {"env_vars": values} if values else {}


@functools.cache
def experiment_class() -> type:
    """SkyRL's `BasePPOExp` building routereplay's trainer (`trainer.trainer_class()`) with SkyRL's arguments."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    def get_trainer(self: Any, cfg: Any, tracker: Any, tokenizer: Any, train_dataset: Any, eval_dataset: Any,
                    inference_engine_client: Any, generator: Any, colocate_pg: Any) -> Any:  # fmt: skip
        return trainer_class()(
            cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client, generator=generator, colocate_pg=colocate_pg,
        )  # fmt: skip

    return type("RouteReplayPPOExp", (BasePPOExp,), {"get_trainer": get_trainer})


def run_trainer(cfg: Any) -> None:
    """The trainer task: routereplay's worker installed in this process, then SkyRL's experiment with
    routereplay's trainer (`experiment_class()(cfg).run()`)."""
    install(cfg)
    experiment_class()(cfg).run()


def main(argv: Sequence[str] | None = None) -> None:
    """SkyRL's `main_base.main()` with `validate` for its config check and `run_trainer` for its task."""
    import ray
    from skyrl.train.config.config import SkyRLTrainConfig
    from skyrl.train.utils.utils import initialize_ray

    cfg = SkyRLTrainConfig.from_cli_overrides(list(sys.argv[1:] if argv is None else argv))
    validate(cfg)
    initialize_ray(cfg)
    task = ray.remote(num_cpus=1)(run_trainer)
    ray.get(task.options(runtime_env=runtime_env()).remote(cfg))


if __name__ == "__main__":
    main()


__all__ = ["WORKER_ENV", "experiment_class", "main", "replays_on_fsdp", "run_trainer", "runtime_env", "validate"]
