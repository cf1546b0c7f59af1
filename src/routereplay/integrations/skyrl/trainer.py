"""SkyRL 0.4.0's `RayPPOTrainer` with the token check's digest column: `trainer_class`, `RouteReplayTrainerMixin`.

SkyRL's `TrainingInputBatch` has no field that ties `rollout_expert_indices` to `sequences`, so the worker cannot
tell rows rotated within a trajectory, or two equal-length trajectories swapped, from the rows the generator
returned. This trainer adds one, from the generator's own output, at the two seams a batch goes through:

- `convert_to_training_input`: SkyRL's, then the `DIGEST_KEY` column (`digest.generator_digests`: per trajectory,
  its captured token ids with its route rows as the generator returned them; SkyRL's batch padding gets an empty
  row, which the worker does not check). SkyRL stages, slices and chunks it with every other field, so each
  update's `forward_backward` receives it with its samples;
- `fwd_logprobs_values_reward` / `_execute_forward_pass`: SkyRL's old-log-prob pass selects only the fields it
  names (`fwd_keys`); the policy's forward gets the column too (on a copy of SkyRL's selection), so the first
  pass that replays the routes is checked, on every mini-batch of `recompute_old_logprobs_per_minibatch`.

Nothing else changes: both methods call SkyRL's own. `python -m routereplay.integrations.skyrl.entrypoint` builds
this trainer (`entrypoint.experiment_class`); a trainer of your own gets the column by mixing
`RouteReplayTrainerMixin` in before its SkyRL base class. Without the column an R3 worker refuses the batch
unless opted out (`token_check.py`). Nothing here imports SkyRL until `trainer_class()` runs.
"""

from __future__ import annotations

import functools
from typing import Any

from routereplay.errors import MissingDependencyError
from routereplay.integrations.skyrl.digest import DIGEST_KEY, digest_column, generator_digests

TRAINER_NAME = "RouteReplayPPOTrainer"


class RouteReplayTrainerMixin:
    """The routereplay part of the trainer, mixed in before SkyRL's `RayPPOTrainer` (or a subclass of it)."""

    _routereplay_digests: Any = None

    def convert_to_training_input(self, generator_output: Any, uids: list[str]) -> Any:
        """SkyRL's batch of `generator_output`, with the digest column when the output carries routes."""
        batch = super().convert_to_training_input(generator_output, uids)  # type: ignore[misc]
        digests = generator_digests(generator_output)
        if digests is not None:
            batch[DIGEST_KEY] = digest_column(digests, batch.batch_size)
        return batch

    def fwd_logprobs_values_reward(self, training_input: Any) -> Any:
        """SkyRL's old-log-prob pass, the batch's digest column held for the policy's forward."""
        self._routereplay_digests = training_input.get(DIGEST_KEY)
        try:
            return super().fwd_logprobs_values_reward(training_input)  # type: ignore[misc]
        finally:
            self._routereplay_digests = None

    def _execute_forward_pass(self, model: str, data_fwd_pass: Any, key: str, mini_batch_boundaries: Any) -> Any:
        """SkyRL's forward dispatch; the policy's selection carries the digest column beside its routes."""
        digests = self._routereplay_digests
        if model == "policy" and digests is not None and data_fwd_pass.get("rollout_expert_indices") is not None:
            data_fwd_pass = data_fwd_pass.select(keys=list(data_fwd_pass.keys()))
            data_fwd_pass[DIGEST_KEY] = digests
        return super()._execute_forward_pass(model, data_fwd_pass, key, mini_batch_boundaries)  # type: ignore[misc]


@functools.cache
def trainer_class() -> type:
    """SkyRL's `RayPPOTrainer` with `RouteReplayTrainerMixin` (imports SkyRL)."""
    try:
        from skyrl.train.trainer import RayPPOTrainer
    except ImportError as err:
        raise MissingDependencyError(
            f"routereplay's SkyRL trainer subclasses SkyRL's RayPPOTrainer, which did not import ({err}); install "
            "skyrl 0.4.x beside routereplay (make .venv-skyrl for the CPU test venv)"
        ) from err
    return type(
        TRAINER_NAME,
        (RouteReplayTrainerMixin, RayPPOTrainer),
        {"__doc__": "SkyRL's RayPPOTrainer with routereplay's digest column (routereplay.integrations.skyrl)."},
    )


__all__ = ["TRAINER_NAME", "RouteReplayTrainerMixin", "trainer_class"]
