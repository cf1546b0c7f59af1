"""DSA indexer choices between a padded batch (`indices_BSLI`) and per-sequence `IndexerTrace`s.

A batch holds key positions as batch columns: row (b, s, l) lists the columns query column s of row
b attends in DSA layer l, sorted, -1 padded to I (`runtime/indexer/discovery.py`, canonical form). A sequence's
`IndexerTrace` holds token positions within the sequence (`routereplay.indexer`): the i-th attended
column of row b is token i, as for expert routes (`runtime/routes.py`), so left padding, right
padding and packed rows all map the same way. A query's keys are attended columns by construction
(the record drops the others), so every key maps to a token.

`indexer_traces` cuts a recorded batch into traces; `indexer_batch` lays traces (those attached to
`RouteTrace.indexer`) back onto a batch, -1 (unknown: the live indexer decides) where a trace has
no row or no trace carries choices.

Legend: B = batch rows, S = positions (columns), L = DSA layers, I = index_topk, T = tokens of a sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from routereplay.errors import BatchShapeError, ConfigError, IndexerRouteError, LayerCountError, TopKMismatchError
from routereplay.indexer.trace import IndexerTrace
from routereplay.runtime.routes import mask_array
from routereplay.trace.route_trace import RouteTrace


class IndexerGeometry(Protocol):
    """What the batch layout needs of the model's bound indexers (an `IndexerReplayer`)."""

    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def index_topk(self) -> int: ...


def indexer_traces(
    indices_BSLI: torch.Tensor, mask_BS: np.ndarray, layers: Sequence[int], index_topk: int
) -> list[IndexerTrace]:
    """One `IndexerTrace` per batch row: its attended queries, keys renumbered to token positions."""
    indices = indices_BSLI.detach().cpu().numpy()
    if indices.shape[:2] != mask_BS.shape[:2] and indices.shape[0] == mask_BS.shape[0]:
        mask_BS = mask_BS[:, : indices.shape[1]]  # generation: the last sampled token has no route
    if indices.shape[:2] != mask_BS.shape:
        raise BatchShapeError(f"indexer choices cover {indices.shape[:2]} but the attention mask is {mask_BS.shape}")
    traces = []
    for b in range(indices.shape[0]):
        attended_T = np.flatnonzero(mask_BS[b])
        token_of_S = np.full(indices.shape[1], -1, np.int64)
        token_of_S[attended_T] = np.arange(attended_T.size)
        rows_TLI = indices[b, attended_T].astype(np.int64)
        keys = rows_TLI >= 0
        rows_TLI[keys] = token_of_S[rows_TLI[keys]]
        if (rows_TLI[keys] < 0).any():
            raise IndexerRouteError(f"batch row {b}: recorded indexer keys on padding columns; record with its mask")
        traces.append(IndexerTrace.from_dense(rows_TLI.astype(np.int32), tuple(layers), index_topk))
    return traces


def indexer_batch(
    traces: Sequence[IndexerTrace | None], mask_BS: np.ndarray, layers: Sequence[int], index_topk: int
) -> torch.Tensor:
    """(B, S, L, I) int32 choices on the batch's columns; -1 rows where no trace says (live indexer)."""
    batch, positions = mask_BS.shape
    out_BSLI = np.full((batch, positions, len(layers), index_topk), -1, np.int32)
    for b, trace in enumerate(traces):
        if trace is None:
            continue
        if trace.layers != tuple(layers):
            raise LayerCountError(
                f"sequence {b}: indexer choices are for DSA layers {list(trace.layers)}, the model's indexers sit in "
                f"layers {list(layers)}"
            )
        if trace.index_topk != index_topk:
            raise TopKMismatchError(
                f"sequence {b}: indexer choices keep {trace.index_topk} keys, the model {index_topk}"
            )
        attended_T = np.flatnonzero(mask_BS[b])
        if trace.start + trace.num_tokens > attended_T.size:
            raise BatchShapeError(
                f"sequence {b}: indexer choices cover tokens {trace.start}..{trace.start + trace.num_tokens} but the "
                f"mask attends {attended_T.size}"
            )
        rows_TLI = trace.to_dense()
        keys = rows_TLI >= 0
        rows_TLI[keys] = attended_T[rows_TLI[keys]]  # token position -> batch column
        out_BSLI[b, attended_T[trace.start : trace.start + trace.num_tokens]] = rows_TLI
    return torch.from_numpy(out_BSLI)


def replay_choices(
    owner: IndexerGeometry | None,
    model_name: str,
    traces: Sequence[RouteTrace] | None,
    attention_mask: torch.Tensor | None,
    given: torch.Tensor | None,
) -> torch.Tensor | None:
    """The indexer choices a `Replayer.replay` forces: `indexer=`, or the traces' `IndexerTrace`s on the batch.

    Choices for a model without indexers are refused (`ConfigError`): they belong to another model."""
    carried = traces is not None and any(t.indexer is not None for t in traces)
    if (given is not None or carried) and owner is None:
        raise ConfigError(
            f"{model_name} has no DSA indexer, but the replay carries indexer choices; they belong to another "
            "model (drop them with trace.with_indexer(None))"
        )
    if given is not None or not carried or owner is None or traces is None or attention_mask is None:
        return given
    mask_BS = mask_array(attention_mask)
    return indexer_batch([t.indexer for t in traces], mask_BS, owner.layers, owner.index_topk)


__all__ = ["indexer_batch", "indexer_traces", "replay_choices"]
