"""GRPO with the colocated vLLM engine (issue 12 item 3): weights synced every step, R3 exact, CLI paths.

The model is a sibling of the demo model that vLLM's CPU backend serves (head_dim 64 instead of 16),
trained briefly on the addition task and saved with its tokenizer, so `routereplay train --model`
can load it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.cli.train import VLLM_CLI_LOGGING
from routereplay.rl.grpo import GRPOConfig, GRPOTrainer

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]


def test_grpo_r3_with_colocated_vllm_syncs_every_step(servable: tuple[torch.nn.Module, Any, Path]) -> None:
    """Silent misroute (issue 12 item 3): GRPO syncs the trainer's weights into the colocated vLLM before
    each step's rollouts (the engine's policy version is the step), and under R3 the trainer routes
    exactly like vLLM on every routed row, in the old-log-prob pass and every mini-step."""
    from routereplay.engines.vllm.colocated import VLLMEngine
    from routereplay.rl.tasks import AdditionTask

    model, tokenizer, _ = servable
    policy = copy.deepcopy(model)
    config = GRPOConfig(mode="R3", steps=2, prompts_per_step=4, group_size=2, mini_steps=2, lr=3e-3)
    with VLLMEngine(policy, tokenizer, policy_version=None) as engine:
        history = GRPOTrainer(policy, AdditionTask(tokenizer), engine, config).train()
        assert engine.last_sync is not None and engine.last_sync.policy_version == 1 == engine.policy_version
    for record in history:
        assert record["rollout_routing_disagreement"] == 0.0
        assert record["rollout_disagreement_per_mini_step"] == [0.0, 0.0]
        assert record["fallback_rows"] > 0  # the last token of each sequence has no engine route


def test_train_cli_engine_vllm_without_url_runs_colocated(
    servable: tuple[torch.nn.Module, Any, Path], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent misroute (issue 12 item 3): `routereplay train --engine vllm --model DIR` (no --url) trains
    with the colocated vLLM; under R3 its routes are replayed exactly. stdout holds only the JSON (vLLM's
    log goes to stderr), captured at the file-descriptor level as vLLM writes there."""
    for name in VLLM_CLI_LOGGING:  # the command sets them for its process; restored after the test
        monkeypatch.delenv(name, raising=False)
    args = ["train", "--engine", "vllm", "--model", str(servable[2]), "--mode", "R3", "--steps", "1"]
    args += ["--prompts-per-step", "4", "--group-size", "2", "--mini-steps", "2", "--json"]
    assert main(args) == EXIT_OK
    history = json.loads(capfd.readouterr().out)
    assert len(history) == 1 and history[0]["rollout_routing_disagreement"] == 0.0


def test_train_cli_refuses_the_unservable_demo_model_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Misleading message (issue 12 item 3): the DeepSeek-V3 demo model has no variant vLLM's CPU backend
    serves (its MLA needs kv_lora_rank 512); `--engine vllm` without --url says so and what to pass
    instead, before training anything."""
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path / "cache"))
    for name in VLLM_CLI_LOGGING:
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--engine", "vllm", "--arch", "deepseek_v3", "--steps", "1"]) == EXIT_ERROR
    message = capsys.readouterr().err
    assert "--arch deepseek_v3" in message and "kv_lora_rank 512" in message and "--model" in message
    assert not (tmp_path / "cache").exists(), "the demo model was trained before the refusal"


def test_train_cli_serves_the_demo_models_servable_variant(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent misroute (issue 12 item 3): `train --engine vllm` on the demo model trains and caches its
    vLLM-servable variant (head_dim 64, its own cache key, never the built-in engine's model) and
    replays vLLM's routes exactly under R3."""
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path / "cache"))
    args = ["train", "--engine", "vllm", "--mode", "R3", "--steps", "1", "--train-steps", "20"]
    args += ["--prompts-per-step", "2", "--group-size", "2", "--mini-steps", "1", "--json"]
    assert main(args) == EXIT_OK
    history = json.loads(capfd.readouterr().out)
    assert len(history) == 1 and history[0]["rollout_routing_disagreement"] == 0.0
    cached = [p.name for p in (tmp_path / "cache").iterdir()]
    assert cached and all("head_dim64" in name for name in cached), cached


def test_train_cli_url_says_remote_weights_are_not_synced(
    servable: tuple[torch.nn.Module, Any, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 12 item 3): with --url the remote server's weights stay fixed; the command
    says so and names how to get synced weights (drop --url), even when the server is unreachable."""
    url = "http://127.0.0.1:9"  # the discard port: nothing answers
    args = ["train", "--engine", "vllm", "--url", url, "--model", str(servable[2]), "--steps", "1"]
    assert main(args) == EXIT_ERROR
    message = capsys.readouterr().err
    assert f"--url {url}: the remote vllm server's weights are not synced" in message and "drop --url" in message
