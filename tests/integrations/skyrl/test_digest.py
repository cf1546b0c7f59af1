"""The digest column (`digest.py`) without SkyRL: the trainer's digests of a generator output equal the rollout
side's digests of the same trajectories (`route_digests` of `RolloutRoutes`' merged traces), whatever dtype and
row order the generator used; they differ for rows rotated or swapped; the column round-trips.

Legend: N tokens, C captured rows, A all hidden layers, K top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import RowCountError
from routereplay.integrations.skyrl import RolloutRoutes, RouteGeometry, route_digests
from routereplay.integrations.skyrl.digest import DIGEST_BYTES, checked_digests, digest_column, generator_digests

GEOMETRY = RouteGeometry(num_experts=300, num_layers=3, top_k=2, moe_layers=(1, 2))
SAMPLES = {"a": ([1, 2, 3], [4, 5, 6]), "b": ([7, 8, 9], [10, 11, 12])}  # equal lengths


def routes(rows: int, seed: int) -> np.ndarray:
    """int32 (C, A=3, K=2): dense layer 0 zero, distinct ids in [0, 300) per MoE row, unsorted."""
    rng = np.random.default_rng(seed)
    out_CAK = np.zeros((rows, 3, 2), dtype=np.int32)
    for layer in (1, 2):
        out_CAK[:, layer] = np.argsort(rng.random((rows, 300)), axis=1)[:, :2]
    return out_CAK


def generator_output() -> tuple[dict[str, Any], RolloutRoutes]:
    rollout = RolloutRoutes(GEOMETRY)
    arrays = []
    for seed, (sample, (prompt, response)) in enumerate(SAMPLES.items()):
        rows_CAK = routes(len(prompt) + len(response) - 1, seed)
        rollout.add_generation(sample, prompt, response, rows_CAK, prompt_start=0)
        arrays.append(rows_CAK.astype(np.int16))  # SkyRL's generator compacts per call; the set is what counts
    output = {
        "prompt_token_ids": [p for p, _ in SAMPLES.values()],
        "response_ids": [r for _, r in SAMPLES.values()],
        "rollout_expert_indices": arrays,
    }
    return output, rollout


def test_the_trainers_digests_equal_the_rollout_sides() -> None:
    output, rollout = generator_output()
    assert generator_digests(output) == route_digests(rollout.traces(list(SAMPLES)), GEOMETRY)


def test_rows_rotated_or_swapped_change_the_digest() -> None:
    output, _ = generator_output()
    digests = generator_digests(output) or []
    rotated = dict(output, rollout_expert_indices=[np.roll(output["rollout_expert_indices"][0], 1, axis=0),
                                                   output["rollout_expert_indices"][1]])  # fmt: skip
    swapped = dict(output, rollout_expert_indices=output["rollout_expert_indices"][::-1])
    assert (generator_digests(rotated) or [])[0] != digests[0]
    assert generator_digests(swapped) != digests


def test_no_routes_no_digests_and_too_many_rows_refused() -> None:
    output, _ = generator_output()
    assert generator_digests(dict(output, rollout_expert_indices=None)) is None
    long = dict(output, rollout_expert_indices=[routes(7, 0), routes(5, 1)])
    with pytest.raises(RowCountError, match=r"trajectory 0: rollout_expert_indices of shape \(7, 3, 2\) for 6 tokens"):
        generator_digests(long)


def test_the_column_round_trips_with_zero_padding_rows() -> None:
    output, _ = generator_output()
    digests = generator_digests(output) or []
    column = digest_column(digests, batch=4)  # SkyRL pads the batch to a multiple of the DP size
    assert column.dtype == torch.uint8 and column.shape == (4, DIGEST_BYTES)
    assert checked_digests(column, 4) == [*digests, bytes(DIGEST_BYTES), bytes(DIGEST_BYTES)]
