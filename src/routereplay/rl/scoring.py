"""Trainer-side scoring of rollouts: one padded batch, the log-prob of every response token.

The trainer scores prompt + response, the same tokens the engine saw, right-padded. Position ids
count attended tokens, as the engine's do. Under R3 it replays the engine's traces, and the last
token (which the engine never fed) routes live and is counted as a fallback. Legend: B = sequences,
S = padded length, V = vocabulary, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from routereplay.engines.hf import Rollout, position_ids_for
from routereplay.runtime import Replayer


@dataclass(slots=True)
class ScoredBatch:
    """Padded batch of rollouts and the trainer's log-probs of their response tokens."""

    ids_BS: torch.Tensor
    mask_BS: torch.Tensor
    response_BS: torch.Tensor  # True at response-token positions (the tokens whose log-prob is scored)
    logprobs_BS: torch.Tensor  # trainer log-prob of token s given tokens < s (0 where not a response token)
    routes_BSLK: torch.Tensor | None  # routes the trainer used, when recorded or replayed


def batch_of(rollouts: Sequence[Rollout], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r.token_ids) for r in rollouts)
    ids_BS = torch.full((len(rollouts), width), pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros((len(rollouts), width), dtype=torch.long)
    response_BS = torch.zeros((len(rollouts), width), dtype=torch.bool)
    for b, rollout in enumerate(rollouts):
        tokens = rollout.token_ids
        ids_BS[b, : len(tokens)] = torch.tensor(tokens)
        mask_BS[b, : len(tokens)] = 1
        response_BS[b, len(rollout.prompt_ids) : len(tokens)] = True
    return ids_BS, mask_BS, response_BS


def score(
    model: nn.Module,
    rollouts: Sequence[Rollout],
    pad_token_id: int,
    *,
    replayer: Replayer | None = None,
    replay: bool = False,
    temperature: float = 1.0,
) -> ScoredBatch:
    """Trainer log-probs of the rollouts' response tokens; `replay=True` replays their traces (R3)."""
    ids_BS, mask_BS, response_BS = batch_of(rollouts, pad_token_id)
    kwargs = {"input_ids": ids_BS, "attention_mask": mask_BS, "position_ids": position_ids_for(mask_BS)}
    routes = None
    with torch.no_grad():
        if replayer is None:
            logits = model(**kwargs).logits
        elif replay:
            traces = [r.trace for r in rollouts]
            if any(t is None for t in traces):
                raise ValueError("R3 needs the engine's routes: generate with capture on")
            with replayer.replay(traces, attention_mask=mask_BS) as used:  # type: ignore[arg-type]
                logits = model(**kwargs).logits
            routes = used.routes
        else:
            with replayer.record() as rec:
                logits = model(**kwargs).logits
            routes = rec.routes
    logprobs_BSV = torch.log_softmax(logits.float() / temperature, dim=-1)
    next_BS = torch.zeros_like(ids_BS)
    next_BS[:, :-1] = ids_BS[:, 1:]
    logprobs_BS = torch.zeros(ids_BS.shape, dtype=torch.float32)
    logprobs_BS[:, 1:] = logprobs_BSV[:, :-1].gather(2, next_BS[:, :-1, None])[..., 0]
    return ScoredBatch(ids_BS, mask_BS, response_BS, logprobs_BS.masked_fill(~response_BS, 0.0), routes)


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


__all__ = ["ScoredBatch", "batch_of", "engine_logprobs", "engine_routes", "score"]
