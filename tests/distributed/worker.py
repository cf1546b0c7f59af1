"""One rank of a distributed test job: `python -m tests.distributed.worker SCENARIO DIR` (see launch.py).

Scenarios, each run by every rank on the case the parent test saved in `DIR/case.pt`:
- `fsdp`: FSDP2 (`fully_shard` per decoder layer and the root, CPU mesh) data parallel. Each rank
  replays its half of the batch's routes, forward and backward inside the replay context; returns
  the averaged loss, the full (gathered) gradients, the routes each rank used, and, as a negative
  control, the gradients when each rank replays the other rank's half.
- `ulysses`: Ulysses sequence parallel on a replicated model. Each rank holds a contiguous shard of
  every sequence's positions (`ulysses_shard`, padded with -1 routes / IGNORE labels) with their
  global position ids and replays its routes shard; returns the summed loss and summed gradients,
  the routes used and logits gathered and unsharded, the fallback count, and the summed gradients
  when each rank replays the other rank's shard.
- `delivery`: per-rank route delivery on 4 ranks (`scatter_bundles`, `broadcast_dense`,
  `exchange_bundles` and their refusals); see tests/distributed/delivery.py.
- `lying_source`: rank 0 forges `scatter_bundles` headers and payloads; rank 1 must raise, not return
  made-up bytes (see tests/distributed/lying_source.py).
- `failing_rank`: the last rank raises while the others wait in a barrier (the launcher's own test).

Legend: B = batch rows, b = B / P rows of a rank, S = positions, s = positions of a shard,
L = MoE layers, K = top-k, V = vocabulary, P = ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.case import IGNORE, gradients, load, next_token_labels, save, summed_token_loss, tiny_moe

Result = dict[str, Any]


def fsdp_data_parallel(case: dict[str, Any], rank: int, world: int) -> Result:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import routereplay

    ids_BS, routes_BSLK = case["ids"], case["routes"]
    rows = ids_BS.shape[0] // world
    peer = (rank + 1) % world
    mine, other = slice(rank * rows, (rank + 1) * rows), slice(peer * rows, (peer + 1) * rows)
    model = tiny_moe(case["state"])
    if case["checkpointing"]:
        model.gradient_checkpointing_enable()
    replayer = routereplay.attach(model) if case["attach"] == "before" else None
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if replayer is None:
        replayer = routereplay.attach(model)
    ids_bS = ids_BS[mine]
    labels_bS = next_token_labels(ids_bS)
    count = int((labels_bS != IGNORE).sum())  # equal on every rank: the mean of rank means is the mean

    with replayer.replay(routes_BSLK[other]):  # negative control: the other rank's half of the routes
        (summed_token_loss(model(input_ids=ids_bS).logits, labels_bS) / count).backward()
    wrong_grads = gradients(model)
    model.zero_grad(set_to_none=True)
    replayer.stats.reset()
    with replayer.replay(routes_BSLK[mine]) as used:
        loss = summed_token_loss(model(input_ids=ids_bS).logits, labels_bS) / count
        loss.backward()  # FSDP2 reduce-scatters the gradients, averaged over ranks
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {
        "loss": total / world,
        "grads": gradients(model),
        "wrong_shard_grads": wrong_grads,
        "routes_used": used.routes.clone(),
        "bound": [binding.name for binding in replayer.bindings],
        "sharded": type(model.model.layers[0].mlp.gate.weight).__name__,
        "recompute_calls": replayer.stats.recompute_calls,
        "fallback_rows": replayer.stats.fallback_rows,
    }


def ulysses_sequence_parallel(case: dict[str, Any], rank: int, world: int) -> Result:
    import routereplay
    from routereplay.layout.parallel import ulysses_shard, ulysses_unshard
    from tests.distributed.ulysses import use_ulysses

    ids_BS, routes_BSLK = case["ids"], case["routes"]
    batch, positions = ids_BS.shape
    model = tiny_moe(case["state"])
    use_ulysses(model)
    replayer = routereplay.attach(model)
    labels_BS = next_token_labels(ids_BS)
    count = int((labels_BS != IGNORE).sum())  # global label count: the rank losses sum to the mean
    ids_Bs = ulysses_shard(ids_BS, world, rank, dim=1, fill=0)
    labels_Bs = ulysses_shard(labels_BS, world, rank, dim=1, fill=IGNORE)
    local = ids_Bs.shape[1]
    positions_Bs = torch.arange(rank * local, (rank + 1) * local).expand(batch, local)  # global positions
    routes_BsLK = ulysses_shard(routes_BSLK, world, rank, dim=1, fill=-1)
    wrong_BsLK = ulysses_shard(routes_BSLK, world, (rank + 1) % world, dim=1, fill=-1)

    with replayer.replay(wrong_BsLK):  # negative control: another rank's shard of the routes
        (summed_token_loss(model(input_ids=ids_Bs, position_ids=positions_Bs).logits, labels_Bs) / count).backward()
    wrong_grads = _summed(gradients(model))
    model.zero_grad(set_to_none=True)
    replayer.stats.reset()
    with replayer.replay(routes_BsLK) as used:
        logits_BsV = model(input_ids=ids_Bs, position_ids=positions_Bs).logits
        loss = summed_token_loss(logits_BsV, labels_Bs) / count
        loss.backward()  # the all-to-all backward sends q/k/v gradients to the ranks owning them
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {
        "loss": total,
        "grads": _summed(gradients(model)),
        "wrong_shard_grads": wrong_grads,
        "routes_used": ulysses_unshard(_all_gather(used.routes), positions, dim=1),
        "logits": ulysses_unshard(_all_gather(logits_BsV.detach()), positions, dim=1),
        "fallback_rows": replayer.stats.fallback_rows,
        "replayed_rows": replayer.stats.replayed_rows,
    }


def route_delivery(case: dict[str, Any], rank: int, world: int) -> Result:
    from tests.distributed.delivery import deliver

    return deliver(case, rank, world)


def lying_source(case: dict[str, Any], rank: int, world: int) -> Result:
    from tests.distributed.lying_source import lie

    return lie(case, rank, world)


def failing_rank(case: dict[str, Any], rank: int, world: int) -> Result:
    """The last rank fails while the others wait for it in a collective (tests the launcher)."""
    if rank == world - 1:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return {}


def _summed(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replicated parameters: the full gradient is the sum of the ranks' gradients."""
    for grad in grads.values():
        dist.all_reduce(grad)
    return grads


def _all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


SCENARIOS: dict[str, Callable[[dict[str, Any], int, int], Result]] = {
    "fsdp": fsdp_data_parallel,
    "ulysses": ulysses_sequence_parallel,
    "delivery": route_delivery,
    "lying_source": lying_source,
    "failing_rank": failing_rank,
}


def main(argv: list[str]) -> int:
    scenario, workdir = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = SCENARIOS[scenario](load(workdir / "case.pt"), rank, world)
        save(workdir / f"rank{rank}.pt", result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization once the results are written and the group is destroyed: in
    # about 1 run of 10, torch 2.13's gloo threads abort it ("terminate called without an active
    # exception", SIGABRT, no Python frame), which would fail a job whose results are complete.
    os._exit(code)
