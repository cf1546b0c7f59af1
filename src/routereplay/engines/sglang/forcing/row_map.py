"""Which (request, position) each token row of one SGLang forward is, and the batch's forced ids by MoE layer.

SGLang 0.5.23 lays a batch's token rows out from its `ScheduleBatch` host fields (`managers/schedule_batch.py`,
`model_executor/forward_batch_info.py` `ForwardBatch.init_new`), which this file reads and never writes:
- EXTEND and MIXED (prefill, chunked prefill, a retracted request's re-prefill, mixed prefill + decode): the rows
  of `batch.reqs` one request after the other; request i has `extend_lens[i]` rows at absolute positions
  `prefix_lens[i] + j` (`prefix_lens[i]` = tokens already in KV: earlier chunks, prefix-cache hits; in a MIXED
  batch the running requests are appended with prefix `seq_len - 1` and one row). The same arithmetic SGLang's
  own `positional_embed_overrides` uses.
- DECODE: one row per request, at position `seq_lens[i] - 1`.
- IDLE: no rows.
- Anything else (speculative TARGET_VERIFY / DRAFT_EXTEND_V2, SPLIT_PREFILL, dLLM, PREBUILT) is not mapped
  (`step_rows` returns None): a forced request in such a batch is not forced, and the hooks count and log it.

`ForcedBatch.build` turns the rows and each request's checked `ForcedRoutes` (or None) into per-layer device
tensors, built once per forward (numpy per request, one host-to-device copy per batch), so the top-k hook is
tensor ops only (`engines/vllm/forcing/op.py`).

Legend: N = token rows of the forward, R = requests, L = the model's MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from routereplay.engines.vllm.forced_routes import ForcedRoutes
from routereplay.errors import ForcedRoutesError

EXTEND_MODES = ("EXTEND", "MIXED")


@dataclass(frozen=True, slots=True)
class StepRows:
    """Row n of the forward is request `request_N[n]` at absolute position `position_N[n]`; request i owns rows
    `starts_R1[i]:starts_R1[i + 1]`."""

    request_N: np.ndarray
    position_N: np.ndarray
    starts_R1: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.position_N.shape[0])

    def rows_of(self, request: int) -> slice:
        return slice(int(self.starts_R1[request]), int(self.starts_R1[request + 1]))


def step_rows(
    mode: Any,
    num_requests: int,
    prefix_lens: Sequence[int] | None,
    extend_lens: Sequence[int] | None,
    seq_lens: Sequence[int] | np.ndarray | torch.Tensor | None,
) -> StepRows | None:
    """The rows of one forward from its host fields (module docstring); None for a mode that is not mapped.

    `ForcedRoutesError` when the fields contradict each other (lengths that are not one per request)."""
    name = getattr(mode, "name", str(mode))
    if name == "IDLE":
        empty = np.zeros(0, dtype=np.int64)
        return StepRows(empty, empty, np.zeros(num_requests + 1, dtype=np.int64))
    if name in EXTEND_MODES:
        prefix_R = _per_request(prefix_lens, num_requests, "prefix_lens")
        count_R = _per_request(extend_lens, num_requests, "extend_lens")
    elif name == "DECODE":
        prefix_R = _per_request(seq_lens, num_requests, "seq_lens") - 1
        count_R = np.ones(num_requests, dtype=np.int64)
    else:
        return None
    starts_R1 = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(count_R, out=starts_R1[1:])
    request_N = np.repeat(np.arange(num_requests, dtype=np.int64), count_R)
    position_N = np.arange(int(starts_R1[-1]), dtype=np.int64) - starts_R1[request_N] + prefix_R[request_N]
    return StepRows(request_N, position_N, starts_R1)


@dataclass(frozen=True, slots=True)
class ForcedBatch:
    """One forward's forced ids and mask per MoE layer (device tensors); `columns` maps a global layer number
    to its index in them."""

    num_rows: int
    columns: dict[int, int]
    forced_LNK: torch.Tensor  # int32, -1 where not forced
    mask_LN: torch.Tensor  # bool
    forced_rows: int  # (token, layer) rows forced
    requests: tuple[str, ...]  # ids of the requests with forced rows in this forward

    @classmethod
    def build(
        cls,
        rows: StepRows,
        routes: Sequence[ForcedRoutes | None],
        rids: Sequence[str],
        moe_layers: tuple[int, ...],
        top_k: int,
        device: torch.device | str,
    ) -> ForcedBatch | None:
        """The forward's forced rows, or None when no row of it is forced."""
        forced_NLK = np.full((rows.num_rows, len(moe_layers), top_k), -1, dtype=np.int32)
        forcing: list[str] = []
        for request, plan in enumerate(routes):
            if plan is None:
                continue
            span = rows.rows_of(request)
            inside_n, experts_nLK = plan.rows_at(rows.position_N[span])
            if inside_n.any():
                forced_NLK[span][inside_n] = experts_nLK
                forcing.append(str(rids[request]))
        mask_NL = forced_NLK[:, :, 0] >= 0
        count = int(mask_NL.sum())
        if count == 0:
            return None
        forced_LNK = torch.from_numpy(np.ascontiguousarray(forced_NLK.transpose(1, 0, 2)))
        mask_LN = torch.from_numpy(np.ascontiguousarray(mask_NL.T))
        columns = {layer: column for column, layer in enumerate(moe_layers)}
        return cls(
            rows.num_rows,
            columns,
            forced_LNK.to(device, non_blocking=True),
            mask_LN.to(device, non_blocking=True),
            count,
            tuple(forcing),
        )

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(forced_NK, mask_N)` of one layer, or None when the layer is not one of the MoE layers forced."""
        column = self.columns.get(int(layer_id))
        if column is None:
            return None
        return self.forced_LNK[column], self.mask_LN[column]


def _per_request(values: Any, num_requests: int, name: str) -> np.ndarray:
    if values is None:
        raise ForcedRoutesError(
            f"the SGLang batch has no {name} for its {num_requests} request(s): rows cannot be mapped"
        )
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    array_R = np.asarray(values, dtype=np.int64).reshape(-1)
    if array_R.shape[0] != num_requests or (array_R < 0).any():
        raise ForcedRoutesError(
            f"the SGLang batch's {name} has {array_R.shape[0]} entries (min {array_R.min(initial=0)}) for "
            f"{num_requests} request(s): rows cannot be mapped"
        )
    return array_R


__all__ = ["EXTEND_MODES", "ForcedBatch", "StepRows", "step_rows"]
