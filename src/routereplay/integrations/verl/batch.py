"""Routes on verl's batch: compact per-sample blobs (default) or verl's own `routed_experts` with -1.

verl 0.9.1's agent loop pads the engine's routes into `routed_experts`, int16 `[1, P + R, L, K]`, with ZEROS
wherever no engine routed (`agent_loop.py` l.783-809): padding, each sequence's last token, tool tokens after
the last call, a dense layer's column of an all-layer payload. Zero is expert 0 to any trainer that forces it.

Two forms, both in verl's own containers, so verl's padding and micro-batching utilities carry them:
- `BatchForm.COMPACT` (default): one codec blob per sample (`routereplay.codec.encode`: route sets,
  ceil(log2 C(E, K)) bits per (token, layer) row, -1 rows as one bit, token ids and provenance kept) in
  `non_tensor_batch[ROUTES_KEY]`. An agent loop puts it in `AgentLoopOutput.extra_fields[ROUTES_KEY]`
  (`put_output_routes`), which verl's `_postprocess` copies into the non-tensor batch as is; `DataProto.chunk`,
  `select_idxs`, `prepare_dynamic_batch` and `to_tensordict` (a `NonTensorStack`) index it with the rest.
- `BatchForm.DENSE`: verl's `routed_experts` key and padded layout, int16, -1 (never 0) where nothing was
  routed (`dense_routes.py`), plus a per-sample digest of (token ids, route rows) in
  `non_tensor_batch[DIGEST_KEY]` (`digest.py`) that the reader checks. Only a trainer that reads -1 as
  "route live" may consume it (routereplay's replayer does).

`routes_for_batch` turns the compact column on a (micro-)batch back into the routes its forward needs: the
padded `(B, S, L, K)` layout of a `DataProto` / padded `TensorDict`, or the jagged one `left_right_2_no_padding`
makes (`input_ids` nested), each sample's token ids checked against the trace's. `routed_experts_for_batch`
(`routed_experts.py`) reads the dense form back: digest checked, verl's zero rows -1 where its masks say so.
Every field is checked first (`fields.py`), and each compact header against the model's
`RouteGeometry` (or `BatchLimits`) and the batch's other samples before anything is decoded or allocated.

Legend: B samples, S = P + R padded positions, P prompt width, R response width, L MoE layers (or every
hidden layer with `num_hidden_layers=`), K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.codec.blob import decode, encode
from routereplay.enums import CodecMode, StrEnum
from routereplay.errors import BatchFieldError, ConfigError, TraceShapeError
from routereplay.integrations.verl.dense_routes import (
    INT16_MAX_EXPERTS,
    dense_routed_experts,
    jagged_routed_experts,
    padded_routes,
)
from routereplay.integrations.verl.digest import DIGEST_KEY, route_digests
from routereplay.integrations.verl.fields import (
    BatchLimits,
    checked_geometry,
    checked_headers,
    checked_input_ids,
    checked_limits,
    checked_mask,
    checked_num_hidden_layers,
    checked_prompt_width,
    compact_blobs,
    field,
    tensors_of,
)
from routereplay.integrations.verl.routed_experts import VERL_ROUTES_KEY, routed_experts_for_batch
from routereplay.trace.route_trace import RouteTrace

if TYPE_CHECKING:
    import torch

    from routereplay.integrations.verl.rollout import RouteGeometry

ROUTES_KEY = "routereplay_routes"  # the non-tensor batch key (and AgentLoopOutput.extra_fields key) of the blobs


class BatchForm(StrEnum):
    COMPACT = "compact"  # codec blobs in the non-tensor batch (default)
    DENSE = "dense"  # verl's routed_experts tensor, -1 = no route


def compact_blob(trace: RouteTrace, *, mode: CodecMode | str = CodecMode.SET) -> bytes:
    """One sample's routes as a codec blob (what `AgentLoopOutput.extra_fields[ROUTES_KEY]` carries)."""
    return encode(trace, mode=mode)


def compact_routes(traces: Sequence[RouteTrace], *, mode: CodecMode | str = CodecMode.SET) -> np.ndarray:
    """(B,) object array of codec blobs: a `non_tensor_batch` column."""
    column = np.empty(len(traces), dtype=object)
    column[:] = [compact_blob(trace, mode=mode) for trace in traces]
    return column


def put_output_routes(output: Any, trace: RouteTrace, *, mode: CodecMode | str = CodecMode.SET) -> None:
    """Put one sample's merged routes on verl's `AgentLoopOutput` (in an agent loop's `run`, before it returns):
    the blob in `extra_fields[ROUTES_KEY]`, which verl's `_postprocess` copies into the non-tensor batch, and
    `routed_experts = None`, so verl builds no zero-filled tensor."""
    if not hasattr(output, "extra_fields") or not hasattr(output, "routed_experts"):
        raise ConfigError(
            f"output must be verl's AgentLoopOutput (extra_fields, routed_experts), got {type(output).__name__}"
        )
    output.extra_fields[ROUTES_KEY] = compact_blob(trace, mode=mode)
    output.routed_experts = None


def traces_of(column: Any) -> list[RouteTrace]:
    """The traces of a compact column: an object ndarray, a list, or a `NonTensorStack` from `to_tensordict`."""
    return [decode(blob) for blob in compact_blobs(column, _length(column), ROUTES_KEY)]


