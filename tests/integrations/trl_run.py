"""A real TRL `GRPOTrainer` run on the tiny demo model, on CPU, with router replay: shared by the TRL tests.

`addition_dataset` is a local `datasets.Dataset` of addition prompts (nothing downloaded) with their
answers, `addition_reward` scores completions with `AdditionTask.reward` (the exact sum, then EOS), and
`run` trains a copy of the model for a few optimisation steps with `RouterReplayGRPOTrainer` under
one torch thread, returning the trainer (its `router_replay.records` and TRL's `state.log_history`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from routereplay.rl.tasks import AdditionTask, Problem
from routereplay.threads import ThreadPolicy

PROMPTS = 16


def addition_dataset(tokenizer: Any, count: int = PROMPTS, seed: int = 1) -> Any:
    from datasets import Dataset

    problems = AdditionTask(tokenizer).problems(count, seed=seed)
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])


def addition_reward(tokenizer: Any) -> Any:
    """A TRL reward function: 1.0 for the exact sum followed by EOS (`AdditionTask.reward`), else 0.0."""
    task = AdditionTask(tokenizer)

    def reward(prompts: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any) -> list[float]:
        return [task.reward(Problem(p, a), ids) for p, ids, a in zip(prompts, completion_ids, answer, strict=True)]

    return reward


def grpo_config(output_dir: Path, **overrides: Any) -> Any:
    """A GRPOConfig for a few tiny CPU steps (fp32, no reports, no checkpoints); `overrides` replace fields."""
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 0,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 4,
        "max_steps": 3,
        "learning_rate": 3e-3,
        "num_iterations": 2,
        "gradient_checkpointing": False,
    }
    settings.update(overrides)
    return GRPOConfig(**settings)


def run(model: torch.nn.Module, tokenizer: Any, output_dir: Path, router_replay: str | None, **overrides: Any) -> Any:
    """Train a copy of `model` with `RouterReplayGRPOTrainer` (one torch thread); returns the trainer."""
    from routereplay.integrations.trl import RouterReplayGRPOTrainer

    reference_routing = overrides.pop("reference_routing", None)
    with ThreadPolicy(threads=1).applied():
        trainer = RouterReplayGRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=addition_reward(tokenizer),
            args=grpo_config(output_dir, **overrides),
            train_dataset=addition_dataset(tokenizer),
            processing_class=tokenizer,
            router_replay=router_replay,
            reference_routing=reference_routing,
        )
        trainer.train()
    return trainer


def updates(trainer: Any) -> list[Any]:
    return [r for r in trainer.router_replay.records if r.phase == "update"]


def old_passes(trainer: Any) -> list[Any]:
    return [r for r in trainer.router_replay.records if r.phase == "old"]


def logged(trainer: Any, name: str) -> list[float]:
    """Every value TRL logged for metric `name` (one per logging step that had it)."""
    return [entry[name] for entry in trainer.state.log_history if name in entry]
