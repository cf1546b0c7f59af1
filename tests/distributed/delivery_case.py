"""The batch the route-delivery tests deliver, and the single-process layout every rank must match.

Eight samples of random routes (`routereplay.testing.synthetic.random_trace`) in a `RouteStore`, on
DP = 2 x SP = 2 = 4 trainer ranks: global rank r = d * SP + p holds DP share d (samples 4d .. 4d + 3
of the padded (B, S) batch), packed into one THD row (`pack` of `unpad` by the attention mask), and
its Ulysses SP slice p of that row (`ulysses_shard`; the last slice ends in a padding row). The two
DP shares hold the same lengths in another order, so every rank gets about a quarter of the rows.
The routes have holes, as real ones do: random unrouted (token, layer) rows, a multi-turn sample kept
as two pieces, and a sample whose tool-call tokens no engine routed.

Each rank can build its own plan from the lengths alone (its layout); only the source builds the store.

Legend: B = samples, S = positions (the longest sample's tokens), P = rows of one rank's layout,
L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from routereplay.layout.packing import pack
from routereplay.layout.padding import attention_mask_of, unpad
from routereplay.layout.parallel import ulysses_shard
from routereplay.layout.plan import token_index
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.trace.route_trace import RouteTrace
from routereplay.transport.spans import bundles_for

DP, SP = 2, 2
WORLD = DP * SP
SAMPLES = 8
LAYERS, TOP_K, EXPERTS = 4, 4, 32
SHARE = SAMPLES // DP
SEED = 16  # share lengths 135, 139, 175, 120: an odd total, so the last SP slice ends in padding
SAMPLE_IDS = [f"sample-{i}" for i in range(SAMPLES)]


def lengths(seed: int = SEED) -> list[int]:
    """Token counts of the samples: share 1 holds share 0's lengths reversed (equal DP shares)."""
    first = np.random.default_rng(seed).integers(60, 200, SHARE).tolist()
    return [int(n) for n in first + first[::-1]]


def positions(seed: int = SEED) -> int:
    """S: the padded batch's positions per row."""
    return max(lengths(seed))


def build_store(seed: int = SEED, held: list[int] | None = None) -> RouteStore:
    """The rollout's store: every sample's tokens and routes, with holes (see the module docstring);
    with `held`, only those samples (a colocated rollout worker's), with the same routes."""
    rng = np.random.default_rng(seed + 1)

    def routes(num_tokens: int, start: int = 0, unrouted: float = 0.0) -> RouteTrace:
        return random_trace(
            rng, num_tokens=num_tokens, num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, start=start,
            unrouted_fraction=unrouted,
        )  # fmt: skip

    store = RouteStore(num_experts=EXPERTS, layers=list(range(LAYERS)), top_k=TOP_K)
    for i, (sample_id, n) in enumerate(zip(SAMPLE_IDS, lengths(seed), strict=True)):
        tokens = rng.integers(0, 1000, n)
        turns: list[tuple[int, RouteTrace | None]]
        if i == 0:  # two engine calls: the second one routes only the new tokens (a second piece)
            m = n // 2
            turns = [(m, routes(m - 1)), (n, routes(n - m, start=m - 1))]
        elif i == 5:  # tool-call tokens after the first turn: no engine routed them, -1 rows
            m = n // 3
            turns = [(m, routes(m - 1)), (n, None)]
        else:
            turns = [(n, routes(n - 1, unrouted=0.2 if i % 2 else 0.0))]
        if held is None or i in held:
            for end, trace in turns:
                store.add_turn(sample_id, tokens[:end], trace)
    return store


def rank_plan(rank: int, seed: int = SEED) -> torch.Tensor:
    """(P,) flat source index b * S + s of each of global rank `rank`'s layout rows, -1 for padding:
    its DP share's rows, packed into one row, then its Ulysses slice."""
    share, sp_rank = divmod(rank, SP)
    rows = slice(share * SHARE, (share + 1) * SHARE)
    S = positions(seed)
    mask_BS = attention_mask_of(lengths(seed), S, "right")
    packed = pack(unpad(token_index(SAMPLES, S)[rows], attention_mask=mask_BS[rows]))
    return ulysses_shard(packed.values, SP, sp_rank)


def plans(seed: int = SEED) -> list[torch.Tensor]:
    return [rank_plan(rank, seed) for rank in range(WORLD)]


def dense_routes(store: RouteStore, seed: int = SEED) -> torch.Tensor:
    """(B, S, L, K) int16 routes of the whole batch, -1 past each trace: what verl broadcasts."""
    S = positions(seed)
    routes_BSLK = torch.full((SAMPLES, S, LAYERS, TOP_K), -1, dtype=torch.int16)
    for b, sample_id in enumerate(SAMPLE_IDS):
        trace = store.trace(sample_id)
        routes_BSLK[b, : trace.num_tokens] = torch.from_numpy(trace.experts)
    return routes_BSLK


def reference(seed: int = SEED) -> dict[str, Any]:
    """The single-process view: the store, every rank's plan and bundle, the whole batch's bundle, the
    dense batch."""
    store = build_store(seed)
    S = positions(seed)
    rank_plans = plans(seed)
    return {
        "store": store,
        "plans": rank_plans,
        "bundles": bundles_for(store, SAMPLE_IDS, rank_plans, S),
        "whole": bundles_for(store, SAMPLE_IDS, [token_index(SAMPLES, S).reshape(-1)], S)[0],
        "dense": dense_routes(store, seed),
    }


def local_plan(plan_P: torch.Tensor, held: list[int], seed: int = SEED) -> torch.Tensor:
    """`plan_P` over a batch of only the samples `held` (batch rows, in that order): rows of other
    samples become -1 (a holder sends only what it holds; the receiver merges the holders' rows)."""
    S = positions(seed)
    local_B = torch.full((SAMPLES,), -1, dtype=torch.int64)
    local_B[held] = torch.arange(len(held))
    sample_P = torch.where(plan_P >= 0, plan_P // S, 0)
    mapped_P = local_B[sample_P] * S + plan_P % S
    return torch.where((plan_P >= 0) & (local_B[sample_P] >= 0), mapped_P, torch.full_like(plan_P, -1))
