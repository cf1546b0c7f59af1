"""The digest column that ties SkyRL's packed `rollout_expert_indices` to the tokens they were captured for.

SkyRL 0.4.0's batch carries a trajectory's route rows (`rollout_expert_indices`, a `PackedTensor`) and its token
ids (`sequences`) side by side, and nothing says the two still belong together: rows rotated within a
trajectory, or two equal-length trajectories' rows swapped, reach the worker with every shape intact. So the
trainer side (`trainer.py`) computes, from the generator's own output, one digest per trajectory and adds it to
SkyRL's `TrainingInputBatch` as a tensor field (`DIGEST_KEY`, uint8 `[batch, 16]`): SkyRL slices, pads, stages
and chunks it with every other field, and the policy worker recomputes it from the batch it was given
(`packed_routes.routes_of_packed(digests=)`) before replaying anything.

A digest is the first 16 bytes of a SHA-256 over a trajectory's captured token ids (int64) and its route rows
as SkyRL carries them (every hidden layer, the dense ones as the generator wrote them, each row sorted: routes
are sets), so it needs no model geometry on the trainer side. `route_digests` gives the same digests from
routereplay's merged traces (`RolloutRoutes`), through `generator_routes`. A trajectory without a captured row
(SkyRL's batch padding: `router_padding_mask` True everywhere) replays nothing and is not checked.

Legend: B trajectories, C captured rows of one trajectory, L every hidden layer, K top-k.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.errors import BatchFieldError, RowCountError
from routereplay.integrations.skyrl.rollout import generator_routes
from routereplay.integrations.verl import RouteGeometry
from routereplay.trace.route_trace import RouteTrace

if TYPE_CHECKING:
    import torch

DIGEST_KEY = "routereplay_route_digests"  # TrainingInputBatch field: uint8 [batch, DIGEST_BYTES]
DIGEST_TAG = b"routereplay.skyrl.packed.v2"
DIGEST_BYTES = 16


def sample_digest(ids_C: np.ndarray, rows_CLK: np.ndarray) -> bytes:
    """16 bytes of SHA-256 over a trajectory's captured token ids and their route rows (each row sorted)."""
    h = hashlib.sha256(DIGEST_TAG)
    h.update(np.asarray(rows_CLK.shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(ids_C, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(np.sort(rows_CLK, axis=-1), dtype="<i4").tobytes())
    return h.digest()[:DIGEST_BYTES]


def route_digests(traces: Sequence[RouteTrace], geometry: RouteGeometry) -> list[bytes]:
    """Per merged trace (`RolloutRoutes.traces`), the digest of its SkyRL generator form (`generator_routes`)
    with the token ids the trace names, in batch order: what `routes_of_packed(..., digests=)` checks."""
    arrays = generator_routes(traces, geometry)
    digests = []
    for index, (trace, rows_CLK) in enumerate(zip(traces, arrays, strict=True)):
        if trace.token_ids is None:
            raise BatchFieldError(
                f"trajectory {index}: the trace names no token ids; take the merged traces of RolloutRoutes, which "
                "name their tokens"
            )
        digests.append(sample_digest(trace.token_ids[: len(rows_CLK)], rows_CLK))
    return digests


def generator_digests(output: Mapping[str, Any]) -> list[bytes] | None:
    """Per trajectory of a SkyRL `GeneratorOutput`, the digest of its captured prefix (`prompt_token_ids` +
    `response_ids`, the first `len(rollout_expert_indices[i])` of them) with those route rows; None when the
    output carries no routes."""
    routes = output.get("rollout_expert_indices")
    if routes is None:
        return None
    prompts, responses = output["prompt_token_ids"], output["response_ids"]
    if not (len(routes) == len(prompts) == len(responses)):
        raise BatchFieldError(
            f"GeneratorOutput: {len(routes)} rollout_expert_indices for {len(prompts)} prompts and {len(responses)} "
            "responses; one route array per trajectory"
        )
    digests = []
    for index, (rows, prompt, response) in enumerate(zip(routes, prompts, responses, strict=True)):
        rows_CLK = np.asarray(rows)
        ids_N = np.asarray([*prompt, *response], dtype=np.int64)
        if rows_CLK.ndim != 3 or len(rows_CLK) > len(ids_N):
            raise RowCountError(
                f"trajectory {index}: rollout_expert_indices of shape {rows_CLK.shape} for {len(ids_N)} tokens; "
                "SkyRL's generator form is [captured rows <= tokens, layers, top_k]"
            )
        digests.append(sample_digest(ids_N[: len(rows_CLK)], rows_CLK))
    return digests


def digest_column(digests: Sequence[bytes], batch: int | None = None) -> torch.Tensor:
    """The `DIGEST_KEY` field: uint8 `[batch, 16]`, rows past `len(digests)` (SkyRL's batch padding) zero."""
    import torch

    rows = len(digests) if batch is None else batch
    if rows < len(digests):
        raise BatchFieldError(f"{len(digests)} digests for a batch of {rows} trajectories")
    column = torch.zeros((rows, DIGEST_BYTES), dtype=torch.uint8)
    for b, digest in enumerate(digests):
        column[b] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    return column


def checked_digests(value: Any, batch: int) -> list[bytes]:
    """`value` (the `DIGEST_KEY` column, or a sequence of 16-byte digests from `route_digests`) as one digest per
    trajectory; anything else is a `BatchFieldError`, raised before a digest is compared."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta or value.dtype != torch.uint8 or value.dim() != 2:
            raise BatchFieldError(
                f"the {DIGEST_KEY} column is a {value.layout} {value.dtype} tensor of shape {tuple(value.shape)} on "
                f"{value.device}; routereplay writes a dense uint8 [batch, {DIGEST_BYTES}] tensor (digest_column)"
            )
        if tuple(value.shape) != (batch, DIGEST_BYTES):
            raise BatchFieldError(
                f"the {DIGEST_KEY} column has shape {tuple(value.shape)} for a batch of {batch} trajectories (needs "
                f"[{batch}, {DIGEST_BYTES}]); it was split or padded apart from the batch"
            )
        rows = value.to("cpu").numpy()
        return [bytes(row) for row in rows]
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise BatchFieldError(
            f"digests must be a sequence of {DIGEST_BYTES}-byte digests (route_digests) or the {DIGEST_KEY} column, "
            f"got {type(value).__name__}"
        )
    if len(value) != batch or not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in value):
        kinds = sorted({type(d).__name__ for d in value})
        raise BatchFieldError(
            f"digests: {len(value)} entries of {kinds} for a batch of {batch} trajectories; pass one "
            f"{DIGEST_BYTES}-byte digest per trajectory, in batch order (route_digests)"
        )
    return list(value)


__all__ = [
    "DIGEST_BYTES",
    "DIGEST_KEY",
    "checked_digests",
    "digest_column",
    "generator_digests",
    "route_digests",
    "sample_digest",
]
