"""Alignment of replay routes with the batch they are applied to: padding side and token ids.

Replay forces routes by position. Routes placed at the wrong positions are still valid expert ids,
so the routers accept them and every token silently gets another token's experts. Two checks stop
that wherever the replayer can see the evidence:

- **Padding layout** (`check_padding`): a routes tensor that carries its own padding (-1 rows) must
  put that padding where the attention mask does. A routed row on a masked-out position, or a -1
  row on an attended position other than the sequence's last token (which engines never feed, so
  never route), means the routes were laid out for the other padding side. A row routed at every
  position (a recording: the model routes padding too) or at none carries no layout and passes.
  For RouteTraces the coverage check is the same idea: a trace must route every attended token
  from its `start` up to the last one, which may be missing (`check_coverage`).
- **Token ids** (`check_tokens`): a trace that carries `token_ids` must name the same tokens the
  batch holds at the positions its rows are placed on. A one-position shift (an extra or a
  stripped BOS) is recognised and said so.

Legend: B = batch rows, S = positions per row, L = layers, K = top-k, T = tokens of one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from routereplay.errors import ConfigError, PaddingMismatchError, TokenMismatchError
from routereplay.runtime.tensor_forms import refuse_unreadable
from routereplay.trace.route_trace import RouteTrace

SHIFT_MIN_KNOWN = 2  # a one-position shift is named only when at least this many known ids confirm it
FIX_PADDING = (
    "lay the routes out with the batch's padding side (routereplay.layout.pad with the same side), or pass the "
    "RouteTraces with attention_mask= so replay places them; check_alignment=False replays such rows as given"
)


def refuse_meta(value: torch.Tensor | np.ndarray | None, name: str) -> None:
    """A tensor with no plain values to read (the `meta` device, sparse, nested, quantized): refuse it before
    anything reads it (`runtime/tensor_forms.py`)."""
    refuse_unreadable(value, name)


def check_padding(routes_BSLK: np.ndarray, mask_BS: np.ndarray) -> None:
    """Refuse routes whose -1 padding disagrees with the attention mask (see the module docstring); host arrays."""
    if tuple(mask_BS.shape) != tuple(routes_BSLK.shape[:2]):
        raise PaddingMismatchError(
            f"attention_mask has shape {tuple(mask_BS.shape)} but the routes cover (B, S) = "
            f"{tuple(routes_BSLK.shape[:2])}; pass the mask of the batch the routes are aligned with"
        )
    routed_BS = np.asarray(np.asarray(routes_BSLK[..., 0] >= 0).any(axis=2))
    attended_BS = mask_BS.astype(bool)
    laid_out_B = np.asarray(routed_BS.any(axis=1) & ~routed_BS.all(axis=1))  # rows that carry their own padding
    if not laid_out_B.any():
        return
    routed_padding_BS = routed_BS & ~attended_BS & laid_out_B[:, None]
    last_S = _last_attended(attended_BS)
    gap_BS = attended_BS & ~routed_BS & laid_out_B[:, None]
    gap_BS[np.arange(len(last_S))[last_S >= 0], last_S[last_S >= 0]] = False  # the last token: never routed
    for b in np.flatnonzero(routed_padding_BS.any(axis=1) | gap_BS.any(axis=1)).tolist():
        attended = np.flatnonzero(attended_BS[b])
        routed = np.flatnonzero(routed_BS[b])
        mask_side = _side(attended, mask_BS.shape[1])
        routes_side = _side(routed, mask_BS.shape[1])
        hint = (
            f"the routes look laid out for {routes_side} padding while the mask is {mask_side}-padded"
            if routes_side != mask_side and "unknown" not in (routes_side, mask_side)
            else "the routes are not laid out like the batch"
        )
        if routed_padding_BS[b].any():
            s = int(np.flatnonzero(routed_padding_BS[b])[0])
            what = f"position {s} is padding (attention_mask 0) but its routes hold expert ids"
        else:
            s = int(np.flatnonzero(gap_BS[b])[0])
            what = f"position {s} is an attended token (not the sequence's last) but its routes are -1"
        raise PaddingMismatchError(
            f"sequence {b}: {what}; the mask attends positions {_span(attended)}, the routes route positions "
            f"{_span(routed)} ({int(routed_padding_BS[b].sum())} routed padding rows, {int(gap_BS[b].sum())} "
            f"unrouted attended rows): {hint}, so tokens would get other tokens' routes. Fix: {FIX_PADDING}"
        )


def check_coverage(trace: RouteTrace, sequence: int, tokens: int) -> None:
    """A trace placed on `tokens` attended positions must route up to the last one (which may be missing)."""
    if trace.stop >= tokens - 1:
        return
    raise PaddingMismatchError(
        f"sequence {sequence}: the trace routes tokens {trace.start}..{trace.stop - 1} but the attention mask "
        f"attends {tokens} tokens, so tokens {trace.stop}..{tokens - 2} would replay live with no route (only the "
        "last token may lack one); the trace is shorter than the sequence: a truncated capture, or tokens added "
        "to the trainer's sequence (an extra BOS, a chat template). Build the batch from the tokens the engine "
        "routed, or pass check_alignment=False to replay those rows live on purpose"
    )


def check_tokens(traces: Sequence[RouteTrace], mask_BS: np.ndarray, input_ids: torch.Tensor) -> int:
    """Refuse a batch whose ids differ from the traces' `token_ids`; return how many sequences were checked."""
    refuse_meta(input_ids, "input_ids")
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
    ):
        raise ConfigError(
            f"input_ids must be a (B, S) integer tensor, got {type(input_ids).__name__} "
            f"{getattr(input_ids, 'dtype', '')} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if tuple(input_ids.shape) != tuple(mask_BS.shape):
        raise TokenMismatchError(
            f"input_ids has shape {tuple(input_ids.shape)} but the attention_mask {tuple(mask_BS.shape)}; pass the "
            "ids and the mask of the same batch"
        )
    ids_BS = input_ids.detach().cpu().numpy()
    checked = 0
    for b, trace in enumerate(traces):
        if trace.token_ids is None:
            continue
        checked += 1
        batch_T = ids_BS[b, mask_BS[b].astype(bool)].astype(np.int64)
        expected_T = trace.token_ids
        stop = min(trace.stop, batch_T.size)
        count = stop - trace.start
        if count <= 0:
            continue
        known_T = expected_T[:count] >= 0
        differ_T = known_T & (batch_T[trace.start : stop] != expected_T[:count])
        if not differ_T.any():
            continue
        t = int(np.flatnonzero(differ_T)[0])
        position = trace.start + t
        raise TokenMismatchError(
            f"sequence {b}: token {position} (counting attended positions of row {b}) is id {int(batch_T[position])} "
            f"in the batch but the trace routed id {int(expected_T[t])} there ({int(differ_T.sum())} of {count} ids "
            f"differ); {_shift_hint(batch_T, expected_T, trace.start)}"
        )
    return checked


def _shift_hint(batch_T: np.ndarray, expected_T: np.ndarray, start: int) -> str:
    """Name a one-position shift between the batch's ids and the trace's, or say there is none."""
    for shift, cause in (
        (1, "the batch's tokens are the trace's shifted right by one: the trainer's sequence has an extra token in "
         "front (a BOS the engine did not see); tokenise the batch exactly as the engine did (e.g. "
         "add_special_tokens=False, or drop the extra BOS)"),
        (-1, "the batch's tokens are the trace's shifted left by one: the trainer's sequence lacks the first token "
         "the engine routed (a stripped BOS); keep the BOS the engine saw, or slice the traces to match"),
    ):  # fmt: skip
        begin = start + shift
        lo = max(0, -begin)
        hi = min(expected_T.size, batch_T.size - begin)
        if hi - lo < SHIFT_MIN_KNOWN:
            continue
        expected = expected_T[lo:hi]
        known = expected >= 0
        if int(known.sum()) >= SHIFT_MIN_KNOWN and bool(
            (batch_T[begin + lo : begin + hi][known] == expected[known]).all()
        ):
            return cause
    return (
        "the batch holds other tokens than the engine routed (a re-tokenisation, another sample, or another "
        "order); replay the routes of exactly these tokens"
    )


def _last_attended(attended_BS: np.ndarray) -> np.ndarray:
    """(B,) index of each row's last attended position, -1 for a row with none."""
    width = attended_BS.shape[1]
    reversed_first = np.argmax(attended_BS[:, ::-1], axis=1)
    return np.where(attended_BS.any(axis=1), width - 1 - reversed_first, -1)


def _side(positions: np.ndarray, width: int) -> str:
    """Which padding a run of positions implies: right (starts at 0), left (ends at S - 1, or at S - 2
    when the sequence's last token has no route)."""
    if positions.size == 0 or positions.size == width:
        return "unknown"
    if positions[0] == 0:
        return "right"
    if positions[-1] >= width - 2:
        return "left"
    return "unknown"


def _span(positions: np.ndarray) -> str:
    if positions.size == 0:
        return "none"
    contiguous = positions[-1] - positions[0] + 1 == positions.size
    return f"{positions[0]}..{positions[-1]}" + ("" if contiguous else f" ({positions.size} of them, with gaps)")


__all__ = ["check_coverage", "check_padding", "check_tokens", "refuse_meta"]
