"""R3's token check on SkyRL's FSDP worker: on by default, one named per-worker opt-out, every unchecked sample
counted.

The worker checks a batch's packed `rollout_expert_indices` against its `sequences` with the digest column
(`digest.DIGEST_KEY`) before it replays anything (`packed_routes.routes_of_packed(digests=)`): routereplay's
trainer (`trainer.py`, which `python -m routereplay.integrations.skyrl.entrypoint` runs) adds that column from
the generator's own output, so with SkyRL's generator or a generator built on `RolloutRoutes` the check is on
with no user code. A batch without the column (SkyRL's own `RayPPOTrainer`, or a trainer of the user's that does
not add it) has nothing that ties its rows to its tokens: the worker refuses it (`UncheckedRoutesError`) unless
that worker's environment has `UNCHECKED_ENV=1`; then it replays the batch unchecked, as SkyRL's Megatron path
does, counts every such sample (`TokenCheckCounts`: `routereplay_stats()`, and `router_replay/unchecked_samples`
in the update metrics SkyRL logs under `policy/`), and logs a warning once per worker call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from routereplay.errors import UncheckedRoutesError
from routereplay.integrations.opt_out import env_opt_out
from routereplay.integrations.skyrl.digest import DIGEST_KEY

UNCHECKED_ENV = "ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES"
METRIC_PREFIX = "router_replay/"  # the metric names of every routereplay integration

logger = logging.getLogger("routereplay.integrations.skyrl")


def unchecked_opt_out() -> bool:
    """Whether this worker opted out of the token check of digest-less batches (`UNCHECKED_ENV`)."""
    return env_opt_out(
        UNCHECKED_ENV, on=f"replay batches without the {DIGEST_KEY} column unchecked, counted", off="refuse them"
    )


def unchecked_refusal(samples: int, where: str) -> UncheckedRoutesError:
    """R3 with a batch that carries no digest column: what, where, how to fix."""
    return UncheckedRoutesError(
        f"R3: the {where} pass got rollout_expert_indices for {samples} trajectories without the '{DIGEST_KEY}' "
        "column, so nothing ties their rows to their tokens (rows shifted within a trajectory, or equal-length "
        "trajectories swapped, would replay silently onto the wrong tokens). Fix: launch with python -m "
        "routereplay.integrations.skyrl.entrypoint, or build your trainer with routereplay's trainer_class() "
        "(it adds the column from the generator output); or opt this worker out with "
        f"{UNCHECKED_ENV}=1 in its environment: it then replays such batches unchecked and counts them"
    )


@dataclass(slots=True)
class TokenCheckCounts:
    """Trajectories this worker checked against the digest column, and those it replayed unchecked (opted out)."""

    checked_samples: int = 0
    unchecked_samples: int = 0

    def add(self, samples: int, *, checked: bool, where: str) -> None:
        if checked:
            self.checked_samples += samples
            return
        self.unchecked_samples += samples
        logger.warning(
            "routereplay R3: %d trajectories of a %s pass replayed without the token check (%s=1; %d so far on "
            "this worker)",
            samples,
            where,
            UNCHECKED_ENV,
            self.unchecked_samples,
        )


__all__ = [
    "METRIC_PREFIX",
    "UNCHECKED_ENV",
    "TokenCheckCounts",
    "unchecked_opt_out",
    "unchecked_refusal",
]
