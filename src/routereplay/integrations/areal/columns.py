"""The two routes columns of an AReaL episode dict: what the rollout side writes and the trainer side reads.

AReaL 1.0.4's workflows return one episode as a dict of `[1, S, ...]` tensors (`input_ids`, `loss_mask`,
`logprobs`, `versions`, `attention_mask`; `workflow/rlvr.py` l.163-178). routereplay adds two more of the same
form, so AReaL's own `concat_padded_tensors` (pads with 0), `split_padded_tensor_dict_into_mb_list`,
`pack_tensor_dict` (-> `[T, M, K]` and `[T]`) and `pad_mb_list` carry them beside `input_ids`:

- `ROUTES_KEY` `[1, S, M, K]`: the experts routed at each position, M = the model's MoE layers only, ascending
  (`RouteGeometry.moe_layers`), K = top-k; int16 when E <= 32767 else int32 (`route_dtype`); a row of -1 where no
  engine call routed that position (the sequence's last token, tokens no later call prefilled). A row is a SET.
- `TOKENS_KEY` `[1, S]` int32: the token id the engine routed at that position (the call's own input + output
  tokens), -1 exactly where the row is -1. The trainer checks it against its `input_ids` (the token check).

`episode_columns(trace, input_ids)` builds both from an episode's merged `RouteTrace` (`episode_routes.py`);
`check_columns` reads them back in any layout that keeps the last two axes (the episode's `[1, S]`, AReaL's padded
`[B, S]`, packed `[T]`): shape, dtype, ids in [0, E) or whole -1 rows, no repeated id in a row, token column -1
exactly on -1 rows, and the token ids against `input_ids` where given. Positions outside `valid` (AReaL's zero
padding: its rows are 0, not -1) are not read.

Nothing here imports AReaL. Legend: S = positions of an episode (B, S padded; T packed), M = MoE layers, K = top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from routereplay.errors import (
    BatchFieldError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    PartialRowError,
    TokenMismatchError,
    TopKMismatchError,
)
from routereplay.trace.route_trace import RouteTrace

ROUTES_KEY = "routereplay_routes"
TOKENS_KEY = "routereplay_route_tokens"
NO_ROUTE = -1
ROUTE_DTYPES = (torch.int16, torch.int32, torch.int64)  # what a reader accepts (a trainer may widen the column)
TOKEN_DTYPES = (torch.int32, torch.int64)


def route_dtype(num_experts: int) -> torch.dtype:
    """The routes column's dtype for a model with `num_experts` experts: int16 when every id and -1 fit, else int32."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def episode_columns(trace: RouteTrace, input_ids: Any) -> dict[str, torch.Tensor]:
    """The two columns of one episode, `[1, S, M, K]` and `[1, S]`, from its merged trace over `input_ids` (S ids).

    `trace` rows cover positions [trace.start, trace.stop) within [0, S) and name their tokens (`token_ids`, the
    tokens each call saw); a named token that differs from `input_ids` raises `TokenMismatchError`."""
    ids_S = torch.as_tensor(input_ids).reshape(-1)
    length = int(ids_S.numel())
    if trace.stop > length:
        raise BatchFieldError(
            f"the episode's routes cover positions [{trace.start}, {trace.stop}) but its input_ids hold {length} "
            "tokens: the trace belongs to a longer sequence; build it over the episode's own input_ids"
        )
    experts_TMK = np.asarray(trace.experts)
    routed_TM = experts_TMK[..., 0] >= 0
    partial_T = routed_TM.any(axis=1) & ~routed_TM.all(axis=1)
    if partial_T.any():
        at = trace.start + int(np.flatnonzero(partial_T)[0])
        raise PartialRowError(
            f"position {at} is routed in some MoE layers and -1 in others ({int(partial_T.sum())} such positions): "
            "a call's routes were cut per layer; each position needs every layer's row or none"
        )
    routed_T = np.asarray(routed_TM.all(axis=1), dtype=bool)
    named_T = trace.token_ids if trace.token_ids is not None else np.full(len(experts_TMK), NO_ROUTE, dtype=np.int64)
    if (routed_T & (named_T < 0)).any():
        raise BatchFieldError(
            "the episode's trace does not name the token of every routed row (token_ids -1 or absent): build it "
            "with EpisodeRoutes, whose rows name the tokens each engine call saw"
        )
    tokens_T = np.where(routed_T, named_T, NO_ROUTE)
    episode_T = ids_S[trace.start : trace.stop].numpy().astype(np.int64)
    differ_T = routed_T & (tokens_T != episode_T)
    if differ_T.any():
        row = int(np.flatnonzero(differ_T)[0])
        raise TokenMismatchError(
            f"the episode's input_ids hold token {int(episode_T[row])} at position {trace.start + row} where the "
            f"engine routed token {int(tokens_T[row])} ({int(differ_T.sum())} such positions): its routes would replay "
            "on other tokens. Return the tokens the engine saw and generated (resp.input_tokens + resp.output_tokens)"
        )
    routes_SMK = torch.full((length, trace.num_layers, trace.top_k), NO_ROUTE, dtype=route_dtype(trace.num_experts))
    routes_SMK[trace.start : trace.stop] = torch.from_numpy(np.where(routed_T[:, None, None], experts_TMK, NO_ROUTE))
    tokens_S = torch.full((length,), NO_ROUTE, dtype=torch.int32)
    tokens_S[trace.start : trace.stop] = torch.from_numpy(tokens_T.astype(np.int32))
    return {ROUTES_KEY: routes_SMK.unsqueeze(0), TOKENS_KEY: tokens_S.unsqueeze(0)}


