"""The routereplay FSDP engine built the way verl's own CPU tests build engines, and verl-shaped batches.

verl registers its FSDP engine for cuda / npu only and builds it with a device mesh, so, like
verl's `tests/workers/test_router_replay_engine_helpers_on_cpu.py`, the engine here is made with
`__new__` plus the attributes `forward_backward_batch` / `forward_step` / `optimizer_step` read, the
model a tiny HF Qwen3-MoE (layer 0 dense, layers 1-2 routed: 16 experts, top-2). The module-level
`get_device_id` / `get_device_name` of verl's engine module answer "cpu" (the test patches them).

Batches go through verl's own `left_right_2_no_padding`: left-padded prompts, right-padded
responses, and rollout routes padded with zeros exactly like verl's agent loop
(`_agent_loop_postprocess`): one route per token but the last, all decoder layers, the dense one 0.

Legend: B = sequences, S = padded positions, P = payload layers (all 3), L = MoE layers (2),
K = top-k, T = tokens a model call sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import routereplay
from routereplay.testing import tiny_vllm_model
from tests.runtime.models import experts_inputs, perturbed_routers

FAMILY = "qwen3_moe_dense_first"
MOE_LAYERS = (1, 2)
TOP_K = 2
PROMPT_LENGTHS = (5, 3, 7, 2)
RESPONSE_LENGTHS = (4, 6, 1, 3)
PROMPT_WIDTH, RESPONSE_WIDTH = 8, 6


def tiny_model(seed: int = 0) -> nn.Module:
    model = tiny_vllm_model(FAMILY, seed=seed)
    model.config.use_cache = False
    return model.train()


def rollout_model(model: nn.Module, noise: float = 3e-2, seed: int = 1) -> nn.Module:
    """A copy whose numerics differ from the trainer's, as a rollout engine's do: routes differ."""
    return perturbed_routers(model, noise=noise, seed=seed)


def sequences(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(4, 200, (p,), generator=generator), torch.randint(4, 200, (r,), generator=generator))
        for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
    ]


def rollout_traces(model: nn.Module, seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """Per sequence the RouteTrace routereplay's rollout side keeps: MoE layers, no final-token row,
    the token ids (what `integrations.verl.batch.compact_blob` encodes)."""
    replayer = routereplay.attach(model)
    try:
        out = []
        for prompt, response in seqs:
            ids = torch.cat([prompt, response]).unsqueeze(0)
            with replayer.record() as rec, torch.no_grad():
                model(input_ids=ids)
            (trace,) = rec.traces(torch.ones_like(ids), input_ids=ids)
            out.append(trace.slice(0, trace.stop - 1))  # the engine never fed the final token: no route
        return out
    finally:
        replayer.detach()


def rollout_routes(model: nn.Module, seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Per sequence (len - 1, P, K): the routes a rollout engine returns (no route for the final token,
    every decoder layer, the dense layer 0 all zeros as vLLM sends it)."""
    replayer = routereplay.attach(model)
    out = []
    try:
        for prompt, response in seqs:
            ids = torch.cat([prompt, response]).unsqueeze(0)
            with replayer.record() as rec, torch.no_grad():
                model(input_ids=ids)
            moe_1TLK = rec.routes
            full_TPK = torch.zeros(ids.shape[1], model.config.num_hidden_layers, TOP_K, dtype=torch.int64)
            full_TPK[:, list(MOE_LAYERS)] = moe_1TLK[0].to(torch.int64)
            out.append(full_TPK[:-1])
    finally:
        replayer.detach()
    return out


