"""The route-delivery scenario one rank runs (`python -m tests.distributed.worker delivery DIR`, 4 ranks).

Every rank runs, in order, on the batch of `tests/distributed/delivery_case.py`:

1. `scatter_bundles`: rank 0, the only rank that builds the store, cuts one bundle per rank's layout
   plan (`bundles_for`) and scatters them; every rank keeps the bytes it received and their decoding.
2. `broadcast_dense`: the baseline, rank 0's dense (B, S, L, K) int16 batch to every rank; each rank
   keeps its plan's rows of it (`gather`) and how many bytes it received.
3. `exchange_bundles`: rank r now plays the rollout worker colocated with trainer rank r, holding only
   samples 2r and 2r + 1 in its own store; it sends each rank the rows of that rank's plan it holds,
   and merges what it receives from every holder into its rows.
4. Refusals, each checked on every rank with `pytest.raises` (a failed check ends the job): a forged
   header announcing 2**62 bytes to rank 2 (rank 0 writes the documented header by hand), real bundles
   above every rank's `max_bytes`, and a bundles list one short. Every rank raises; none waits.
5. A last `scatter_bundles`, to show the group still works after the refusals.

Legend: P = rows of this rank's layout, L = MoE layers, K = top-k, B = samples, S = positions, W = ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from routereplay.errors import DeliveryError, DeliveryLimitError
from routereplay.layout.plan import gather
from routereplay.transport.bundle import RankBundle
from routereplay.transport.distributed import broadcast_dense, exchange_bundles, scatter_bundles
from routereplay.transport.spans import bundles_for, spans_of
from tests.distributed import delivery_case as case

FORGED = 2**62  # a size no rank could allocate: refused before, or the job dies in torch.empty


def deliver(_: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    assert world == case.WORLD, f"the delivery case is laid out for {case.WORLD} ranks, got {world}"
    S = case.positions()
    plan_P = case.rank_plan(rank)
    store = case.build_store() if rank == 0 else None
    bundles = bundles_for(store, case.SAMPLE_IDS, case.plans(), S) if store is not None else None

    received = scatter_bundles(bundles, src=0)
    rows_PLK = _decoded(received, plan_P)

    shape = (case.SAMPLES, S, case.LAYERS, case.TOP_K)
    dense = case.dense_routes(store) if store is not None else None
    dense_BSLK = broadcast_dense(dense, shape=shape, dtype=torch.int16, src=0)

    held = [2 * rank, 2 * rank + 1]
    local = case.build_store(held=held)
    outgoing = []
    for target_plan_P in case.plans():
        mine_P = case.local_plan(target_plan_P, held)
        held_ids = [case.SAMPLE_IDS[i] for i in held]
        outgoing.append(bundles_for(local, held_ids, [mine_P], S)[0] if spans_of(mine_P, S) else b"")
    incoming = exchange_bundles(outgoing)
    merged_PLK = torch.full_like(rows_PLK, -1)
    for data in incoming:
        if data:
            part_PLK = _decoded(data, plan_P)
            routed_P = (part_PLK != -1).any(-1).any(-1)
            assert not bool((routed_P & (merged_PLK != -1).any(-1).any(-1)).any()), "two holders sent one row"
            merged_PLK[routed_P] = part_PLK[routed_P]

    _refusals(rank, bundles, outgoing)
    again = scatter_bundles(bundles, src=0)
    return {
        "received": torch.from_numpy(np.frombuffer(received, np.uint8).copy()),
        "rows": rows_PLK,
        "dense_bytes": dense_BSLK.numel() * dense_BSLK.element_size(),
        "dense_rows": gather(dense_BSLK, plan_P, source_dims=2),
        "exchanged_bytes": [len(data) for data in incoming],
        "exchanged_sent": [len(data) for data in outgoing],
        "exchanged_rows": merged_PLK,
        "again_equal": again == received,
    }


def _refusals(rank: int, bundles: list[bytes] | None, outgoing: list[bytes]) -> None:
    # a forged announcement, written by hand in the documented header layout: status, then W sizes
    if rank == 0:
        header_W = torch.tensor([0, 10, 10, FORGED, 10], dtype=torch.int64)
        dist.broadcast(header_W, src=0)
    else:
        mine = r" \(this rank\)" if rank == 2 else ""
        with pytest.raises(DeliveryLimitError, match=rf"gives group rank 2{mine} {FORGED} bytes, outside"):
            scatter_bundles(None, src=0)
    # real bundles, every one above max_bytes: every rank refuses, the source included
    with pytest.raises(DeliveryLimitError, match=r"outside \[0, max_bytes=64\]; refused before allocating"):
        scatter_bundles(bundles, src=0, max_bytes=64)
    # one bundle short: the source refuses, and tells every rank, which raise too instead of waiting
    short = bundles[:-1] if bundles is not None else None
    given = r" \(it was given 3 entries of \['bytes'\]\)" if rank == 0 else ""
    with pytest.raises(
        DeliveryError, match=rf"refused to send: its list does not hold one bundle per rank of the group{given};"
    ):
        scatter_bundles(short, src=0)
    # all-to-all: one rank's list one short, then more than every rank's max_bytes
    mine = r" \(this rank\)" if rank == 3 else ""
    with pytest.raises(DeliveryError, match=rf"group rank 3{mine} refused the exchange: its list does not hold"):
        exchange_bundles(outgoing[:-1] if rank == 3 else outgoing)
    with pytest.raises(DeliveryLimitError, match=r"more than max_bytes=8 bytes in all .* refused before allocating"):
        exchange_bundles(outgoing, max_bytes=8)


def _decoded(data: bytes, plan_P: torch.Tensor) -> torch.Tensor:
    """(P, L, K) int16 rows of a received bundle, checked to be laid out for this rank's P rows."""
    return torch.from_numpy(RankBundle(data, expected_rows=plan_P.numel()).decode()).to(torch.int16)
