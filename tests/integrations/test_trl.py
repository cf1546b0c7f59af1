"""TRL's GRPOTrainer with router replay (issue 14): real TRL 1.16 runs on CPU with the tiny demo model.

Every run trains a copy of one small demo sibling for a few optimisation steps on a local dataset of
addition prompts, with `model.generate` rollouts (`use_vllm=False`; the colocated vLLM runs are in
`test_trl_vllm.py`). Learning rate 3e-3 and `num_iterations=2` make the weights move between the
old-log-prob pass and the second optimisation step on each generation batch, which is where natural
routing drifts.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from routereplay.errors import ConfigError, MissingDependencyError, TokenMismatchError, UnsupportedByEngineError
from tests.conftest import SharedModels
from tests.integrations.trl_run import grpo_config, logged, old_passes, run, updates

pytestmark = [pytest.mark.trl, pytest.mark.hf]

TRAIN_STEPS = 150  # the demo sibling earns some reward after this (advantages are not all zero)


@pytest.fixture(scope="module")
def demo(shared_models: SharedModels) -> tuple[torch.nn.Module, Any]:
    model, tokenizer = shared_models.trained("qwen3_moe", steps=TRAIN_STEPS, num_experts=16, num_hidden_layers=3)
    tokenizer.padding_side = "left"  # TRL pads prompts on the left
    return model, tokenizer


def test_r2_drift_is_exactly_zero_where_natural_routing_drifts(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Silent drift (issue 14, R2): between TRL's old-log-prob pass and a later optimisation step the
    weights change, so natural routing picks other experts for some (token, layer) rows; under R2 every
    optimisation step replays the old pass's routes, forward and backward, so drift is exactly 0,
    every attended row is forced and none falls back. The metrics reach TRL's own log."""
    natural = run(*demo, tmp_path / "off", None)
    assert max(r.drift for r in updates(natural)) > 0.01
    assert max(logged(natural, "router_replay/drift")) > 0.01

    replayed = run(*demo, tmp_path / "r2", "R2")
    assert [r.drift for r in updates(replayed)] == [0.0] * len(updates(replayed)) != []
    assert all(r.replayed_rows > 0 and r.fallback_rows == 0 for r in updates(replayed))
    assert logged(replayed, "router_replay/drift") == [0.0, 0.0, 0.0]
    assert logged(replayed, "router_replay/fallback_rows") == [0.0, 0.0, 0.0]
    # disagreement (docs/metrics.md): the update's live routers against the forced old-pass routes, where the
    # natural run drifts; none before the first optimizer step, and no threshold gives rows back
    disagree = logged(replayed, "router_replay/disagree_rate")
    assert len(disagree) == 3 and disagree[0] == 0.0 and max(disagree) > 0.0, disagree
    assert logged(replayed, "router_replay/forced_disagree_rows") == logged(replayed, "router_replay/disagree_rows")


