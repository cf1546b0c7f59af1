"""`RouteReplayPPOTrainer`: AReaL's own PPOTrainer construction path, the actor built from routereplay's class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from routereplay.errors import ConfigError
from routereplay.integrations.areal.replay_mode import MODE_ENV
from tests.integrations.areal.actor_case import (
    actor_config,
    build_actor,
    checkpoint,
    distributed_env,
    episodes,
    grpo_config,
    random_routes,
    with_routes,
)

pytestmark = pytest.mark.areal


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture
def spmd(monkeypatch: pytest.MonkeyPatch) -> None:
    """AReaL's SPMD mode (torchrun-style: the trainer builds its engines in-process), one rank."""
    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    monkeypatch.delenv(MODE_ENV, raising=False)
    distributed_env()


def test_actor_is_routereplays_and_the_ref_keeps_areals_own_actor(spmd: None, model_path: str, tmp_path: Path) -> None:
    from areal.api.alloc_mode import ModelAllocation
    from areal.engine.fsdp_engine import FSDPPPOActor

    from routereplay.integrations.areal.fsdp_actor import RouteReplayFSDPPPOActor
    from routereplay.integrations.areal.trainer import RouteReplayPPOTrainer

    cfg = grpo_config(tmp_path, model_path, "rollout.return_routed_experts=true")
    trainer = RouteReplayPPOTrainer.__new__(RouteReplayPPOTrainer)
    trainer.config, trainer.scheduler = cfg, None
    alloc = ModelAllocation.from_str(cfg.actor.backend, name="actor")
    actor = trainer._create_train_engine(cfg.actor, alloc)
    assert type(actor) is RouteReplayFSDPPPOActor and actor.dp_group is not None  # AReaL's process groups built
    ref_config = type(cfg.actor)(**{**cfg.actor.__dict__})
    ref = trainer._create_train_engine(ref_config, alloc)
    assert type(ref) is FSDPPPOActor  # natural routing


def test_constructor_applies_the_mode_before_areal_starts_anything(spmd: None, model_path: str, tmp_path: Path) -> None:
    from routereplay.integrations.areal.trainer import RouteReplayPPOTrainer

    cfg = grpo_config(tmp_path, model_path, "rollout.return_routed_experts=true")
    # AReaL's own __init__ runs (tokenizer, allocations, its _validate_cfg) and stops at the missing dataset
    with pytest.raises(ValueError, match="train_dataset must be provided"):
        RouteReplayPPOTrainer(cfg)
    assert cfg.actor.scheduling_spec[0].env_vars[MODE_ENV] == "R3"

    refused: Any = grpo_config(tmp_path, model_path, "rollout.return_routed_experts=true", "actor.backend=archon:d1")
    with pytest.raises(ConfigError, match="TokenChoiceTopKRouter"):
        RouteReplayPPOTrainer(refused)


def test_areals_own_actor_for_the_ref_runs_natural_routing_with_the_columns_on_the_batch(
    spmd: None, model_path: str
) -> None:
    """The ref (AReaL's FSDPPPOActor) gets the rollout batch with the route columns: AReaL hands them to the HF
    model as keyword arguments, which it ignores; its log-probs are those of the batch without them."""
    from areal.engine.fsdp_engine import FSDPPPOActor

    ref = build_actor(actor_config(model_path), cls=FSDPPPOActor)
    batch = episodes()
    plain = ref.compute_logp(batch)
    with_columns = ref.compute_logp(with_routes(batch, random_routes(batch)))
    for a, b in zip(plain, with_columns, strict=True):
        torch.testing.assert_close(a, b)
