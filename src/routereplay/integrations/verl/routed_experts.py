"""verl's dense `routed_experts` read back for replay: token-checked, zero padding made -1, dense columns checked.

Three writers fill `batch["routed_experts"]`, and a reader must know which:

- routereplay's `put_routes(..., form="dense")`: -1 where nothing was routed, and a per-sample digest of
  (token ids, route rows) in `non_tensor_batch[DIGEST_KEY]` (`digest.py`), checked here: routes shifted,
  cut or reordered apart from the tokens raise `TokenMismatchError`.
- verl's own agent loop (R3 with `enable_rollout_routing_replay`): ZEROS where nothing was routed
  (`agent_loop.py` l.783-809 fills `[P - len(prompt), P - len(prompt) + rows)` with the last engine call's
  rows, zeros elsewhere) and no token ids at all. Zero is expert 0, so the rows verl's own masks say no engine
  routed become -1 here: padding (`attention_mask` 0), and every position from the sample's last generated
  token on (the last `response_mask` 1: the engine never feeds its last sampled token back, and tool tokens
  after the last call were never prefilled); verl's own R3 replays all of those but the final one as expert 0.
  With top-k >= 2 any all-zero (token, layer) row is also -1 (a route never names an expert twice). A top-1
  zero row before the last generated token stays expert 0: verl's layout routes every such position.
- routereplay's FSDP engine recording R2 (`recorded=True`): every row is the trainer's own route (top-1
  expert 0 included); nothing is converted.

A tensor without the digest carries nothing to check it against the tokens, so it is refused
(`UncheckedRoutesError`) unless the caller opts out with `unchecked=True`. With the model's `RouteGeometry`,
an all-layer payload's dense columns must hold only 0 / -1 (`DenseLayerRouteError` otherwise) and become -1.

Legend: B samples, S padded positions, P payload layers, K top-k, N tokens of a micro-batch (jagged values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    DenseLayerRouteError,
    ExpertIdRangeError,
    UncheckedRoutesError,
)
from routereplay.integrations.verl.digest import DIGEST_KEY, check_route_digests, sample_rows
from routereplay.integrations.verl.fields import (
    checked_flag,
    checked_geometry,
    checked_input_ids,
    checked_mask,
    checked_prompt_width,
    checked_response_mask,
    checked_route_tensor,
    field,
    tensors_of,
)

if TYPE_CHECKING:
    import torch

    from routereplay.integrations.verl.rollout import RouteGeometry

VERL_ROUTES_KEY = "routed_experts"  # verl's own tensor key (agent_loop.py l.1074)


def routed_experts_for_batch(
    batch: Any,
    *,
    geometry: RouteGeometry | None = None,
    unchecked: bool = False,
    recorded: bool = False,
) -> torch.Tensor:
    """The batch's `routed_experts` ready for replay, in its own layout and dtype: padded `(B, S, P, K)` on a
    `DataProto`, jagged `(B, j, P, K)` after `left_right_2_no_padding`; -1 wherever no route is known.

    `unchecked=True` replays a tensor that carries no digest (verl's own rollout routes, R2's recorded ones)
    without a token check; `recorded=True` says its rows are all real routes (R2), so no zero row is -1.
    Both must be real bools. With `geometry`, every id must be an expert of the model, in [0, E), or -1."""
    import torch

    reader = "routed_experts_for_batch"
    geometry = checked_geometry(geometry, reader)
    unchecked, recorded = checked_flag(unchecked, "unchecked", reader), checked_flag(recorded, "recorded", reader)
    tensors, non_tensor = tensors_of(batch, reader)
    routes = checked_route_tensor(field(tensors, VERL_ROUTES_KEY, reader, "the dense routes to replay"), reader)
    input_ids = checked_input_ids(field(tensors, "input_ids", reader, "the tokens the routes belong to"), reader)
    mask_BS = None
    if not input_ids.is_nested:
        mask_BS = checked_mask(
            field(tensors, "attention_mask", reader, "which positions hold tokens"),
            input_ids,
            input_ids.size(0),
            reader,
        )
    rows = list(sample_rows(routes, input_ids, mask_BS))  # one route row per token, per sample, or RowCountError
    _check_geometry(routes, geometry, reader)
    _check_expert_ids(routes, geometry, reader)

    digests = non_tensor.get(DIGEST_KEY, None)
    if digests is not None:
        check_route_digests(digests, routes, input_ids, mask_BS)
    elif not unchecked:
        raise UncheckedRoutesError(
            f"{reader}: routed_experts has no '{DIGEST_KEY}' column, so nothing ties its rows to the batch's tokens "
            "(a shift, a dropped row or swapped samples would replay silently). Put the routes with "
            "put_routes(..., form='compact') (token ids inside) or form='dense' (writes the digest), or pass "
            "unchecked=True to replay verl's own routed_experts without a token check"
        )

    spans = _unrouted_spans(routes, input_ids, tensors, reader) if digests is None and not recorded else None
    values = (routes.values() if routes.is_nested else routes).clone()
    _clear_dense_columns(values, routes.is_nested, geometry, rows, reader)
    if spans is not None:
        _clear_unrouted(values, routes.is_nested, spans, mask_BS)
    if routes.is_nested:
        return torch.nested.nested_tensor_from_jagged(values, offsets=routes.offsets())  # type: ignore[attr-defined]
    return values


def _check_geometry(routes: torch.Tensor, geometry: RouteGeometry | None, reader: str) -> None:
    if geometry is None:
        return
    layers, top_k = int(routes.shape[-2]), int(routes.shape[-1])
    if top_k != geometry.top_k or layers not in (geometry.num_layers, len(geometry.moe_layers)):
        raise BatchGeometryError(
            f"{reader}: routed_experts has {layers} layer columns of top-{top_k} for a model with "
            f"{geometry.num_layers} layers ({len(geometry.moe_layers)} MoE) of top-{geometry.top_k}: the routes "
            "were captured on another model"
        )


def _check_expert_ids(routes: torch.Tensor, geometry: RouteGeometry | None, reader: str) -> None:
    """With the model's geometry, every entry is an expert id in [0, E) or -1 (no route): `ExpertIdRangeError`."""
    import torch

    if geometry is None:
        return
    values = routes.values() if routes.is_nested else routes
    bad = (values < -1) | (values >= geometry.num_experts)
    if not bool(bad.any()):
        return
    at = [int(i) for i in bad.nonzero()[0]]
    if routes.is_nested:  # (N, P, K) values: the sample from the offsets, the position within it
        cu = routes.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]
        b = int(torch.searchsorted(cu, at[0], right=True)) - 1
        where = [b, at[0] - int(cu[b]), *at[1:]]
    else:
        where = at
    b, s, layer, slot = where
    raise ExpertIdRangeError(
        f"{reader}: sample {b}, position {s}, layer column {layer}, slot {slot}: expert id "
        f"{int(values[tuple(at)])} is not an expert of the model (E={geometry.num_experts}: ids in "
        f"[0, {geometry.num_experts}), -1 for no route); {int(bad.sum())} entries are out of range: the routes "
        "were captured on another model or the tensor is corrupt"
    )