def test_r3_replays_the_generation_routes_on_every_routed_row(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Engine mismatch (issue 14, R3): the routes `model.generate` used travel with the completions
    (prompts left-padded, completions right-padded, TRL's truncated completions masked) and replay in
    the old-log-prob pass and every optimisation step: disagreement with them is exactly 0 on every
    row they route, while natural routing departs from them once the weights moved. The last sampled
    token, never fed to generate, has no route and falls back live (counted)."""
    natural = run(*demo, tmp_path / "off", None, mask_truncated_completions=True)
    assert max(r.engine_disagreement for r in updates(natural)) > 0.01

    replayed = run(*demo, tmp_path / "r3", "R3", mask_truncated_completions=True)
    records = replayed.router_replay.records
    assert [r.engine_disagreement for r in records] == [0.0] * len(records) != []
    assert all(r.fallback_rows > 0 for r in updates(replayed))  # one last token per completion and layer
    assert logged(replayed, "router_replay/engine_disagreement") == [0.0, 0.0, 0.0]
    assert logged(replayed, "router_replay/old_engine_disagreement") == [0.0, 0.0]


@pytest.mark.parametrize("router_replay", [None, "R2"])
def test_gradient_checkpointing_on_and_off_route_the_same(
    demo: tuple[Any, Any], tmp_path: Path, router_replay: str | None
) -> None:
    """Recompute misroute (issue 14): with gradient checkpointing the backward recomputes every router
    inside the update's context, and the recompute reuses its forward's routes (recorded or replayed),
    so a checkpointed run routes every pass exactly like a plain one and ends with the same weights."""
    plain = run(*demo, tmp_path / "plain", router_replay, gradient_checkpointing=False)
    checkpointed = run(*demo, tmp_path / "checkpointed", router_replay, gradient_checkpointing=True)
    assert [r.routes_digest for r in checkpointed.router_replay.records] == [
        r.routes_digest for r in plain.router_replay.records
    ]
    assert all(r.recompute_calls == 0 for r in updates(plain))
    assert all(r.recompute_calls == 3 for r in updates(checkpointed))  # one per MoE layer, inside the context
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("router_replay", ["R2", "R3"])
def test_steps_per_generation_and_num_iterations_move_routes_with_their_rows(
    demo: tuple[Any, Any], tmp_path: Path, router_replay: str
) -> None:
    """Misaligned rows (issue 14): with steps_per_generation=2 and num_iterations=2 TRL shuffles each
    generation batch and splits it into micro-batches reused twice; the routes ride in the batch dict,
    so every micro-batch replays its own rows' routes (the ids they were laid out for are checked at
    every update) and R2 drift / R3 disagreement stay exactly 0 over all four updates per generation."""
    trainer = run(*demo, tmp_path, router_replay, per_device_train_batch_size=2, steps_per_generation=2, max_steps=4)
    records = updates(trainer)
    assert len(records) == 4 and len(old_passes(trainer)) == 1  # one generation batch, four optimisation steps
    measured = [r.drift for r in records] if router_replay == "R2" else [r.engine_disagreement for r in records]
    assert measured == [0.0] * 4
    assert logged(trainer, "router_replay/old_pass_forced") == [0.0]  # TRL ran the pass itself


def test_r2_forces_the_old_log_prob_pass_trl_skips(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Nothing to replay (issue 14, R2): with generation and optimisation aligned (num_iterations=1,
    steps_per_generation = gradient_accumulation_steps) TRL skips its old-log-prob pass; R2 runs it
    (no grad, chunked like TRL's), records its routes and hands its log-probs to TRL as the old ones."""
    trainer = run(*demo, tmp_path, "R2", num_iterations=1)
    assert logged(trainer, "router_replay/old_pass_forced") == [1.0, 1.0, 1.0]
    assert [r.drift for r in updates(trainer)] == [0.0, 0.0, 0.0]


def test_reference_model_replays_the_policy_routes(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Implicit reference routing (issue 14): with beta != 0 TRL scores a reference model; under R2 and
    reference_routing='replay' it replays the routes the policy's old-log-prob pass recorded, row for
    row, and with beta != 0 the choice must be explicit."""
    import transformers

    model, tokenizer = demo
    folder = tmp_path / "checkpoint"  # TRL builds the reference model from the policy's name_or_path
    model.save_pretrained(folder)
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = run(saved, tokenizer, tmp_path / "run", "R2", beta=0.04, reference_routing="replay")
    reference = trainer.router_replay.reference
    assert reference is not None and reference.stats.replayed_rows > 0 and reference.stats.fallback_rows == 0
    assert logged(trainer, "kl")  # TRL's KL term ran

    with pytest.raises(ConfigError, match=r"beta=0.04 with router_replay='R3': say how the reference model routes"):
        run(saved, tokenizer, tmp_path / "unsaid", "R3", beta=0.04)


def test_bad_settings_are_refused_with_the_fix(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Bad input (issue 14): an unknown router_replay, reference replay without replay, R3 with a
    generation path that returns no routes, each refused before training with what to do instead."""
    with pytest.raises(ConfigError, match=r"router_replay='R4': pass 'R2'"):
        run(*demo, tmp_path, "R4")
    with pytest.raises(ConfigError, match=r"reference_routing='replay' with router_replay=None"):
        run(*demo, tmp_path, None, reference_routing="replay")
    with pytest.raises(UnsupportedByEngineError, match=r"vllm_mode='server': TRL's VLLMClient keeps only"):
        run(*demo, tmp_path, "R3", use_vllm=True, vllm_mode="server")


def test_r3_with_rollout_func_is_refused(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Unrouted tokens (issue 14, R3): a custom rollout_func returns completions no generate call
    routed here, so R3 is refused at construction rather than replaying nothing."""
    from routereplay.integrations.trl import RouterReplayGRPOTrainer
    from tests.integrations.trl_run import addition_dataset, addition_reward

    model, tokenizer = demo
    with pytest.raises(UnsupportedByEngineError, match=r"router_replay='R3' with rollout_func"):
        RouterReplayGRPOTrainer(
            model=copy.deepcopy(model),  # TRL patches the model's forward: never hand it the shared one
            reward_funcs=addition_reward(tokenizer),
            args=grpo_config(tmp_path),
            train_dataset=addition_dataset(tokenizer),
            processing_class=tokenizer,
            rollout_func=lambda prompts, trainer: {},
            router_replay="R3",
        )


def test_rows_moved_without_their_routes_are_refused(demo: tuple[Any, Any], tmp_path: Path) -> None:
    """Misaligned rows (issue 14): a training batch whose rows were reordered without the routes (a
    subclass that shuffles some keys only) holds other ids than its routes were laid out for; the
    update refuses it, naming the row, instead of replaying one completion's routes on another."""
    from routereplay.integrations.trl.state import IDS_KEY, OLD_ROUTES_KEY, check_rows

    trainer = run(*demo, tmp_path, "R2", max_steps=1)
    batch = dict(trainer._buffered_inputs[0])
    check_rows(batch)  # as TRL moved it: aligned
    ids_BS = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    first, second = next((i, j) for i in range(4) for j in range(i + 1, 4) if not torch.equal(ids_BS[i], ids_BS[j]))
    order = list(range(4))
    order[first], order[second] = second, first
    batch["prompt_ids"], batch["completion_ids"] = batch["prompt_ids"][order], batch["completion_ids"][order]
    assert batch[OLD_ROUTES_KEY].shape[0] == batch[IDS_KEY].shape[0] == 4  # the routes stayed in place
    with pytest.raises(TokenMismatchError, match=rf"row {first} \(2 of 4 rows differ\)"):
        trainer.router_replay.open_update(batch)


def test_missing_trl_names_the_extra() -> None:
    """Unhelpful ImportError (issue 14): without TRL, importing the trainer says which extra to install; the
    parts that need no TRL (the batch layout, the trainer's state) still import."""
    script = (
        "import sys; sys.modules['trl'] = None\n"
        "import routereplay.integrations.trl.layout, routereplay.integrations.trl.state\n"
        "try:\n    from routereplay.integrations.trl import RouterReplayGRPOTrainer\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.startswith(MissingDependencyError.__name__)
    assert "pip install 'routereplay[trl]'" in result.stdout
