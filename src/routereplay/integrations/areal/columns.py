"""The two routes columns of an AReaL episode dict: what the rollout side writes and the trainer side reads.

AReaL 1.0.4's workflows return one episode as a dict of `[1, S, ...]` tensors (`input_ids`, `loss_mask`,
`logprobs`, `versions`, `attention_mask`; `workflow/rlvr.py` l.163-178). routereplay adds two more of the same
form, which AReaL's own `concat_padded_tensors` (pads with 0) makes `[B, S, ...]` beside `input_ids`:

- `ROUTES_KEY` `[1, S, M, K]`: the experts routed at each position, M = the model's MoE layers only, ascending
  (`RouteGeometry.moe_layers`), K = top-k; int16 when E <= 32767 else int32 (`route_dtype`); a row of -1 where no
  engine call routed that position (the sequence's last token, tokens no later call prefilled). A row is a SET.
- `TOKENS_KEY` `[1, S]` int32: the token id the engine routed at that position (the call's own input + output
  tokens), -1 exactly where the row is -1. The trainer checks it against its `input_ids` (the token check).

`pack_tensor_dict` packs them (`[T, M, K]`, `[T]`), but AReaL's micro-batching splits a key only when its
`numel()` is `B * S` and pads a packed key only when it is `T`, so in the actor the `[B, S, M, K]` routes would
reach every micro-batch whole: the trainer side (`packed_layout.py`) takes both columns off at the actor's entry
and hands AReaL a `[B, S]` row-index column instead.

`episode_columns(trace, input_ids)` builds both from an episode's merged `RouteTrace` (`episode_routes.py`);
`check_columns` is the one reader (the rollout's tests and the trainer's actor use it): `[S, M, K]` on `[S]` or
`[B, S, M, K]` on `[B, S]`: shape, dtype, layers, top-k, each sequence's rows through the core's catalogue
(`RouteTrace.validate`), whole-position -1 rows, token column -1 exactly on -1 rows, and the token check against
`input_ids` where given (`require_route_tokens`). Positions outside `valid` (AReaL's zero padding: its rows are
0, not -1) are not read.

Nothing here imports AReaL. Legend: S = positions of an episode (B, S padded; T packed), M = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from routereplay.errors import (
    BatchFieldError,
    DtypeError,
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
FED_FIX = "keep the columns beside input_ids (a packing or padding step moved them)"


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
    moe_layers: Sequence[int] | None = None,
    valid: Any = None,
    input_ids: Any = None,
    where: str = "the batch",
    fix: str = FED_FIX,
) -> int:
    """Read the two columns back (`[S, M, K]` / `[B, S, M, K]` routes on `[S]` / `[B, S]` tokens); returns the
    routed positions. The one reader of the contract: the trainer's actor reads every batch through it.

    After AReaL's `compute_advantages` (`batched_call` -> `split_and_unpad_tensor`) a trajectory's `input_ids` and
    token column are trimmed to its length but its routes keep the batch's padded length: read `routes[:, :S]`
    (the actor does).

    `tokens` None: the routes alone (a trainer opted out of the token check with no token column).
    `valid` (bool, the tokens' shape, e.g. AReaL's `attention_mask`) marks the real positions: padding is not read.
    `input_ids` (the tokens' shape) turns on the token check: `tokens == input_ids` wherever the row is routed;
    `fix` ends its message. Rows go through the core's catalogue (`RouteTrace.validate`: ids in [0, E) or -1, no
    row mixing -1 with ids, no repeated id, no all-zero MoE layer), `moe_layers` naming the layers."""
    if not isinstance(routes, torch.Tensor) or not isinstance(tokens, torch.Tensor | None):
        raise BatchFieldError(
            f"{where}: '{ROUTES_KEY}' and '{TOKENS_KEY}' must be torch tensors, got {type(routes).__name__} and "
            f"{type(tokens).__name__}"
        )
    if routes.dtype not in ROUTE_DTYPES or (tokens is not None and tokens.dtype not in TOKEN_DTYPES):
        raise DtypeError(
            f"{where}: '{ROUTES_KEY}' has dtype {routes.dtype}"
            + ("" if tokens is None else f" and '{TOKENS_KEY}' {tokens.dtype}")
            + "; the contract's are int16 / int32 routes (signed: -1 marks a position no call routed; int64 is read "
            "too) and int32 tokens (int64 is read too)"
        )
    positions = routes.shape[:-2] if routes.dim() >= 2 else routes.shape
    if routes.dim() not in (3, 4) or (tokens is not None and tokens.shape != positions):
        raise BatchFieldError(
            f"{where}: '{ROUTES_KEY}' of shape {tuple(routes.shape)} does not sit on '{TOKENS_KEY}' of shape "
            f"{None if tokens is None else tuple(tokens.shape)}: the routes need one [M, K] row per token position "
            "([S, M, K] on [S], or [B, S, M, K] on [B, S])"
        )
    if routes.shape[-2] != num_moe_layers:
        raise LayerCountError(
            f"{where}: '{ROUTES_KEY}' has {routes.shape[-2]} layer columns, the model has {num_moe_layers} MoE layers"
            f"{'' if moe_layers is None else ' ' + str(list(moe_layers))}: rows hold the MoE layers only, ascending "
            "(RouteGeometry.moe_layers); check the model the rollout ran"
        )
    if routes.shape[-1] != top_k:
        cut = routes.shape[-1] < top_k and positions[-1] >= routes.shape[-1]
        raise TopKMismatchError(
            f"{where}: '{ROUTES_KEY}' has top-k {routes.shape[-1]}, the model routes {top_k}"
            + (
                f"; AReaL's compute_advantages (utils/data.py `_unpad_splits`) trims every tensor's LAST axis to the "
                f"trajectory's length, so a trajectory shorter than {top_k} tokens loses experts from its rows: such "
                f"a trajectory cannot carry routes (filter out trajectories shorter than top-k, e.g. with AReaL's "
                "dynamic_filter_fn)"
                if cut
                else ""
            )
        )
    keep = torch.ones(positions, dtype=torch.bool) if valid is None else torch.as_tensor(valid).to(torch.bool)
    if keep.shape != positions:
        raise BatchFieldError(f"{where}: valid of shape {tuple(keep.shape)} must have the tokens' {tuple(positions)}")
    ids = None
    if input_ids is not None:
        ids = torch.as_tensor(input_ids)
        if ids.shape != positions:
            raise BatchFieldError(f"{where}: input_ids {tuple(ids.shape)} must have the tokens' {tuple(positions)}")
    layers = tuple(range(num_moe_layers)) if moe_layers is None else tuple(moe_layers)
    batched = routes.dim() == 4
    routed = 0
    for b in range(routes.shape[0] if batched else 1):
        name = f"{where} row {b}" if batched else where
        keep_S = (keep[b] if batched else keep).cpu()
        rows_PMK = (routes[b] if batched else routes).cpu()[keep_S]
        RouteTrace(rows_PMK.numpy().astype(np.int32), num_experts, layers).validate(name)
        unrouted_PM = rows_PMK[..., 0].eq(NO_ROUTE)
        partial_P = unrouted_PM.any(dim=-1) & ~unrouted_PM.all(dim=-1)
        if partial_P.any():
            raise PartialRowError(
                f"{name}: {int(partial_P.sum())} positions (the first: real position {int(partial_P.nonzero()[0, 0])}) "
                "mix -1 with expert ids across their layers; a position is routed in every MoE layer or in none"
            )
        routed_P = ~unrouted_PM.all(dim=-1)
        routed += int(routed_P.sum())
        if tokens is None:
            continue
        tokens_P = (tokens[b] if batched else tokens).cpu()[keep_S].long()
        wrong_P = tokens_P.ne(NO_ROUTE).ne(routed_P) | (tokens_P < NO_ROUTE)
        if wrong_P.any():
            at = int(wrong_P.nonzero()[0, 0])
            raise BatchFieldError(
                f"{name}, position {at}: '{TOKENS_KEY}' is {int(tokens_P[at])} where the route row is "
                f"{'routed' if bool(routed_P[at]) else '-1'} ({int(wrong_P.sum())} such positions); the token column "
                "must be -1 exactly on the unrouted rows (and a token id >= 0 elsewhere)"
            )
        if ids is not None:
            require_route_tokens(tokens_P, (ids[b] if batched else ids).cpu()[keep_S], name, fix)
    return routed


def require_route_tokens(tokens_N: torch.Tensor, ids_N: torch.Tensor, where: str, fix: str) -> None:
    """The token check over one sequence's real positions: the token each route row was routed for (`tokens_N`,
    -1 where unrouted) equals the sequence's token (`ids_N`); `TokenMismatchError` names the first that is not."""
    routed_N, ids_N = tokens_N.cpu().to(torch.int64), ids_N.cpu().to(torch.int64)
    differ_N = (routed_N >= 0) & (routed_N != ids_N)
    if not bool(differ_N.any()):
        return
    s, n = int(torch.nonzero(differ_N)[0]), int(routed_N.shape[0])
    shifted = any(0 <= s + d < n and int(routed_N[s]) == int(ids_N[s + d]) for d in (-1, 1))
    hint = " (the neighbouring position holds it: rows shifted by one)" if shifted else ""
    raise TokenMismatchError(
        f"{where}, position {s}: the route row was routed for token {int(routed_N[s])} but input_ids holds "
        f"{int(ids_N[s])}{hint}; {int(differ_N.sum())} of {int((routed_N >= 0).sum())} routed positions differ, so "
        f"the routes belong to other tokens (rows moved against input_ids, or trajectories swapped). Fix: {fix}"
    )


__all__ = [
    "NO_ROUTE",
    "ROUTES_KEY",
    "TOKENS_KEY",
    "check_columns",
    "episode_columns",
    "require_route_tokens",
    "route_dtype",
]
