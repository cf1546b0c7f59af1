"""Two spawned gloo ranks running routereplay's SkyRL worker: data parallel (mesh dp=2), then Ulysses SP (sp=2).

Data parallel: SkyRL's dispatch gives each DP rank its contiguous half of the batch (`MeshDispatch`). Each
rank replays its half's rollout routes (R3, old-log-prob pass and an update), then, under R2, records its half
in the forward pass and runs its update on the OTHER rank's half: the recordings shared over SkyRL's `dp` group
must serve it (a sample is found by its tokens wherever it was recorded).

Ulysses SP: SkyRL's `HFModelWrapper` pads and slices the packed row (`ulysses_pad_and_slice_inputs`) and gathers
the log-probs (`gather_outputs_and_unpad`) over SkyRL's SP group on gloo. Its attention patch needs flash-attn
(no CPU build), so each rank registers the tests' CPU stand-in (`tests/distributed/ulysses.py`, masked by
`fsdp_ulysses.packed_mask_of`: all-to-all to all positions of this rank's heads, block-causal by the gathered
position_ids, and back). Each rank runs the whole batch packed without SP first (one rank's work), then with
SP 2: R3 dispatch and R2 recording.

Results go to `rank{r}.pt` for the test (`test_policy_worker_ranks.py`). Legend: N = attended tokens, K = top-k.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2


def half(data: Any, part: int) -> Any:
    """SkyRL's DP shard: the contiguous `part` of the batch (TrainingInputBatch slicing keeps PackedTensor rows)."""
    size = len(data) // WORLD
    return data[part * size : (part + 1) * size]


def probe(worker: Any, model: Any, data: Any, *, update: bool) -> dict[int, torch.Tensor]:
    from tests.integrations.skyrl import worker_case as case

    with case.dispatched(model) as calls:
        if update:
            worker.forward_backward(data)
            worker.optim_step()
        else:
            worker.forward(data)
    return {m: case.sorted_rows(case.token_rows(data["attention_mask"], True, calls[m])) for m in case.MOE_LAYERS}


def data_parallel(rank: int, result: dict[str, Any]) -> None:
    from tests.integrations.skyrl import worker_case as case

    seqs = case.sequences()
    routes = case.random_routes(seqs)
    mine = half(case.training_batch(seqs, routes), rank)
    model = case.tiny_model()
    worker = case.build_worker(model, case.trainer_config(), remove_padding=True, world_size=WORLD, rank=rank)
    result["dp_r3"] = [probe(worker, model, mine, update=u) for u in (False, True)]

    os.environ["ROUTEREPLAY_SKYRL_ROUTER_REPLAY"] = "R2"
    try:
        plain = case.training_batch(seqs, None)
        model = case.tiny_model()
        worker = case.build_worker(model, case.trainer_config(r3=False), remove_padding=True, world_size=WORLD,
                                   rank=rank, lr=5e-2)  # fmt: skip
        result["dp_r2_forward"] = probe(worker, model, half(plain, rank), update=False)
        result["dp_r2_recorded_samples"] = len(worker.routing().recorded)
        other = half(plain, 1 - rank)
        result["dp_r2_updates_other_half"] = [probe(worker, model, other, update=True) for _ in range(2)]
    finally:
        del os.environ["ROUTEREPLAY_SKYRL_ROUTER_REPLAY"]


def sequence_parallel(rank: int, result: dict[str, Any]) -> None:
    from skyrl.backends.skyrl_train.distributed.ulysses.utils import set_ulysses_sequence_parallel_group
    from torch.distributed.device_mesh import init_device_mesh

    from tests.distributed.ulysses import use_ulysses
    from tests.integrations.skyrl import worker_case as case
    from tests.integrations.verl.fsdp_ulysses import ATTENTION_NAME, packed_mask_of

    seqs = case.sequences()
    routes = case.random_routes(seqs)
    data = case.training_batch(seqs, routes)
    plain = case.training_batch(seqs, None)
    cfg = case.trainer_config(micro_batch_size=len(seqs))  # one micro-batch: one packed row

    model = case.tiny_model()
    one = case.build_worker(model, cfg, remove_padding=True, world_size=WORLD, rank=rank)  # mesh dp=2: same batch
    with case.dispatched(model) as calls:
        result["one_log_probs"] = one.forward(data).loss_fn_outputs
    result["one_dispatched"] = {m: calls[m][0] for m in case.MOE_LAYERS}
    os.environ["ROUTEREPLAY_SKYRL_ROUTER_REPLAY"] = "R2"
    try:
        one.cfg = case.trainer_config(micro_batch_size=len(seqs), r3=False)
        one.forward(plain)
        result["one_recorded"] = dict(one.routing().recorded.rows)
        one.routing().detach()

        group = init_device_mesh("cpu", mesh_shape=(1, WORLD), mesh_dim_names=["dp", "sp"])["sp"].get_group()
        use_ulysses(model, group, ATTENTION_NAME, packed_mask_of(group))
        set_ulysses_sequence_parallel_group(group)  # what SkyRL's _seq_parallel_monkey_patch sets
        sp = case.build_worker(model, case.trainer_config(micro_batch_size=len(seqs), r3=False), remove_padding=True,
                               sp_size=WORLD, world_size=WORLD, rank=rank)  # fmt: skip
        sp.forward(plain)
        result["sp_recorded"] = dict(sp.routing().recorded.rows)
    finally:
        del os.environ["ROUTEREPLAY_SKYRL_ROUTER_REPLAY"]
    sp.cfg = cfg
    with case.dispatched(model) as calls:
        result["sp_log_probs"] = sp.forward(data).loss_fn_outputs
        sp.forward_backward(data)  # an update: SkyRL's gathered log-probs backward over the SP group, replayed
    result["sp_dispatched"] = {m: calls[m][0] for m in case.MOE_LAYERS}
    result["sp_update_dispatched"] = {m: calls[m][1] for m in case.MOE_LAYERS}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from tests.integrations.skyrl.conftest import install_shims

    install_shims()  # a fresh process: the conftest's shims are not installed here
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        result: dict[str, Any] = {}
        data_parallel(rank, result)
        sequence_parallel(rank, result)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
