"""Trainer-side scoring of rollouts: one padded batch, the log-prob of every response token.

The trainer scores prompt + response, the same tokens the engine saw, right-padded. Position ids
count attended tokens, as the engine's do. Routing is one of three:
- natural (optionally recorded);
- forced from a (B, S, L, K) routes tensor (R2);
- forced from the engine's per-sequence traces (R3).
Under R3 the last token, which the engine never fed, routes live and is counted as a fallback,
and the batch's token ids are checked against the ids the engine routed (`TokenMismatchError` on a
shifted or re-tokenised sequence): the check is on by default.
Legend: B = sequences, S = padded length, V = vocabulary, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from routereplay.engines.hf import Rollout, position_ids_for
from routereplay.errors import ConfigError
from routereplay.runtime import Recording, Replayer
from routereplay.trace.route_trace import RouteTrace


@dataclass(slots=True)
class Batch:
    """Rollouts laid out for the trainer: right-padded ids, mask, response positions, positions."""

    ids_BS: torch.Tensor
    mask_BS: torch.Tensor
    response_BS: torch.Tensor  # True at response tokens (the ones whose log-prob is scored)
    positions_BS: torch.Tensor
    traces: list[RouteTrace | None]  # the engine's routes, per sequence

    def select(self, rows: torch.Tensor) -> Batch:
        index = rows.tolist()
        return Batch(
            self.ids_BS[rows],
            self.mask_BS[rows],
            self.response_BS[rows],
            self.positions_BS[rows],
            [self.traces[i] for i in index],
        )


@dataclass(slots=True)
class ScoredBatch:
    """Padded batch of rollouts and the trainer's log-probs of their response tokens."""

    ids_BS: torch.Tensor
    mask_BS: torch.Tensor
    response_BS: torch.Tensor
    logprobs_BS: torch.Tensor  # log-prob of token s given tokens < s (0 where not a response token)
    routes_BSLK: torch.Tensor | None  # routes the trainer used, when recorded or replayed


def batch_of(rollouts: Sequence[Rollout], pad_token_id: int) -> Batch:
    width = max(len(r.token_ids) for r in rollouts)
    ids_BS = torch.full((len(rollouts), width), pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros((len(rollouts), width), dtype=torch.long)
    response_BS = torch.zeros((len(rollouts), width), dtype=torch.bool)
    for b, rollout in enumerate(rollouts):
        tokens = rollout.token_ids
        ids_BS[b, : len(tokens)] = torch.tensor(tokens)
        mask_BS[b, : len(tokens)] = 1
        response_BS[b, len(rollout.prompt_ids) : len(tokens)] = True
    return Batch(ids_BS, mask_BS, response_BS, position_ids_for(mask_BS), [r.trace for r in rollouts])


def routing(
    replayer: Replayer | None, batch: Batch, routes: torch.Tensor | str | None
) -> AbstractContextManager[Recording | None]:
    """The routing context for a forward (and backward) on `batch`.

    `routes`: None = natural routing (recorded when a replayer is given), a (B, S, L, K) tensor =
    replay it (R2), "engine" = replay the batch's engine traces (R3), checked against the batch's
    token ids. The context value's `.routes` are the routes used.
    """
    if replayer is None:
        if routes is not None:
            raise ConfigError("replaying routes needs a Replayer attached to the model")
        return nullcontext(None)
    if routes is None:
        return replayer.record()
    if isinstance(routes, str):
        if routes != "engine" or any(t is None for t in batch.traces):
            raise ConfigError("routes='engine' (R3) needs the engine's traces: generate with route capture on")
        return replayer.replay(batch.traces, attention_mask=batch.mask_BS, input_ids=batch.ids_BS)  # type: ignore[arg-type]
    return replayer.replay(routes, attention_mask=batch.mask_BS)


def logprobs_of(model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """(B, S) log-probs of the response tokens (0 elsewhere); differentiable when grad is enabled."""
    logits_BSV = model(input_ids=batch.ids_BS, attention_mask=batch.mask_BS, position_ids=batch.positions_BS).logits
    logprobs_BSV = torch.log_softmax(logits_BSV.float() / temperature, dim=-1)
    next_BS = logprobs_BSV[:, :-1].gather(2, batch.ids_BS[:, 1:, None])[..., 0]
    logprobs_BS = torch.cat([torch.zeros_like(next_BS[:, :1]), next_BS], dim=1)
    return logprobs_BS.masked_fill(~batch.response_BS, 0.0)


def token_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    replayer: Replayer | None = None,
    routes: torch.Tensor | str | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (see `logprobs_of`) under `routing(...)`, and the (B, S, L, K) routes used."""
    with routing(replayer, batch, routes) as used:
        logprobs_BS = logprobs_of(model, batch, temperature)
    return logprobs_BS, (None if used is None else used.routes)


def score(
    model: nn.Module,
    rollouts: Sequence[Rollout],
    pad_token_id: int,
    *,
    replayer: Replayer | None = None,
    replay: bool = False,
    temperature: float = 1.0,
) -> ScoredBatch:
    """No-grad trainer log-probs of the rollouts; `replay=True` replays their traces (R3)."""
    batch = batch_of(rollouts, pad_token_id)
    with torch.no_grad():
        logprobs_BS, routes = token_logprobs(
            model, batch, replayer=replayer, routes="engine" if replay else None, temperature=temperature
        )
    return ScoredBatch(batch.ids_BS, batch.mask_BS, batch.response_BS, logprobs_BS, routes)


def engine_logprobs(rollouts: Sequence[Rollout], shape: torch.Size) -> torch.Tensor:
    """The engine's log-probs laid out like `ScoredBatch.logprobs_BS`."""
    logprobs_BS = torch.zeros(shape, dtype=torch.float32)
    for b, rollout in enumerate(rollouts):
        start = len(rollout.prompt_ids)
        logprobs_BS[b, start : start + len(rollout.logprobs)] = torch.tensor(rollout.logprobs)
    return logprobs_BS


def engine_routes(rollouts: Sequence[Rollout], shape: torch.Size, num_layers: int, top_k: int) -> torch.Tensor:
    """The engine's routes laid out like the trainer batch: (B, S, L, K), -1 where it has none."""
    routes_BSLK = torch.full((shape[0], shape[1], num_layers, top_k), -1, dtype=torch.long)
    for b, rollout in enumerate(rollouts):
        if rollout.trace is not None:
            routes_BSLK[b, : rollout.trace.num_tokens] = rollout.trace.to_torch(dtype=torch.long)
    return routes_BSLK


__all__ = [
    "Batch",
    "ScoredBatch",
    "batch_of",
    "engine_logprobs",
    "engine_routes",
    "logprobs_of",
    "routing",
    "score",
    "token_logprobs",
]
