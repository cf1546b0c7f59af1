"""The replay mode from AReaL's own config (GRPOConfig loaded by AReaL's `load_expr_config`), and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from routereplay.errors import ConfigError
from routereplay.integrations.areal.replay_mode import (
    MODE_ENV,
    AReaLReplayMode,
    check_columns_dropped,
    chosen_mode,
    configure,
    mode_of,
)
from tests.integrations.areal.actor_case import grpo_config

pytestmark = pytest.mark.areal
ROUTES_ON = "rollout.return_routed_experts=true"


@pytest.fixture(autouse=True)
def no_mode_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)


def config(tmp_path: Path, *overrides: str, mode: str | None = None) -> Any:
    return grpo_config(tmp_path, str(tmp_path / "model"), *overrides, env={MODE_ENV: mode} if mode else None)


def test_mode_is_read_from_the_actor_scheduling_spec_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert mode_of(config(tmp_path).actor) is AReaLReplayMode.DISABLED
    assert mode_of(config(tmp_path, mode="r3").actor) is AReaLReplayMode.R3
    monkeypatch.setenv(MODE_ENV, "R2")
    assert mode_of(config(tmp_path).actor) is AReaLReplayMode.R2
    with pytest.raises(ConfigError, match=f"env_vars set {MODE_ENV}=R3 but this process's environment has .*=R2"):
        mode_of(config(tmp_path, mode="R3").actor)
    monkeypatch.setenv(MODE_ENV, "R4")
    with pytest.raises(ConfigError, match=r"'R4' in the environment; use one of \['disabled', 'R2', 'R3'\]"):
        mode_of(config(tmp_path).actor)


def test_return_routed_experts_turns_on_r3_in_the_actor_workers_env(tmp_path: Path) -> None:
    cfg = config(tmp_path, ROUTES_ON)
    assert configure(cfg) is AReaLReplayMode.R3
    assert cfg.actor.scheduling_spec[0].env_vars[MODE_ENV] == "R3"
    assert mode_of(cfg.actor) is AReaLReplayMode.R3
    plain = config(tmp_path)
    assert configure(plain) is AReaLReplayMode.DISABLED and MODE_ENV not in plain.actor.scheduling_spec[0].env_vars


def test_an_explicit_disabled_wins_over_return_routed_experts(tmp_path: Path) -> None:
    assert configure(config(tmp_path, ROUTES_ON, mode="disabled")) is AReaLReplayMode.DISABLED


def test_r2_with_captured_rollout_routes_is_refused_naming_both_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{MODE_ENV}=R2 with rollout.return_routed_experts=true"):
        configure(config(tmp_path, ROUTES_ON, mode="R2"))


def test_r2_is_refused_when_areal_skips_compute_logp(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="actor.recompute_logprob=False.*Set actor.recompute_logprob=true"):
        configure(config(tmp_path, "actor.recompute_logprob=false", mode="R2"))
    assert configure(config(tmp_path, mode="R2")) is AReaLReplayMode.R2


def test_r3_without_return_routed_experts_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="R3 without rollout.return_routed_experts=true"):
        configure(config(tmp_path, mode="R3"))


def test_r3_with_a_vllm_rollout_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="R3 with rollout.backend=vllm:d1: AReaL captures rollout routes from SGLang"):
        configure(config(tmp_path, "rollout.backend=vllm:d1", mode="R3"))


def test_archon_actor_is_refused_naming_its_router(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Archon engine routes with its own torchtitan-style TokenChoiceTopKRouter"):
        configure(config(tmp_path, "actor.backend=archon:d1", ROUTES_ON))
    # R3 inferred from return_routed_experts alone: the way out names that key, not "unset" a variable never set
    with pytest.raises(ConfigError, match="=disabled, or rollout.return_routed_experts=false"):
        configure(config(tmp_path, "actor.backend=archon:d1", ROUTES_ON))
    assert configure(config(tmp_path, "actor.backend=archon:d1")) is AReaLReplayMode.DISABLED  # nothing to replay


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_megatron_actor_is_refused_naming_the_areal_issues_and_the_adapter(tmp_path: Path, mode: str) -> None:
    overrides = ["actor.backend=megatron:d1"] + ([ROUTES_ON] if mode == "R3" else [])
    with pytest.raises(ConfigError, match=r"MegatronEngine is not wired .*#1207 / #1496.*routereplay.runtime.megatron"):
        configure(config(tmp_path, *overrides, mode=mode))


def test_tree_training_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="actor.enable_tree_training=true"):
        configure(config(tmp_path, "+actor.enable_tree_training=true", mode="R2"))


def test_an_empty_mode_counts_as_unset_and_only_an_explicit_disabled_drops_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, " ")
    cfg = config(tmp_path, ROUTES_ON)
    cfg.actor.scheduling_spec[0].env_vars[MODE_ENV] = ""
    assert chosen_mode(cfg.actor) is None
    assert configure(cfg) is AReaLReplayMode.R3  # unset: return_routed_experts means R3
    plain = config(tmp_path)
    with pytest.raises(ConfigError, match=f"{MODE_ENV} is not set .*rollout.return_routed_experts=true.*=disabled"):
        check_columns_dropped(plain.actor, "the batch")
    check_columns_dropped(config(tmp_path, mode="disabled").actor, "the batch")


def test_r2_refusal_with_the_decoupled_loss_names_prox_logp_method_not_recompute_logprob(tmp_path: Path) -> None:
    cfg = config(tmp_path, "+actor.use_decoupled_loss=true", "+actor.prox_logp_method=loglinear", mode="R2")
    assert cfg.actor.recompute_logprob is True
    with pytest.raises(ConfigError, match="prox_logp_method=loglinear.*") as caught:
        configure(cfg)
    assert "set actor.prox_logp_method=recompute (or metrics), or actor.use_decoupled_loss=false" in str(caught.value)
    assert "Set actor.recompute_logprob=true" not in str(caught.value)
