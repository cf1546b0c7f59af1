"""The demo model's training schedule accepts every step count (found while timing issue 11 item 25)."""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import ConfigError
from routereplay.rl.model import _warmup_fraction, train_demo_model


@pytest.mark.parametrize("steps", range(1, 41))
def test_one_cycle_schedule_never_divides_by_zero(steps: int) -> None:
    """Error that is not a RouteReplayError: `train_demo_model(steps=10)` raised ZeroDivisionError inside
    OneCycleLR (its warm-up ends at pct_start * steps - 1 = 0); the warm-up fraction is nudged there."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1.0, total_steps=steps, pct_start=_warmup_fraction(steps)
    )
    for _ in range(steps - 1):
        optimizer.step()
        schedule.step()


@pytest.mark.hf
def test_train_demo_model_with_ten_steps() -> None:
    """Error that is not a RouteReplayError: the exact step count that crashed now trains."""
    model, _ = train_demo_model("qwen3_moe", steps=10, batch=2, num_hidden_layers=1, num_experts=8)
    assert not model.training


@pytest.mark.parametrize("steps", [0, -3])
def test_bad_step_count_is_refused(steps: int) -> None:
    """Error that is not a RouteReplayError: steps < 1 failed inside torch's scheduler; it is refused up front."""
    with pytest.raises(ConfigError, match=r"steps=.* must be integers >= 1"):
        train_demo_model("qwen3_moe", steps=steps)
