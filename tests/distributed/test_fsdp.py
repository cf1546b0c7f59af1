"""Router replay under FSDP2 (`fully_shard`, CPU gloo mesh, 2 ranks): data parallel == one process.

Proves that `attach()` binds the routers of an FSDP2-wrapped model whether it is called before or
after `fully_shard`, that replay forces the given experts on the sharded model (also when
activation checkpointing recomputes the layers during backward), and that two ranks each
replaying their half of a batch give the averaged loss and the full gradients of one process
replaying the whole batch. Negative controls keep the equality meaningful: without replay, or with
each rank replaying the other rank's half, the gradients are far off.

Legend: B = batch rows, S = positions, L = MoE layers, K = top-k.
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
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32; only the reduction order differs (sum of halves vs whole)
FAR = 5e-3  # relative gradient change a negative control must exceed (measured: ~3e-2; equal runs: ~3e-7)


@pytest.mark.parametrize(
    ("attach_order", "checkpointing"),
    [("after", False), ("before", False), ("after", True)],
    ids=["attach-after-shard", "attach-before-shard", "attach-after-shard-checkpointing"],
)
def test_fsdp2_data_parallel_replay_equals_single_process(
    tmp_path: Path, attach_order: str, checkpointing: bool
) -> None:
    from routereplay import attach

    model = tiny_moe()
    config = model.config
    ids_BS = token_ids(4, 8, config.vocab_size, seed=1)
    routes_BSLK = forced_routes(4, 8, config.num_hidden_layers, config.num_experts_per_tok, config.num_experts, 2)
    save(
        tmp_path / "case.pt",
        {
            "state": model.state_dict(),
            "ids": ids_BS,
            "routes": routes_BSLK,
            "attach": attach_order,
            "checkpointing": checkpointing,
        },
    )
    launch("fsdp", tmp_path, world_size=WORLD)
    ranks = [load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    replayer = attach(model)  # the reference: one process, the whole batch, the same routes
    labels_BS = next_token_labels(ids_BS)
    count = int((labels_BS != IGNORE).sum())
    with replayer.replay(routes_BSLK):
        loss = summed_token_loss(model(input_ids=ids_BS).logits, labels_BS) / count
        loss.backward()
    reference = gradients(model)
    model.zero_grad(set_to_none=True)
    (summed_token_loss(model(input_ids=ids_BS).logits, labels_BS) / count).backward()  # natural routing
    assert relative_change(gradients(model), reference) > FAR, "replay must matter, or equality proves nothing"
    rows = ids_BS.shape[0] // WORLD
    for rank, result in enumerate(ranks):
        assert result["sharded"] == "DTensor", "the router weight is not sharded: fully_shard did not apply"
        assert result["bound"] == [b.name for b in replayer.bindings], f"rank {rank} bound other routers"
        assert torch.equal(
            result["routes_used"].long().sort(-1).values, routes_BSLK[rank * rows : (rank + 1) * rows].sort(-1).values
        ), f"rank {rank} did not route its half of the batch through the forced experts"
        assert result["fallback_rows"] == 0
        expected_recomputes = len(replayer.layers) if checkpointing else 0
        assert result["recompute_calls"] == expected_recomputes, "checkpoint recompute ran outside the replay"
        assert relative_change(result["wrong_shard_grads"], reference) > FAR, "the other rank's half must differ"
        torch.testing.assert_close(result["loss"], loss.detach(), **TOL)
        for name, grad in reference.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
