"""GRPO with router replay: R2 has no drift, R3 matches the engine, off drifts; `routereplay train`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from routereplay.cli.main import EXIT_OK, main
from routereplay.engines.hf import HFEngine
from routereplay.errors import ConfigError
from routereplay.rl.grpo import GRPOConfig, GRPOTrainer
from tests.conftest import SharedModels
from tests.rl.train_command import short_train

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def trained(shared_models: SharedModels) -> tuple[torch.nn.Module, object]:
    # a smaller sibling of the demo model, trained enough to earn rewards (advantages must not all be 0)
    return shared_models.trained("qwen3_moe", steps=300, num_experts=16, num_hidden_layers=3)


def _run(trained: tuple[torch.nn.Module, object], mode: str, **overrides: object) -> list[dict]:
    from routereplay.rl.tasks import AdditionTask

    model, tokenizer = trained
    policy = copy.deepcopy(model)
    config = GRPOConfig(mode=mode, steps=2, prompts_per_step=8, group_size=4, mini_steps=4, lr=3e-3, **overrides)
    trainer = GRPOTrainer(policy, AdditionTask(tokenizer), HFEngine(policy), config)
    return trainer.train()


def test_r2_has_zero_drift_in_every_mini_step(trained: tuple[torch.nn.Module, object]) -> None:
    history = _run(trained, "R2")
    for record in history:
        assert record["drift_per_mini_step"] == [0.0] * 4
        assert record["fallback_rows"] == 0


def test_r3_matches_engine_routes_in_every_mini_step(trained: tuple[torch.nn.Module, object]) -> None:
    history = _run(trained, "R3")
    for record in history:
        assert record["rollout_routing_disagreement"] == 0.0
        assert record["rollout_disagreement_per_mini_step"] == [0.0] * 4
        assert record["fallback_rows"] > 0  # the last token of each sequence has no engine route
        # router_replay/... metrics of the step (docs/metrics.md): every replayed row compared, none given back
        assert record["router_replay/compared_rows"] == record["router_replay/replayed_rows"] > 0
        assert record["router_replay/forced_disagree_rows"] == record["router_replay/disagree_rows"]
        assert 0.0 <= record["router_replay/disagree_rate"] <= 1.0


def test_off_drifts_once_weights_change(trained: tuple[torch.nn.Module, object]) -> None:
    history = _run(trained, "off")
    drift = [d for record in history for d in record["drift_per_mini_step"]]
    assert drift[0] == 0.0, "the first mini-step runs before any update"
    assert max(drift[1:]) > 0.0, "routing must drift once the weights change"
    # bf16 engine vs fp32 trainer: a tiny batch of a 16-expert model may see no flip in one step,
    # but over the run the trainer must disagree with the engine somewhere (R3 makes it exactly 0)
    assert sum(record["rollout_routing_disagreement"] for record in history) > 0, "bf16 engine vs fp32 trainer"


def test_kl_reference_and_log(trained: tuple[torch.nn.Module, object], tmp_path: Path) -> None:
    from routereplay.rl.tasks import AdditionTask

    model, tokenizer = trained
    policy = copy.deepcopy(model)
    config = GRPOConfig(mode="R3", steps=1, prompts_per_step=4, group_size=2, mini_steps=2, kl_coef=0.1)
    with pytest.warns(UserWarning, match="reference_routing='natural' under R3"):
        trainer = GRPOTrainer(
            policy, AdditionTask(tokenizer), HFEngine(policy), config, log_path=tmp_path / "log.jsonl"
        )
    trainer.train()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["mode"] == "R3"
    replayed = GRPOConfig(
        mode="R3", steps=1, prompts_per_step=4, group_size=2, mini_steps=2, kl_coef=0.1, reference_routing="replay"
    )
    other = copy.deepcopy(model)
    GRPOTrainer(other, AdditionTask(tokenizer), HFEngine(other), replayed).train()


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="R2 and R3 at once is contradictory"):
        GRPOConfig(mode="R2+R3")
    with pytest.raises(ConfigError, match="must be one of off, R2, R3"):
        GRPOConfig(mode="R4")
    with pytest.raises(ConfigError, match="must divide the batch"):
        GRPOConfig(prompts_per_step=3, group_size=1, mini_steps=2)


@pytest.mark.parametrize("mode", ["off", "R2", "R3"])
def test_train_cli_two_steps(
    mode: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    args = short_train("--mode", mode)
    plot = tmp_path / "steps.png"
    assert main([*args, "--json", "--plot", str(plot), "--log", str(tmp_path / "log.jsonl")]) == EXIT_OK
    history = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in history] == [0, 1] and {r["mode"] for r in history} == {mode}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3, "a run record, then one line per step"


def test_tensorboard_needs_the_package(trained: tuple[torch.nn.Module, object], tmp_path: Path) -> None:
    import importlib.util

    from routereplay.rl.tasks import AdditionTask

    model, tokenizer = trained
    model = copy.deepcopy(model)
    config = GRPOConfig(mode="off", steps=1, prompts_per_step=2, group_size=2, mini_steps=1)
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            GRPOTrainer(model, AdditionTask(tokenizer), HFEngine(model), config, tensorboard_dir=tmp_path / "tb")
    else:  # installed: scalars land in the folder
        trainer = GRPOTrainer(model, AdditionTask(tokenizer), HFEngine(model), config, tensorboard_dir=tmp_path / "tb")
        trainer.train()
        assert any((tmp_path / "tb").iterdir())