def check_columns(
    routes: Any,
    tokens: Any,
    *,
    num_experts: int,
    num_moe_layers: int,
    top_k: int,
    valid: Any = None,
    input_ids: Any = None,
    where: str = "the batch",
) -> int:
    """Read the two columns back in any layout (`[..., M, K]` routes, `[...]` tokens); returns the routed positions.

    `valid` (bool, the tokens' shape, e.g. AReaL's `attention_mask`) marks the real positions: padding is not read.
    `input_ids` (the tokens' shape) turns on the token check: `tokens == input_ids` wherever the row is routed."""
    if not isinstance(routes, torch.Tensor) or not isinstance(tokens, torch.Tensor):
        raise BatchFieldError(
            f"{where}: '{ROUTES_KEY}' and '{TOKENS_KEY}' must be torch tensors, got {type(routes).__name__} and "
            f"{type(tokens).__name__}"
        )
    if routes.dtype not in ROUTE_DTYPES or tokens.dtype not in TOKEN_DTYPES:
        raise DtypeError(
            f"{where}: '{ROUTES_KEY}' is {routes.dtype} and '{TOKENS_KEY}' {tokens.dtype}; the contract's are int16 / "
            "int32 (signed: -1 marks a position no call routed) and int32"
        )
    if routes.dim() != tokens.dim() + 2 or routes.shape[:-2] != tokens.shape:
        raise BatchFieldError(
            f"{where}: '{ROUTES_KEY}' of shape {tuple(routes.shape)} does not sit on '{TOKENS_KEY}' of shape "
            f"{tuple(tokens.shape)}: the routes need one [M, K] row per token position"
        )
    if routes.shape[-2] != num_moe_layers:
        raise LayerCountError(
            f"{where}: '{ROUTES_KEY}' has {routes.shape[-2]} layers per row, the model {num_moe_layers} MoE layers: "
            "rows hold the MoE layers only (RouteGeometry.moe_layers); check the model the rollout ran"
        )
    if routes.shape[-1] != top_k:
        raise TopKMismatchError(
            f"{where}: '{ROUTES_KEY}' has {routes.shape[-1]} experts per row, the model routes top-{top_k}"
        )
    keep = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else torch.as_tensor(valid).to(torch.bool)
    if keep.shape != tokens.shape:
        raise BatchFieldError(
            f"{where}: valid of shape {tuple(keep.shape)} must have the tokens' {tuple(tokens.shape)}"
        )
    rows_PMK, tokens_P = routes[keep].long(), tokens[keep].long()
    bad = (rows_PMK < NO_ROUTE) | (rows_PMK >= num_experts)
    if bad.any():
        value = int(rows_PMK[bad][0])
        raise ExpertIdRangeError(
            f"{where}: '{ROUTES_KEY}' holds expert id {value} ({int(bad.sum())} such ids); ids must lie in "
            f"[0, {num_experts}) or be -1 for a whole unrouted row"
        )
    unrouted_PM = rows_PMK.eq(NO_ROUTE)
    partial = unrouted_PM.any(dim=(-2, -1)) & ~unrouted_PM.all(dim=(-2, -1))
    if partial.any():
        raise PartialRowError(
            f"{where}: {int(partial.sum())} positions mix -1 with expert ids across their layers / slots; a position "
            "is routed in every MoE layer or in none"
        )
    routed_P = ~unrouted_PM.all(dim=(-2, -1))
    if top_k > 1:
        ordered = rows_PMK[routed_P].sort(dim=-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if repeated.any():
            raise DuplicateExpertError(
                f"{where}: {int(repeated.sum())} (position, layer) rows of '{ROUTES_KEY}' name an expert twice: a row "
                "is a set of top_k distinct experts (zero padding read as a route?)"
            )
    if not torch.equal(tokens_P.ne(NO_ROUTE), routed_P) or (tokens_P < NO_ROUTE).any():
        raise BatchFieldError(
            f"{where}: '{TOKENS_KEY}' is -1 at {int(tokens_P.eq(NO_ROUTE).sum())} positions but "
            f"{int((~routed_P).sum())} rows are -1: the token column must be -1 exactly on the unrouted rows (and a "
            "token id >= 0 elsewhere)"
        )
    if input_ids is not None:
        ids = torch.as_tensor(input_ids)
        if ids.shape != tokens.shape:
            raise BatchFieldError(f"{where}: input_ids {tuple(ids.shape)} must have the tokens' {tuple(tokens.shape)}")
        differ_P = routed_P & tokens_P.ne(ids[keep].long())
        if differ_P.any():
            at = int(torch.nonzero(differ_P)[0, 0])
            raise TokenMismatchError(
                f"{where}: routed position {at} (of the real positions, in order) holds token {int(ids[keep][at])} "
                f"but its routes were captured for token {int(tokens_P[at])} ({int(differ_P.sum())} such positions): "
                "the rows moved off their tokens (a packing or padding mismatch); keep the columns beside input_ids"
            )
    return int(routed_P.sum())


__all__ = ["NO_ROUTE", "ROUTES_KEY", "TOKENS_KEY", "check_columns", "episode_columns", "route_dtype"]