def _clear_dense_columns(
    values: torch.Tensor, jagged: bool, geometry: RouteGeometry | None, rows: list[Any], reader: str
) -> None:
    """An all-layer payload's dense (router-less) columns: only 0 / -1 allowed, and -1 from here on."""
    if geometry is None or values.shape[-2] != geometry.num_layers or geometry.num_layers == len(geometry.moe_layers):
        return
    dense = [layer for layer in range(geometry.num_layers) if layer not in set(geometry.moe_layers)]
    for b, (_, routes_NPK) in enumerate(rows):
        column_NDK = routes_NPK[:, dense]
        wrong = (column_NDK != 0) & (column_NDK != -1)
        if bool(wrong.any()):
            token, d, _ = (int(i) for i in wrong.nonzero()[0])
            raise DenseLayerRouteError(
                f"{reader}: sample {b}, token {token}: dense layer {dense[d]} (no router) holds expert ids "
                f"{column_NDK[token, d].tolist()}; the payload's layer axis is not this model's "
                f"({geometry.num_layers} layers, MoE {list(geometry.moe_layers)}) or another layer's routes sit there"
            )
    values[..., dense, :] = -1


def _unrouted_spans(routes: torch.Tensor, input_ids: torch.Tensor, tensors: Any, reader: str) -> list[tuple[int, int]]:
    """Per sample, the [begin, end) of its rows (padded: positions of its row; jagged: rows of the values) from
    which no engine routed: from its last generated token (the last `response_mask` 1) on. Every mask is checked
    here, before the routes are copied."""
    import torch

    mask_BS = checked_mask(
        field(tensors, "attention_mask", reader, "where verl's zero rows are padding"), None, input_ids.size(0), reader
    )
    width = mask_BS.shape[1]
    prompt_width = checked_prompt_width(
        field(tensors, "prompts", reader, "the prompt width"), width, mask_BS.shape[0], reader
    )
    generated_BR = checked_response_mask(
        field(tensors, "response_mask", reader, "which response tokens the engine generated"),
        mask_BS.shape[0],
        width - prompt_width,
        reader,
    ).to(mask_BS.device)
    positions_R = torch.arange(width - prompt_width, device=mask_BS.device)
    last_B = torch.where(generated_BR, positions_R, -1).max(1).values.tolist()  # -1: nothing generated or routed
    if not routes.is_nested:
        return [(prompt_width + last if last >= 0 else 0, width) for last in last_B]
    cu = routes.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]
    if bool((mask_BS.sum(1).cpu() != cu.diff()).any()):
        raise BatchFieldError(
            f"{reader}: attention_mask counts {mask_BS.sum(1).tolist()} tokens per sample but routed_experts "
            f"holds {cu.diff().tolist()} rows; keep the batch's own mask with its routes"
        )
    prompt_lens = mask_BS[:, :prompt_width].sum(1).tolist()
    return [
        (int(cu[b]) + (int(prompt_lens[b]) + last if last >= 0 else 0), int(cu[b + 1])) for b, last in enumerate(last_B)
    ]


def _clear_unrouted(
    values: torch.Tensor, jagged: bool, spans: list[tuple[int, int]], mask_BS: torch.Tensor | None
) -> None:
    """verl's zero padding -> -1 where verl's masks say no engine routed the position (module docstring)."""
    if values.shape[-1] >= 2:
        values[(values == 0).all(-1)] = -1  # a duplicated expert is never a route
    if not jagged:
        assert mask_BS is not None
        values[mask_BS.to(values.device) == 0] = -1
    for b, (begin, end) in enumerate(spans):
        if jagged:
            values[begin:end] = -1
        else:
            values[b, begin:end] = -1


__all__ = ["VERL_ROUTES_KEY", "routed_experts_for_batch"]
