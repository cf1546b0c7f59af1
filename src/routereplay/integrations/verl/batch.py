"""Routes on verl's batch: compact per-sample blobs (default) or verl's own `routed_experts` with -1.

verl 0.9.1's agent loop lays a sample out as `[prompt_length + response_length]` positions: the prompt
left-padded to `rollout.prompt_length` (P), the response (generated and tool tokens) right-padded to
`rollout.response_length` (R); `routed_experts` is int16 `[1, P + R, L, K]` with the engine's rows at
`P - len(prompt)` onwards and ZEROS elsewhere (`agent_loop.py` l.783-809). Zero is expert 0: every row
the engine never routed (padding, each sequence's last token, tool tokens after the last call, a dense
layer's column of an all-layer payload) is a valid-looking route to expert 0.

Two forms, both in verl's own containers, so verl's padding and micro-batching utilities carry them:
- `BatchForm.COMPACT` (default): one codec blob per sample (`routereplay.codec.encode`: route sets,
  ceil(log2 C(E, K)) bits per (token, layer) row, -1 rows as one bit, token ids and provenance kept) in
  `non_tensor_batch[ROUTES_KEY]`. An agent loop puts it in `AgentLoopOutput.extra_fields[ROUTES_KEY]`
  (`put_output_routes`), which verl's `_postprocess` copies into the non-tensor batch as is; `DataProto.chunk`,
  `select_idxs`, `prepare_dynamic_batch` and `to_tensordict` (a `NonTensorStack`) index it with the rest.
- `BatchForm.DENSE`: verl's `routed_experts` key and padded layout, int16, -1 (never 0) where nothing was
  routed (`padded_routes` per sample, the drop-in for the agent loop's padding; `dense_routed_experts`
  per batch). Only a trainer that reads -1 as "route live" may consume it (routereplay's replayer does).

`routes_for_batch` turns either form on a (micro-)batch back into the routes its forward needs: the padded
`(B, S, L, K)` layout of a `DataProto` / padded `TensorDict`, or the jagged one `left_right_2_no_padding`
makes (`input_ids` nested), checking each sample's token ids against the trace's.

Legend: B samples, S = P + R padded positions, P prompt width, R response width, L MoE layers (or every
hidden layer with `num_hidden_layers=`), K top-k, N tokens of one sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.codec.blob import decode, encode
from routereplay.enums import CodecMode, StrEnum
from routereplay.errors import ConfigError, TokenMismatchError, TraceShapeError
from routereplay.trace.route_trace import RouteTrace

if TYPE_CHECKING:
    import torch

ROUTES_KEY = "routereplay_routes"  # the non-tensor batch key (and AgentLoopOutput.extra_fields key) of the blobs
VERL_ROUTES_KEY = "routed_experts"  # verl's own tensor key (agent_loop.py l.1074)
INT16_MAX_EXPERTS = 1 << 15  # verl's int16 holds expert ids below 32768


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
    if hasattr(column, "tolist") and not isinstance(column, np.ndarray):  # tensordict's NonTensorStack
        column = column.tolist()
    return [decode(blob) for blob in list(column)]


def padded_routes(
    trace: RouteTrace,
    *,
    prompt_len: int,
    response_len: int,
    prompt_length: int,
    response_length: int,
    num_hidden_layers: int | None = None,
    input_ids_S: torch.Tensor | None = None,
    sample: int | str = 0,
) -> torch.Tensor:
    """One sample's routes in verl's padded layout, int16 `[1, P + R, L, K]`, -1 where nothing was routed.

    The drop-in for `_agent_loop_postprocess`'s route padding: the sample's `prompt_len` prompt tokens sit
    at `[P - prompt_len, P)`, its `response_len` response tokens right after; trace rows past the batch's
    tokens (a response verl truncated) are left out. `num_hidden_layers` lays the layer axis out over every
    hidden layer (dense layers' columns -1), as verl's Megatron path indexes when the axis has all layers.
    With `input_ids_S` (the sample's padded input ids) every routed row's token id is checked.
    """
    if not isinstance(trace, RouteTrace):
        raise ConfigError(f"padded_routes takes a RouteTrace (RolloutRoutes.trace), got {type(trace).__name__}")
    import torch

    _check_lengths(prompt_len, response_len, prompt_length, response_length, sample)
    if trace.num_experts > INT16_MAX_EXPERTS:
        raise ConfigError(
            f"sample {sample!r}: {trace.num_experts} experts do not fit verl's int16 routed_experts; use the "
            "compact form (BatchForm.COMPACT)"
        )
    columns = _columns(trace, num_hidden_layers, sample)
    out_SLK = np.full((prompt_length + response_length, len(columns), trace.top_k), -1, dtype=np.int16)
    tokens = prompt_len + response_len
    begin, end = min(trace.start, tokens), min(trace.stop, tokens)
    offset = prompt_length - prompt_len  # padded index of token position 0
    if end > begin:
        rows = trace.experts[begin - trace.start : end - trace.start]
        out_SLK[offset + begin : offset + end][:, columns >= 0] = rows[:, columns[columns >= 0]]
        if input_ids_S is not None and trace.token_ids is not None:
            _check_tokens(trace, np.asarray(input_ids_S.cpu())[offset : offset + tokens], begin, end, sample)
    return torch.from_numpy(out_SLK).unsqueeze(0)


def dense_routed_experts(
    traces: Sequence[RouteTrace],
    attention_mask_BS: torch.Tensor,
    prompt_length: int,
    *,
    input_ids_BS: torch.Tensor | None = None,
    num_hidden_layers: int | None = None,
) -> torch.Tensor:
    """A batch's routes as verl's `routed_experts`, int16 `[B, P + R, L, K]` with -1 (never 0) for no route.

    `attention_mask_BS` and `prompt_length` (the width of `batch["prompts"]`) are the batch's own: each
    sample's prompt and response lengths are read from the mask, as verl's `no_padding_2_padding` does."""
    import torch

    if attention_mask_BS.dim() != 2 or attention_mask_BS.shape[0] != len(traces):
        raise TraceShapeError(
            f"attention_mask has shape {tuple(attention_mask_BS.shape)} for {len(traces)} traces; pass the batch's "
            "(batch, prompt_length + response_length) mask and one trace per sample, in batch order"
        )
    width = attention_mask_BS.shape[1]
    if not 0 < prompt_length < width:
        raise ConfigError(f"prompt_length={prompt_length} must be in (0, {width}): the width of batch['prompts']")
    prompt_lens = attention_mask_BS[:, :prompt_length].sum(dim=1).tolist()
    response_lens = attention_mask_BS[:, prompt_length:].sum(dim=1).tolist()
    rows = [
        padded_routes(
            trace,
            prompt_len=int(p),
            response_len=int(r),
            prompt_length=prompt_length,
            response_length=width - prompt_length,
            num_hidden_layers=num_hidden_layers,
            input_ids_S=None if input_ids_BS is None else input_ids_BS[b],
            sample=b,
        )
        for b, (trace, p, r) in enumerate(zip(traces, prompt_lens, response_lens, strict=True))
    ]
    return torch.cat(rows, dim=0)


def jagged_routed_experts(traces: Sequence[RouteTrace], input_ids_BJ: torch.Tensor) -> torch.Tensor:
    """A batch's routes in the jagged layout of `left_right_2_no_padding` (`input_ids` a nested tensor):
    `[B, j, L, K]` int16, row t of sample b the routes of its token t, -1 where nothing was routed."""
    import torch

    if not getattr(input_ids_BJ, "is_nested", False) or input_ids_BJ.size(0) != len(traces):
        raise TraceShapeError(
            f"input_ids must be the nested (jagged) tensor of {len(traces)} samples that left_right_2_no_padding "
            "makes; for a padded batch use dense_routed_experts"
        )
    parts = []
    for b, (trace, ids_N) in enumerate(zip(traces, input_ids_BJ.unbind(), strict=True)):
        n = int(ids_N.shape[0])
        padded = padded_routes(
            trace, prompt_len=n, response_len=0, prompt_length=n, response_length=0, input_ids_S=ids_N, sample=b
        )
        parts.append(padded[0])
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def routes_for_batch(batch: Any, *, num_hidden_layers: int | None = None) -> torch.Tensor:
    """The routes of a verl (micro-)batch from its compact column: a `DataProto`, or a `TensorDict` (padded, or
    after `left_right_2_no_padding`: then jagged like its `input_ids`). Token ids are checked."""
    if batch is None or not (hasattr(batch, "non_tensor_batch") or hasattr(batch, "get")):
        raise ConfigError(f"routes_for_batch takes verl's DataProto or TensorDict, got {type(batch).__name__}")
    tensors, column = _parts(batch)
    traces = traces_of(column)
    input_ids = tensors["input_ids"]
    if getattr(input_ids, "is_nested", False):
        return jagged_routed_experts(traces, input_ids)
    return dense_routed_experts(
        traces,
        tensors["attention_mask"],
        int(tensors["prompts"].shape[1]),
        input_ids_BS=input_ids,
        num_hidden_layers=num_hidden_layers,
    )


def put_routes(
    data: Any,
    traces: Sequence[RouteTrace],
    *,
    form: BatchForm | str = BatchForm.COMPACT,
    mode: CodecMode | str = CodecMode.SET,
    num_hidden_layers: int | None = None,
) -> None:
    """Put the batch's routes on a verl `DataProto`: blobs in `non_tensor_batch[ROUTES_KEY]` (compact), or
    verl's `batch["routed_experts"]` with -1 for no route (dense). One trace per sample, in batch order."""
    try:
        form = BatchForm(form)
    except ValueError:
        raise ConfigError(f"form={form!r} is not a batch form; use 'compact' (default) or 'dense'") from None
    if len(traces) != len(data):
        raise TraceShapeError(f"{len(traces)} traces for a batch of {len(data)} samples; pass one per sample")
    if form is BatchForm.COMPACT:
        data.non_tensor_batch[ROUTES_KEY] = compact_routes(traces, mode=mode)
        return
    data.batch[VERL_ROUTES_KEY] = dense_routed_experts(
        traces,
        data.batch["attention_mask"],
        int(data.batch["prompts"].shape[1]),
        input_ids_BS=data.batch["input_ids"],
        num_hidden_layers=num_hidden_layers,
    )


def _parts(batch: Any) -> tuple[Any, Any]:
    """(tensors, compact column) of a DataProto or a TensorDict; `ConfigError` when the column is missing."""
    non_tensor = getattr(batch, "non_tensor_batch", None)
    tensors = batch.batch if non_tensor is not None else batch
    column = non_tensor.get(ROUTES_KEY) if non_tensor is not None else (batch.get(ROUTES_KEY, None))
    if column is None:
        raise ConfigError(
            f"the batch has no '{ROUTES_KEY}' column: put the routes on it with put_routes (or set "
            f"AgentLoopOutput.extra_fields['{ROUTES_KEY}'] = compact_blob(trace) in the agent loop)"
        )
    return tensors, column


def _columns(trace: RouteTrace, num_hidden_layers: int | None, sample: int | str) -> np.ndarray:
    """For each output column, the trace column it takes (-1: a dense layer's column, all -1)."""
    if num_hidden_layers is None:
        return np.arange(trace.num_layers)
    if trace.slots is not None or max(trace.layers) >= num_hidden_layers:
        raise ConfigError(
            f"sample {sample!r}: layers {list(trace.layers)} do not lay out over num_hidden_layers={num_hidden_layers} "
            "(one router per layer, global numbers below it); leave num_hidden_layers unset for MoE layers only"
        )
    columns = np.full(num_hidden_layers, -1, dtype=np.int64)
    columns[list(trace.layers)] = np.arange(trace.num_layers)
    return columns


def _check_lengths(prompt_len: int, response_len: int, prompt_length: int, response_length: int, sample: Any) -> None:
    if not (0 <= prompt_len <= prompt_length and 0 <= response_len <= response_length):
        raise TraceShapeError(
            f"sample {sample!r}: {prompt_len} prompt and {response_len} response tokens do not fit verl's "
            f"prompt_length={prompt_length} / response_length={response_length}; pass the batch's own lengths"
        )


def _check_tokens(trace: RouteTrace, ids_N: np.ndarray, begin: int, end: int, sample: Any) -> None:
    """The trace's known token ids over positions [begin, end) must be the batch's."""
    assert trace.token_ids is not None
    named = trace.token_ids[begin - trace.start : end - trace.start]
    differ = (named >= 0) & (named != ids_N[begin:end])
    if differ.any():
        at = begin + int(np.flatnonzero(differ)[0])
        raise TokenMismatchError(
            f"sample {sample!r}: the routes were captured for token id {int(trace.token_ids[at - trace.start])} at "
            f"position {at} but the batch holds {int(ids_N[at])} ({int(differ.sum())} positions differ): the routes "
            "belong to another sample or tokenisation; keep the routes' column in the batch's sample order"
        )


__all__ = [
    "INT16_MAX_EXPERTS",
    "ROUTES_KEY",
    "VERL_ROUTES_KEY",
    "BatchForm",
    "compact_blob",
    "compact_routes",
    "dense_routed_experts",
    "jagged_routed_experts",
    "padded_routes",
    "put_output_routes",
    "put_routes",
    "routes_for_batch",
    "traces_of",
]
