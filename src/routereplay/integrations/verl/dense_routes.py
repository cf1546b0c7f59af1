"""Traces -> verl's dense `routed_experts` layouts, -1 (never 0) where nothing was routed.

verl 0.9.1's agent loop lays a sample out as `[prompt_length + response_length]` positions: the prompt
left-padded to `rollout.prompt_length` (P), the response (generated and tool tokens) right-padded to
`rollout.response_length` (R); its `routed_experts` is int16 `[1, P + R, L, K]` with the engine's rows at
`P - len(prompt)` onwards and zeros elsewhere (`agent_loop.py` l.783-809). The writers here make the same
layout with -1 for no route: `padded_routes` (one sample, the drop-in for the agent loop's padding),
`dense_routed_experts` (a padded batch), `jagged_routed_experts` (the layout `left_right_2_no_padding` makes).

Every sample's trace is checked against the model's `RouteGeometry` (when given), `BatchLimits` and the
batch's other samples before its output is allocated, and its token ids against the batch's.

Legend: B samples, S = P + R padded positions, L MoE layers (or every hidden layer with
`num_hidden_layers=`), K top-k, N tokens of one sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.errors import BatchFieldError, BatchGeometryError, ConfigError, TokenMismatchError, TraceShapeError
from routereplay.integrations.verl.fields import (
    BatchLimits,
    check_samples,
    checked_geometry,
    checked_input_ids,
    checked_limits,
    checked_mask,
    checked_num_hidden_layers,
    checked_prompt_length,
    sample_lengths,
)
from routereplay.trace.route_trace import RouteTrace

if TYPE_CHECKING:
    import torch

    from routereplay.integrations.verl.rollout import RouteGeometry

INT16_MAX_EXPERTS = 1 << 15  # verl's int16 holds expert ids below 32768


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
    geometry: RouteGeometry | None = None,
    limits: BatchLimits | None = None,
) -> torch.Tensor:
    """One sample's routes in verl's padded layout, int16 `[1, P + R, L, K]`, -1 where nothing was routed.

    The drop-in for `_agent_loop_postprocess`'s route padding: the sample's `prompt_len` prompt tokens sit
    at `[P - prompt_len, P)`, its `response_len` response tokens right after; trace rows past the batch's
    tokens (a response verl truncated) are left out. `num_hidden_layers` lays the layer axis out over every
    hidden layer (dense layers' columns -1), as verl's Megatron path indexes when the axis has all layers.
    With `input_ids_S` (the sample's padded input ids) every routed row's token id is checked. The trace is
    checked against `geometry` (or `limits`), and `prompt_length + response_length` against
    `limits.max_positions`, before the output is allocated.
    """
    import torch

    if not isinstance(trace, RouteTrace):
        raise ConfigError(f"padded_routes takes a RouteTrace (RolloutRoutes.trace), got {type(trace).__name__}")
    geometry = checked_geometry(geometry, "padded_routes")
    limits = checked_limits(limits, "padded_routes")
    _check_lengths(prompt_len, response_len, prompt_length, response_length, sample)
    if prompt_length + response_length > limits.max_positions:
        raise BatchGeometryError(
            f"sample {sample!r}: prompt_length={prompt_length} + response_length={response_length} make "
            f"{prompt_length + response_length} padded positions, above BatchLimits.max_positions="
            f"{limits.max_positions}; pass the rollout's own prompt_length / response_length (the widths of "
            "batch['prompts'] and batch['responses']), or raise the limit if the batch really is that long"
        )
    num_hidden_layers = checked_num_hidden_layers(num_hidden_layers, geometry)
    check_samples([trace], geometry=geometry, limits=limits, num_hidden_layers=num_hidden_layers, names=[sample])
    if trace.num_experts > INT16_MAX_EXPERTS:
        raise ConfigError(
            f"sample {sample!r}: {trace.num_experts} experts do not fit verl's int16 routed_experts; use the "
            "compact form (BatchForm.COMPACT)"
        )
    width = prompt_length + response_length
    if input_ids_S is not None:
        if not _is_tensor(input_ids_S) or input_ids_S.is_nested or input_ids_S.dim() != 1:
            raise BatchFieldError(
                f"sample {sample!r}: input_ids_S is a {type(input_ids_S).__name__}; pass the sample's padded input_ids "
                "row, a 1-d torch tensor"
            )
        input_ids_S = checked_input_ids(input_ids_S[None], "padded_routes")[0]
        if input_ids_S.shape[0] != width:
            raise BatchFieldError(
                f"sample {sample!r}: input_ids has {input_ids_S.shape[0]} positions for prompt_length + "
                f"response_length = {width}; pass the sample's padded input_ids row"
            )
    columns = _columns(trace, num_hidden_layers, sample)
    out_SLK = np.full((width, len(columns), trace.top_k), -1, dtype=np.int16)
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
    geometry: RouteGeometry | None = None,
    limits: BatchLimits | None = None,
) -> torch.Tensor:
    """A batch's routes as verl's `routed_experts`, int16 `[B, P + R, L, K]` with -1 (never 0) for no route.

    `attention_mask_BS` and `prompt_length` (the width of `batch["prompts"]`) are the batch's own: each
    sample's prompt and response lengths are read from the mask, as verl's `no_padding_2_padding` does.
    Every sample is checked against the others (and `geometry`) before anything is allocated."""
    import torch

    reader = "dense_routed_experts"
    traces = _checked_traces(traces, reader)
    geometry, limits = checked_geometry(geometry, reader), checked_limits(limits, reader)
    if input_ids_BS is not None:
        input_ids_BS = checked_input_ids(input_ids_BS, reader)
        if input_ids_BS.is_nested:
            raise BatchFieldError(f"{reader}: input_ids is jagged; for a jagged batch use jagged_routed_experts")
    mask_BS = checked_mask(attention_mask_BS, input_ids_BS, len(traces), reader)
    width = mask_BS.shape[1]
    prompt_length = checked_prompt_length(prompt_length, width, reader)
    prompt_lens, response_lens = sample_lengths(mask_BS, prompt_length, reader)
    num_hidden_layers = checked_num_hidden_layers(num_hidden_layers, geometry)
    check_samples(traces, geometry=geometry, limits=limits, num_hidden_layers=num_hidden_layers)
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
            geometry=geometry,
            limits=limits,
        )
        for b, (trace, p, r) in enumerate(zip(traces, prompt_lens, response_lens, strict=True))
    ]
    return torch.cat(rows, dim=0)


def jagged_routed_experts(
    traces: Sequence[RouteTrace],
    input_ids_BJ: torch.Tensor,
    *,
    geometry: RouteGeometry | None = None,
    limits: BatchLimits | None = None,
) -> torch.Tensor:
    """A batch's routes in the jagged layout of `left_right_2_no_padding` (`input_ids` a nested tensor):
    `[B, j, L, K]` int16, row t of sample b the routes of its token t, -1 where nothing was routed."""
    import torch

    reader = "jagged_routed_experts"
    traces = _checked_traces(traces, reader)
    geometry, limits = checked_geometry(geometry, reader), checked_limits(limits, reader)
    input_ids_BJ = checked_input_ids(input_ids_BJ, reader)
    if not input_ids_BJ.is_nested or input_ids_BJ.size(0) != len(traces):
        raise TraceShapeError(
            f"input_ids must be the nested (jagged) tensor of {len(traces)} samples that left_right_2_no_padding "
            "makes; for a padded batch use dense_routed_experts"
        )
    check_samples(traces, geometry=geometry, limits=limits, num_hidden_layers=None)
    parts = []
    for b, (trace, ids_N) in enumerate(zip(traces, input_ids_BJ.unbind(), strict=True)):
        n = int(ids_N.shape[0])
        padded = padded_routes(
            trace,
            prompt_len=n,
            response_len=0,
            prompt_length=n,
            response_length=0,
            input_ids_S=ids_N,
            sample=b,
            geometry=geometry,
            limits=limits,
        )
        parts.append(padded[0])
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _checked_traces(traces: Any, reader: str) -> list[RouteTrace]:
    if isinstance(traces, (str, bytes)) or not isinstance(traces, Sequence):
        raise ConfigError(f"{reader} takes a sequence of RouteTrace (one per sample), got {type(traces).__name__}")
    for b, trace in enumerate(traces):
        if not isinstance(trace, RouteTrace):
            raise ConfigError(f"{reader}: sample {b} is a {type(trace).__name__}, not a RouteTrace")
    if not traces:
        raise ConfigError(f"{reader}: no traces; pass one RouteTrace per sample of the batch")
    return list(traces)


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


def _check_lengths(prompt_len: Any, response_len: Any, prompt_length: Any, response_length: Any, sample: Any) -> None:
    values = {
        "prompt_len": prompt_len,
        "response_len": response_len,
        "prompt_length": prompt_length,
        "response_length": response_length,
    }
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ConfigError(f"sample {sample!r}: {name}={value!r} must be an int (a token count)")
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


__all__ = ["INT16_MAX_EXPERTS", "dense_routed_experts", "jagged_routed_experts", "padded_routes"]
