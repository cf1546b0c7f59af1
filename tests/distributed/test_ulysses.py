"""Router replay under Ulysses sequence parallelism (2 ranks, gloo): the shards add up to one process.

Each rank holds a contiguous half of every sequence's positions (`layout.parallel.ulysses_shard`;
the length is odd, so the last rank's shard ends with a padding position whose route is -1), its
global position ids, and its shard of the routes; attention runs over the full sequence through
the all-to-all attention of tests/distributed/ulysses.py, registered with transformers'
AttentionInterface. Proves that the summed loss and the summed gradients of the ranks equal a
single process replaying the unsharded routes on the unsharded batch (whose attention is the
model's own eager attention), that the logits and the routes each rank used, gathered and
unsharded, equal the single-process ones, and that the padding rows fall back to the live router
and are counted. Negative controls: without replay, or with each rank replaying the other rank's
shard, the gradients are far off.

Legend: B = batch rows, S = positions, L = MoE layers, K = top-k, V = vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.case import (
    IGNORE,
    forced_routes,
    gradients,
    load,
    next_token_labels,
    relative_change,
    save,
    summed_token_loss,
    tiny_moe,
    token_ids,
)
from tests.distributed.launch import launch

pytestmark = pytest.mark.hf

WORLD = 2
BATCH, POSITIONS = 2, 11  # odd: the sequence is padded to 12, each rank holds 6 positions
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32; SDPA on head shards vs eager attention, summed in another order
FAR = 5e-3  # relative gradient change a negative control must exceed (measured: ~3e-2; equal runs: ~3e-7)


def test_ulysses_sequence_parallel_replay_equals_single_process(tmp_path: Path) -> None:
    from routereplay import attach

    model = tiny_moe()
    config = model.config
    layers = config.num_hidden_layers
    ids_BS = token_ids(BATCH, POSITIONS, config.vocab_size, seed=3)
    routes_BSLK = forced_routes(BATCH, POSITIONS, layers, config.num_experts_per_tok, config.num_experts, 4)
    save(tmp_path / "case.pt", {"state": model.state_dict(), "ids": ids_BS, "routes": routes_BSLK})
    launch("ulysses", tmp_path, world_size=WORLD)
    ranks = [load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    replayer = attach(model)  # the reference: one process, unsharded, the same routes
    labels_BS = next_token_labels(ids_BS)
    count = int((labels_BS != IGNORE).sum())
    with replayer.replay(routes_BSLK):
        logits_BSV = model(input_ids=ids_BS).logits
        loss = summed_token_loss(logits_BSV, labels_BS) / count
        loss.backward()
    reference = gradients(model)
    model.zero_grad(set_to_none=True)
    (summed_token_loss(model(input_ids=ids_BS).logits, labels_BS) / count).backward()  # natural routing
    assert relative_change(gradients(model), reference) > FAR, "replay must matter, or equality proves nothing"

    padding = -POSITIONS % WORLD
    assert padding, "the test must exercise a padded shard"
    local = (POSITIONS + padding) // WORLD
    for rank, result in enumerate(ranks):
        assert torch.equal(result["routes_used"].long().sort(-1).values, routes_BSLK.sort(-1).values), (
            f"rank {rank}: the routes the ranks used, gathered and unsharded, are not the forced routes"
        )
        padded = padding if rank == WORLD - 1 else 0  # the padding lands on the last rank
        assert result["fallback_rows"] == BATCH * padded * layers, (
            f"rank {rank}: exactly the padding rows (-1 routes) fall back to the live router"
        )
        assert result["replayed_rows"] == BATCH * (local - padded) * layers
        assert relative_change(result["wrong_shard_grads"], reference) > FAR, "another rank's shard must differ"
        torch.testing.assert_close(result["logits"], logits_BSV.detach(), **TOL)
        torch.testing.assert_close(result["loss"], loss.detach(), **TOL)
        for name, grad in reference.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
