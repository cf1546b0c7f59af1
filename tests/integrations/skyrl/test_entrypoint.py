"""`routereplay.integrations.skyrl.entrypoint` against SkyRL 0.4.0's own config classes and checks: the documented
FSDP R3 config is refused by SkyRL's `validate_cfg` and passes routereplay's `validate`, which relaxes only the
Megatron-only assertion; a Megatron config goes through SkyRL's checks untouched; the R2 switch is checked in the
driver and at `install`, and `runtime_env` carries it to the Ray task."""

from __future__ import annotations

from typing import Any

import pytest

from routereplay.errors import ConfigError

pytestmark = [pytest.mark.skyrl, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MODE_ENV = "ROUTEREPLAY_SKYRL_ROUTER_REPLAY"
R3 = [
    "trainer.logger=console",  # SkyRL's default logger (wandb) asserts WANDB_API_KEY
    "trainer.strategy=fsdp2",
    "generator.inference_engine.enable_return_routed_experts=true",
    "trainer.policy.megatron_config.moe_enable_routing_replay=true",
]
MP = "generator.inference_engine.distributed_executor_backend=mp"


def skyrl_config(*overrides: str) -> Any:
    from skyrl.train.config.config import SkyRLTrainConfig

    return SkyRLTrainConfig.from_cli_overrides(list(overrides))


@pytest.fixture(autouse=True)
def no_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("skyrl")
    monkeypatch.delenv(MODE_ENV, raising=False)


def test_skyrls_own_check_refuses_fsdp_r3() -> None:
    from skyrl.train.utils.utils import validate_cfg

    with pytest.raises(AssertionError, match="r3.*only supported with Megatron training backend"):
        validate_cfg(skyrl_config(*R3, MP))
    with pytest.raises(AssertionError, match="r3.*can hang with the ray backend"):
        validate_cfg(skyrl_config(*R3))


def test_validate_passes_fsdp_r3_on_the_mp_backend_and_builds_the_worker() -> None:
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    from routereplay.integrations.skyrl.entrypoint import validate
    from routereplay.integrations.skyrl.policy_worker import install, replay_mode

    cfg = skyrl_config(*R3, MP)
    validate(cfg)
    assert cfg.trainer.strategy == "fsdp"  # SkyRL's validate_cfg ran: it renames fsdp2
    assert cfg.generator.inference_engine.enable_return_routed_experts  # restored
    assert replay_mode(cfg.trainer) == "R3"
    original = fsdp_worker.PolicyWorker
    try:
        cls = install(cfg)
        assert issubclass(cls, fsdp_worker.FSDPPolicyWorkerBase) and fsdp_worker.PolicyWorker is not original
    finally:
        fsdp_worker.PolicyWorker = original


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ((*R3,), "distributed_executor_backend=ray.*set generator.inference_engine.distributed_executor_backend=mp"),
        ((*R3[:3], MP), "moe_enable_routing_replay=false: nothing would consume"),
        ((*R3, MP, "generator.merge_stepwise_output=true"), "merge_stepwise_output=true"),
        ((R3[0], R3[1], R3[3]), "enable_return_routed_experts=false: the rollout would return no routes"),
    ],
)
def test_validate_keeps_skyrls_other_r3_conditions(overrides: tuple[str, ...], message: str) -> None:
    from routereplay.integrations.skyrl.entrypoint import validate

    with pytest.raises(ConfigError, match=message):
        validate(skyrl_config(*overrides))


def test_validate_leaves_megatron_to_skyrls_checks() -> None:
    """A Megatron config reaches SkyRL's validate_cfg as it is: its R3 checks still fire (the ray backend here)."""
    from routereplay.integrations.skyrl.entrypoint import validate

    megatron = [o.replace("fsdp2", "megatron") for o in R3]
    with pytest.raises(AssertionError, match="r3.*can hang with the ray backend"):
        validate(skyrl_config(*megatron))


def test_the_r2_switch_is_checked_in_the_driver_and_at_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from routereplay.integrations.skyrl.entrypoint import runtime_env, validate
    from routereplay.integrations.skyrl.policy_worker import install

    monkeypatch.setenv(MODE_ENV, "r2")
    with pytest.raises(ConfigError, match=f"{MODE_ENV}='r2'; use one of"):
        validate(skyrl_config("trainer.logger=console"))
    with pytest.raises(ConfigError, match=f"{MODE_ENV}='r2'; use one of"):
        install()
    monkeypatch.setenv(MODE_ENV, "R2")
    with pytest.raises(ConfigError, match="asks for R3"):  # R2 and SkyRL's R3 key together
        install(skyrl_config(*R3, MP))
    validate(skyrl_config("trainer.logger=console"))
    assert runtime_env() == {"env_vars": {MODE_ENV: "R2"}}
    monkeypatch.delenv(MODE_ENV)
    assert runtime_env() == {}


