"""The routereplay SkyRL worker built the way SkyRL's own CPU tests build workers, and SkyRL-built batches.

SkyRL's CPU tests (`tests/backends/skyrl_train/...`) make workers with `PolicyWorkerBase.__new__` plus the
attributes the methods under test read; here the class is routereplay's subclass of SkyRL's
`FSDPPolicyWorkerBase`, with SkyRL's own `TrainerConfig`, `HFModelWrapper` (around a tiny HF Qwen3-MoE: layer 0
dense, layers 1-2 routed, 16 experts, top-2), `FSDPStrategy` (its backward and optimizer step), a CPU device mesh
("dp", "sp") and `MeshRank`. `torch.cuda.current_device()` answers "cpu" (the test patches it), which is where
SkyRL moves its micro-batches.

Batches go through SkyRL's own `convert_prompts_responses_to_batch_tensors` and `make_router_padding_mask` into
a `TrainingInputBatch`, as `RayPPOTrainer.convert_to_training_input` builds them: left-padded sequences,
`rollout_expert_indices` a `PackedTensor` of every real token's [layers, top_k] row (each trajectory's captured
prefix: all but its final token, every hidden layer, the dense one zeros) and `router_padding_mask`.

Legend: B = sequences, S = padded positions, P = payload layers (all 3), M = MoE layers (2), K = top-k,
T = tokens a model call sees, N = attended tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.distributed.launch import free_port
from tests.integrations.verl.fsdp_case import MOE_LAYERS, TOP_K, sorted_rows, tiny_model
from tests.runtime.models import experts_inputs

NUM_LAYERS = 3
PROMPT_LENGTHS = (5, 3, 7, 2)
RESPONSE_LENGTHS = (4, 6, 1, 3)

WORKER_MARKS = [
    pytest.mark.skyrl,
    # SkyRL wraps every pass in torch.autocast(device_type="cuda"), which CPU torch disables with this warning
    pytest.mark.filterwarnings("ignore:CUDA is not available or torch_xla is imported:UserWarning"),
]  # the worker tests' pytestmark


def sequences(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(4, 200, (n,), generator=generator).tolist()

    return [(ids(p), ids(r)) for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)]


def random_routes(seqs: list[tuple[list[int], list[int]]], num_experts: int = 16, seed: int = 5) -> list[np.ndarray]:
    """Per trajectory (len - 1, P, K): K distinct random experts per MoE row (routing nobody would pick)."""
    generator = np.random.default_rng(seed)
    out = []
    for prompt, response in seqs:
        rows = len(prompt) + len(response) - 1
        full_TPK = np.zeros((rows, NUM_LAYERS, TOP_K), dtype=np.uint8)
        for layer in MOE_LAYERS:
            full_TPK[:, layer] = np.argsort(generator.random((rows, num_experts)), axis=-1)[:, :TOP_K]
        out.append(full_TPK)
    return out


def training_batch(
    seqs: list[tuple[list[int], list[int]]], routes: list[np.ndarray] | None, *, seed: int = 0, digests: bool = True
) -> Any:
    """The `TrainingInputBatch` SkyRL's trainer builds (`convert_to_training_input`) plus what its forward pass
    and advantage step add: old log-probs, advantages; with routes, routereplay's trainer's digest column too
    (`digests=False`: SkyRL's own trainer's batch, without it)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors, make_router_padding_mask

    from routereplay.integrations.skyrl.digest import DIGEST_KEY, digest_column, generator_digests

    prompts = [p for p, _ in seqs]
    responses = [r for _, r in seqs]
    rewards = [[0.0] * (len(r) - 1) + [1.0] for r in responses]
    loss_masks = [[1] * len(r) for r in responses]
    sequences_BS, mask_BS, response_mask, _, loss_mask, _, packed, _ = convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, rewards, loss_masks, None, routes, None
    )
    batch = {
        "sequences": sequences_BS,
        "attention_mask": mask_BS,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "rollout_expert_indices": packed,
        "router_padding_mask": None if routes is None else make_router_padding_mask(mask_BS, [len(r) for r in routes]),
    }
    if routes is not None and digests:
        output = {"prompt_token_ids": prompts, "response_ids": responses, "rollout_expert_indices": routes}
        batch[DIGEST_KEY] = digest_column(generator_digests(output) or [])
    generator = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(loss_mask.shape, generator=generator) * loss_mask
    batch["action_log_probs"] = torch.zeros(loss_mask.shape)
    data = TrainingInputBatch(batch)
    data.metadata = {"response_length": int(response_mask.shape[1]), "uids": [str(i) for i in range(len(seqs))]}
    return data


