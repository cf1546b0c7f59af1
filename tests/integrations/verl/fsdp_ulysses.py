"""Ulysses SP on CPU for the routereplay FSDP engine: 2 gloo ranks against 1 rank, in spawned processes.

verl shards a packed micro-batch with its own helpers (`ulysses_pad_and_slice_inputs` in
`prepare_model_inputs`, `gather_outputs_and_unpad` for the outputs) and those run on gloo. Its
attention patch (`_ulysses_flash_attention_forward`) needs flash-attn, which has no CPU build, so
each rank here registers a CPU stand-in with the same contract: all-to-all from a sequence shard of
all heads to all positions of its heads (`tests/distributed/ulysses.py`), attention over the global
packed row with a block-diagonal causal mask from the all-gathered `position_ids` (what flash-attn
varlen derives from them), and back. Everything else -- slicing, padding, output gathering, the
device mesh and verl's SP group -- is verl's.

Each rank runs, on the same seeded model and batch: the engine without SP (sdpa, one rank's work),
then the engine with SP 2; R3 replay (log-probs, dispatched experts) and R2 record (routes), and
saves them for the test to compare.

Legend: B = batch rows (1 when packed), H = query heads, G = kv heads, S = global positions,
s = this rank's positions, h / g = this rank's heads, D = head dim, T = tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.ulysses import MaskFn, use_ulysses

ATTENTION_NAME = "routereplay_test_verl_ulysses"
SP_SIZE = 2


def packed_block_mask(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: causal inside each packed sequence (a sequence starts where position_ids is 0)."""
    seq_BS = (position_ids_BS == 0).cumsum(-1)
    same = seq_BS[:, :, None] == seq_BS[:, None, :]
    causal = torch.ones(same.shape[-2:], dtype=torch.bool).tril()
    return (same & causal).unsqueeze(1)


def packed_mask_of(group: dist.ProcessGroup) -> MaskFn:
    """The mask of the global packed row, from the `position_ids` shards every rank's attention call gets."""

    def mask_of(kwargs: dict[str, Any]) -> torch.Tensor:
        position_ids_Bs = kwargs["position_ids"]
        shards = [torch.empty_like(position_ids_Bs) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, position_ids_Bs.contiguous(), group=group)
        return packed_block_mask(torch.cat(shards, dim=-1))

    return mask_of


def _run(engine: Any, data: Any, model: nn.Module) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    from tests.integrations.verl import fsdp_case as case

    with case.dispatched(model) as seen:
        out = engine.infer_batch(data)
    return out["model_output"]["log_probs"].values(), {m: seen[m][0] for m in case.MOE_LAYERS}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SP_SIZE)
    try:
        import verl.utils.seqlen_balancing as balancing
        import verl.workers.engine.fsdp.transformer_impl as impl
        from torch.distributed.device_mesh import init_device_mesh
        from verl.utils.ulysses import set_ulysses_sequence_parallel_group

        from tests.integrations.verl import fsdp_case as case

        impl.get_device_id = lambda: "cpu"  # a fresh process: verl's engine module asks for "cuda"
        impl.get_device_name = lambda: "cpu"
        balancing.get_device_name = lambda: "cpu"
        mesh = init_device_mesh("cpu", mesh_shape=(1, SP_SIZE), mesh_dim_names=["dp", "sp"])
        group = mesh["sp"].get_group()

        model = case.tiny_model()
        seqs = case.sequences()
        routes = case.rollout_routes(case.rollout_model(model), seqs)
        data = case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=len(seqs))
        plain = case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=len(seqs))
        result: dict[str, Any] = {"cu_seqlens": data["input_ids"].offsets()}

        one = case.build_engine(model, "R3")
        result["one_log_probs"], result["one_dispatched"] = _run(one, data, model)
        case.set_mode(one, {"mode": "R2"})
        result["one_recorded"] = one.infer_batch(plain)["model_output"]["routed_experts"].values()
        one.routing().close_and_detach()

        use_ulysses(model, group, ATTENTION_NAME, packed_mask_of(group))
        set_ulysses_sequence_parallel_group(group)  # what verl's engine contexts do on entry
        sp = case.build_engine(model, "R3", sp_size=SP_SIZE, sp_group=group)
        sp.ulysses_device_mesh = mesh
        result["sp_log_probs"], result["sp_dispatched"] = _run(sp, data, model)
        case.set_mode(sp, {"mode": "R2"})
        result["sp_recorded"] = sp.infer_batch(plain)["model_output"]["routed_experts"].values()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