def worker_env() -> str | None:
    """What a policy worker reads: an actor created inside the task, as SkyRL's `PPORayActorGroup` creates its
    workers (no runtime_env of their own)."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def mode(self) -> str | None:
            return os.environ.get(MODE_ENV)

    return ray.get(Probe.remote().mode.remote())  # type: ignore[attr-defined]


@pytest.mark.ray
def test_runtime_env_carries_the_r2_switch_to_actors_the_trainer_task_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's initialize_ray forwards only variables it names (and SKYRL_*): the driver's MODE_ENV reaches the
    workers through the trainer task's runtime_env, which Ray merges with the job's and actors inherit."""
    import ray

    from routereplay.integrations.skyrl.entrypoint import runtime_env

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"JOB": "1"}})
    monkeypatch.setenv(MODE_ENV, "R2")  # after the local raylet started, as on a cluster started beforehand
    try:
        task = ray.remote(num_cpus=0)(worker_env)
        assert ray.get(task.remote()) is None  # the job's env alone: SkyRL's prepare_runtime_environment drops it
        assert ray.get(task.options(runtime_env=runtime_env()).remote()) == "R2"
    finally:
        ray.shutdown()


def test_the_entrypoint_builds_routereplays_trainer_with_skyrls_arguments() -> None:
    """`run_trainer` runs `experiment_class()(cfg)`: SkyRL's `BasePPOExp` whose `get_trainer` builds SkyRL's
    `RayPPOTrainer` with routereplay's digest column (`trainer_class()`), from the arguments SkyRL passes."""
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from skyrl.train.trainer import RayPPOTrainer

    from routereplay.integrations.skyrl.entrypoint import experiment_class
    from routereplay.integrations.skyrl.trainer import TRAINER_NAME, trainer_class

    cls = experiment_class()
    assert issubclass(cls, BasePPOExp)
    cfg = skyrl_config("trainer.logger=console", "generator.inference_engine.enable_ray_prometheus_stats=false")
    arguments = {"tracker": None, "tokenizer": None, "train_dataset": None, "eval_dataset": None,
                 "inference_engine_client": None, "generator": None, "colocate_pg": None}  # fmt: skip
    trainer = cls.get_trainer(cls.__new__(cls), cfg, **arguments)
    assert type(trainer) is trainer_class() and type(trainer).__name__ == TRAINER_NAME
    assert isinstance(trainer, RayPPOTrainer) and trainer.cfg is cfg


def test_runtime_env_carries_both_worker_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    from routereplay.integrations.skyrl.entrypoint import runtime_env, validate

    monkeypatch.setenv("ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES", "1")
    assert runtime_env() == {"env_vars": {"ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES": "1"}}
    monkeypatch.setenv(MODE_ENV, "R2")
    assert runtime_env() == {"env_vars": {MODE_ENV: "R2", "ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES": "1"}}
    monkeypatch.setenv("ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES", "maybe")
    with pytest.raises(ConfigError, match="ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES='maybe': set it to 1"):
        validate(skyrl_config("trainer.logger=console"))


def test_r2_off_fsdp_is_refused_in_the_driver_and_at_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's Megatron worker has no R2 and never runs routereplay's worker: R2 there would do nothing."""
    from routereplay.integrations.skyrl.entrypoint import validate
    from routereplay.integrations.skyrl.policy_worker import install

    monkeypatch.setenv(MODE_ENV, "R2")
    cfg = skyrl_config("trainer.logger=console", "trainer.strategy=megatron")
    refusal = rf"{MODE_ENV}=R2 with trainer.strategy=megatron: R2 runs in routereplay's FSDP .* trainer.strategy=fsdp"
    with pytest.raises(ConfigError, match=refusal):
        validate(cfg)
    with pytest.raises(ConfigError, match=refusal):
        install(cfg)
    validate(skyrl_config("trainer.logger=console", "trainer.strategy=fsdp"))  # the same switch on FSDP passes


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_r3_by_the_variable_without_rollout_routes_is_refused(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    """As SkyRL refuses its own R3 key without enable_return_routed_experts=true."""
    from routereplay.integrations.skyrl.entrypoint import validate

    monkeypatch.setenv(MODE_ENV, "R3")
    with pytest.raises(
        ConfigError, match=rf"{MODE_ENV}=R3 \(R3\) but .*enable_return_routed_experts=false: the rollout"
    ):
        validate(skyrl_config("trainer.logger=console", f"trainer.strategy={strategy}", MP))