def verl_batch(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    routes: list[torch.Tensor] | None,
    *,
    remove_padding: bool,
    dynamic_bsz: bool = False,
    micro_batch_size: int = 2,
    traces: list[Any] | None = None,
    traces_form: str = "compact",
    generated: list[int] | None = None,
) -> Any:
    """The TensorDict verl's trainer hands `compute_log_prob` / `update_actor`, after `left_right_2_no_padding`."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = len(seqs)
    width = PROMPT_WIDTH + RESPONSE_WIDTH
    input_ids = torch.zeros(batch, width, dtype=torch.int64)
    attention_mask = torch.zeros(batch, width, dtype=torch.int64)
    response_mask = torch.zeros(batch, RESPONSE_WIDTH, dtype=torch.int64)
    routed = torch.zeros(batch, width, 3, TOP_K, dtype=torch.int16)
    for b, (prompt, response) in enumerate(seqs):
        start = PROMPT_WIDTH - prompt.numel()
        input_ids[b, start:PROMPT_WIDTH] = prompt
        input_ids[b, PROMPT_WIDTH : PROMPT_WIDTH + response.numel()] = response
        attention_mask[b, start : PROMPT_WIDTH + response.numel()] = 1
        response_mask[b, : response.numel() if generated is None else generated[b]] = 1  # 0: tool tokens
        if routes is not None:  # verl's agent loop: routes from start_pos, zeros elsewhere
            routed[b, start : start + routes[b].shape[0]] = routes[b].to(torch.int16)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": position_ids,
        "prompts": input_ids[:, :PROMPT_WIDTH],
        "responses": input_ids[:, PROMPT_WIDTH:],
    }
    if routes is not None:
        tensors["routed_experts"] = routed
    if traces is not None and traces_form == "compact":  # routereplay's column: a codec blob per sample, ids inside
        from routereplay.integrations.verl.batch import ROUTES_KEY, compact_blob

        tensors[ROUTES_KEY] = [compact_blob(trace) for trace in traces]
    elif traces is not None:  # BatchForm.DENSE as put_routes writes it: -1 (never 0) for no route, a token digest
        from routereplay.integrations.verl.batch import dense_routed_experts
        from routereplay.integrations.verl.digest import DIGEST_KEY, route_digests

        dense = dense_routed_experts(traces, attention_mask, PROMPT_WIDTH, input_ids_BS=input_ids)
        tensors["routed_experts"] = dense
        tensors[DIGEST_KEY] = list(route_digests(dense, input_ids, attention_mask))
    data = left_right_2_no_padding(tu.get_tensordict(tensors))
    tu.assign_non_tensor(
        data,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=dynamic_bsz,
        max_token_len_per_gpu=24,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
        temperature=1.0,
        calculate_entropy=False,
    )
    return data


def log_prob_loss(model_output: dict[str, Any], data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """A policy-gradient-shaped loss on the per-token log-probs (verl's loss-function signature)."""
    log_probs = model_output["log_probs"].values()
    return -log_probs.mean(), {}


@dataclass(slots=True)
class EngineCase:
    engine: Any
    model: nn.Module


def build_engine(model: nn.Module, mode: str, *, sp_size: int = 1, sp_group: Any = None, lr: float = 1e-2) -> Any:
    """The routereplay engine via `__new__`, with what verl's `FSDPEngine.__init__` would have set."""
    import verl.utils.torch_functional as verl_F
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.config.engine import EngineRouterReplayConfig

    from routereplay.integrations.verl.fsdp_engine import engine_class

    cls = engine_class()
    engine = cls.__new__(cls)
    engine.module = model
    engine.engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        use_torch_compile=False,
        ulysses_sequence_parallel_size=sp_size,
        router_replay=EngineRouterReplayConfig(mode=mode),
    )
    engine.optimizer_config = SimpleNamespace(clip_grad=1.0)
    engine.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    engine.mode = None
    engine.rank = 0
    engine.pad_to_length = False
    engine.pad_to_length_bucket = 1024
    engine.ulysses_sequence_parallel_size = sp_size
    engine.use_ulysses_sp = sp_size > 1
    engine.ulysses_device_mesh = None
    engine.ulysses_parallel_group = sp_group
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine._qat_enabled = False
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def set_mode(engine: Any, router_replay: Any) -> None:
    """Swap the engine's `router_replay` config (verl's configs are frozen dataclasses)."""
    engine.engine_config = dataclasses.replace(engine.engine_config, router_replay=router_replay)


def dispatched(model: nn.Module) -> AbstractContextManager[dict[int, list[torch.Tensor]]]:
    """Expert ids each MoE layer's experts module receives, per call: (T, K) each (the probe of tests/runtime)."""
    return experts_inputs(model)


def token_rows(data: Any, remove_padding: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps a (T, K) probe capture of a single-micro-batch pass to (N, K) rows in token order."""
    input_ids = data["input_ids"]
    cu = input_ids.offsets()
    lengths = (cu[1:] - cu[:-1]).tolist()
    width = max(lengths)

    def rows(ids_TK: torch.Tensor) -> torch.Tensor:
        if remove_padding:
            return ids_TK[: int(cu[-1])]
        keep = torch.zeros(len(lengths), width, dtype=torch.bool)
        for b, n in enumerate(lengths):
            keep[b, :n] = True
        return ids_TK[keep.flatten()]

    return rows


def sorted_rows(x: torch.Tensor) -> torch.Tensor:
    return x.sort(dim=-1).values


def last_token_mask(data: Any) -> torch.Tensor:
    """(N,) True on each sequence's final token (R3 leaves it live: the rollout never routed it)."""
    cu = data["input_ids"].offsets()
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    mask[cu[1:] - 1] = True
    return mask
