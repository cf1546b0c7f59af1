"""The addition task: its problems, rewards and the sampling params engines answer it with."""

from __future__ import annotations

import pytest

from routereplay.rl.tasks import AdditionTask, build_tokenizer

pytestmark = pytest.mark.hf


def test_sampling_stops_at_the_tasks_eos_and_pads_with_its_pad_id() -> None:
    task = AdditionTask(build_tokenizer())
    params = task.sampling(max_new_tokens=3, seed=5, temperature=0.7)
    assert (params.eos_token_id, params.pad_token_id) == (task.eos_token_id, task.pad_token_id) == (1, 0)
    assert (params.max_new_tokens, params.seed, params.temperature, params.top_p) == (3, 5, 0.7, 1.0)


def test_the_exact_sum_then_eos_is_the_only_reward() -> None:
    task = AdditionTask(build_tokenizer())
    (problem,) = task.problems(1, seed=0)
    answer = task.encode(problem.answer)
    assert task.reward(problem, [*answer, task.eos_token_id]) == 1.0
    assert task.reward(problem, answer) == 0.0  # no EOS
    assert task.reward(problem, [*task.encode(problem.answer + "1"), task.eos_token_id]) == 0.0