def routes_for_batch(
    batch: Any,
    *,
    num_hidden_layers: int | None = None,
    geometry: RouteGeometry | None = None,
    limits: BatchLimits | None = None,
) -> torch.Tensor:
    """The routes of a verl (micro-)batch from its compact column: a `DataProto`, or a `TensorDict` (padded, or
    after `left_right_2_no_padding`: then jagged like its `input_ids`). Token ids are checked; `geometry` (or
    `limits`) and the batch's other samples bound each blob's header before anything is decoded or allocated.
    The dense form (`routed_experts`) is read by `routed_experts_for_batch`."""
    reader = "routes_for_batch"
    geometry, limits = checked_geometry(geometry, reader), checked_limits(limits, reader)
    tensors, non_tensor = tensors_of(batch, reader)
    column = non_tensor.get(ROUTES_KEY, None)
    if column is None:
        dense = tensors.get(VERL_ROUTES_KEY, None) is not None
        raise ConfigError(
            f"the batch has no '{ROUTES_KEY}' column: put the routes on it with put_routes (or set "
            f"AgentLoopOutput.extra_fields['{ROUTES_KEY}'] = compact_blob(trace) in the agent loop)"
            + (f"; its dense '{VERL_ROUTES_KEY}' is read by routed_experts_for_batch" if dense else "")
        )
    input_ids = checked_input_ids(field(tensors, "input_ids", reader, "the tokens the routes belong to"), reader)
    num_hidden_layers = checked_num_hidden_layers(num_hidden_layers, geometry)
    blobs = compact_blobs(column, int(input_ids.size(0)), ROUTES_KEY)
    checked_headers(blobs, geometry=geometry, limits=limits, num_hidden_layers=num_hidden_layers)
    traces = [decode(blob) for blob in blobs]
    if input_ids.is_nested:
        if num_hidden_layers is not None:
            raise ConfigError("num_hidden_layers lays out a padded batch's layer axis; a jagged batch keeps MoE layers")
        return jagged_routed_experts(traces, input_ids, geometry=geometry, limits=limits)
    mask = checked_mask(
        field(tensors, "attention_mask", reader, "each sample's prompt and response lengths"),
        input_ids,
        len(traces),
        reader,
    )
    width = int(input_ids.shape[1])
    prompt_width = checked_prompt_width(
        field(tensors, "prompts", reader, "the prompt width"), width, len(traces), reader
    )
    return dense_routed_experts(
        traces,
        mask,
        prompt_width,
        input_ids_BS=input_ids,
        num_hidden_layers=num_hidden_layers,
        geometry=geometry,
        limits=limits,
    )


def put_routes(
    data: Any,
    traces: Sequence[RouteTrace],
    *,
    form: BatchForm | str = BatchForm.COMPACT,
    mode: CodecMode | str = CodecMode.SET,
    num_hidden_layers: int | None = None,
    geometry: RouteGeometry | None = None,
) -> None:
    """Put the batch's routes on a verl `DataProto`: blobs in `non_tensor_batch[ROUTES_KEY]` (compact), or
    verl's `batch["routed_experts"]` with -1 for no route plus its digest column `DIGEST_KEY` (dense). One
    trace per sample, in batch order."""
    try:
        form = BatchForm(form)
    except ValueError:
        raise ConfigError(f"form={form!r} is not a batch form; use 'compact' (default) or 'dense'") from None
    if not hasattr(data, "non_tensor_batch") or not hasattr(data, "batch"):
        raise BatchFieldError(f"put_routes takes verl's DataProto, got {type(data).__name__}")
    if len(traces) != len(data):
        raise TraceShapeError(f"{len(traces)} traces for a batch of {len(data)} samples; pass one per sample")
    if form is BatchForm.COMPACT:
        data.non_tensor_batch[ROUTES_KEY] = compact_routes(traces, mode=mode)
        return
    reader = "put_routes"
    geometry = checked_geometry(geometry, reader)
    input_ids = checked_input_ids(field(data.batch, "input_ids", reader, "the tokens the routes belong to"), reader)
    mask = checked_mask(
        field(data.batch, "attention_mask", reader, "each sample's prompt and response lengths"),
        input_ids,
        len(traces),
        reader,
    )
    prompts = field(data.batch, "prompts", reader, "the prompt width")
    prompt_width = checked_prompt_width(prompts, int(input_ids.shape[-1]), len(traces), reader)
    routes = dense_routed_experts(
        traces, mask, prompt_width, input_ids_BS=input_ids, num_hidden_layers=num_hidden_layers, geometry=geometry
    )
    data.non_tensor_batch[DIGEST_KEY] = route_digests(routes, input_ids, mask)
    data.batch[VERL_ROUTES_KEY] = routes


def _length(column: Any) -> int:
    try:
        return len(column)
    except TypeError:
        raise BatchFieldError(
            f"the '{ROUTES_KEY}' column is a {type(column).__name__}; it holds one codec blob per sample"
        ) from None


__all__ = [
    "DIGEST_KEY",
    "INT16_MAX_EXPERTS",
    "ROUTES_KEY",
    "VERL_ROUTES_KEY",
    "BatchForm",
    "BatchLimits",
    "compact_blob",
    "compact_routes",
    "dense_routed_experts",
    "jagged_routed_experts",
    "padded_routes",
    "put_output_routes",
    "put_routes",
    "routed_experts_for_batch",
    "routes_for_batch",
    "traces_of",
]