def trainer_config(*, micro_batch_size: int = 2, r3: bool = True, max_tokens: int = -1) -> Any:
    from skyrl.train.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.strategy = "fsdp"
    cfg.algorithm.temperature = 1.0
    cfg.algorithm.use_kl_loss = False
    cfg.micro_train_batch_size_per_gpu = micro_batch_size
    cfg.micro_forward_batch_size_per_gpu = micro_batch_size
    cfg.max_tokens_per_microbatch = max_tokens
    cfg.policy.megatron_config.moe_enable_routing_replay = r3
    return cfg


def build_worker(
    model: nn.Module,
    cfg: Any,
    *,
    remove_padding: bool,
    sp_size: int = 1,
    lr: float = 1e-2,
    world_size: int = 1,
    rank: int = 0,
) -> Any:
    """routereplay's worker via `__new__`, with what SkyRL's `init_model` / `init_worker_process_group` set."""
    from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    from routereplay.integrations.skyrl.policy_worker import policy_worker_class

    cls = policy_worker_class()
    worker = cls.__new__(cls)
    worker.cfg = cfg
    worker.model = HFModelWrapper(
        model,
        use_flash_attention_2=remove_padding,  # SkyRL requires it with remove_microbatch_padding (SDPA runs here)
        remove_microbatch_padding=remove_padding,
        sequence_parallel_size=sp_size,
    )
    worker.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
    strategy = FSDPStrategy(cfg.policy.fsdp_config, cfg.policy.optimizer_config, fsdp_strategy="fsdp")
    strategy.world_size = world_size
    worker.strategy = strategy
    dp_size = world_size // sp_size
    worker.device_mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", mesh_shape=(dp_size, sp_size), mesh_dim_names=("dp", "sp")
    )
    worker.mesh_rank = MeshRank(
        dp=rank // sp_size, sp=rank % sp_size, tp=0, pp=0, world_size=world_size, dp_size=dp_size, pp_size=1
    )
    worker.policy_loss_fn = PolicyLossRegistry.get(cfg.algorithm.policy_loss_type)
    worker.profiler = None
    worker.record_memory = False
    worker.sequence_parallel_size = sp_size
    return worker


def dispatched(model: nn.Module) -> Any:
    """Expert ids each MoE layer's experts module receives, per call: (T, K) each (the probe of tests/runtime)."""
    return experts_inputs(model)


def token_rows(mask_BS: torch.Tensor, remove_padding: bool, calls: list[torch.Tensor]) -> torch.Tensor:
    """(N, K) probe rows in token order (row-major over the attended positions) from one pass's calls."""
    rows = []
    per = -(-int(mask_BS.shape[0]) // len(calls))
    for i, ids_TK in enumerate(calls):
        part_BS = mask_BS[i * per : (i + 1) * per].to(torch.bool)
        rows.append(ids_TK[: int(part_BS.sum())] if remove_padding else ids_TK[part_BS.flatten()])
    return torch.cat(rows)


def expected_rows(routes: list[np.ndarray], seqs: list[tuple[list[int], list[int]]], layer: int) -> torch.Tensor:
    """(N, K) int64: the rollout's rows of `layer` in token order, -1 on each final token (no route)."""
    out = []
    for rows_TPK, (prompt, response) in zip(routes, seqs, strict=True):
        n = len(prompt) + len(response)
        full = torch.full((n, TOP_K), -1, dtype=torch.int64)
        full[: rows_TPK.shape[0]] = torch.from_numpy(rows_TPK[:, layer].astype(np.int64))
        out.append(full)
    return torch.cat(out)


__all__ = ["MOE_LAYERS", "TOP_K", "free_port", "sorted_rows", "tiny_model"]  # the verl tests' model and helpers
