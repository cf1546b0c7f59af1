"""AReaL 1.0.4's own FSDP actor built on CPU as AReaL builds it, AReaL-shaped episodes, and a dispatch probe.

The actor is AReaL's `FSDPPPOActor` (or routereplay's subclass) made from AReaL's own `PPOActorConfig`, with
AReaL's `create_process_group` (gloo: AReaL picks its own `CpuPlatform` when CUDA is absent, so nothing is
faked) and `initialize` (FSDP2 `fully_shard`, AdamW), loading a tiny Qwen3-MoE checkpoint written to a temporary
folder (`routereplay.testing.vllm_models.build_checkpoint`: layer 0 dense, layers 1-2 routed, 16 experts,
top-2; a word-level tokenizer). Episodes are what AReaL's `RLVRWorkflow.arun_episode` returns (batch dim 1:
input_ids, loss_mask, logprobs, versions, attention_mask, rewards) plus the contract's two route columns.

The truth is `DispatchProbe`: a forward pre-hook on the HF model (the `input_ids` and `cu_seq_lens_q` AReaL
passes) and on each MoE layer's experts module (the expert ids it receives), so every experts call, forward or
activation-checkpoint recompute, is tied to the packed model input it ran on; each packed sequence is matched to
its trajectory by its tokens. Legend: S positions of a trajectory, T packed positions, M MoE layers, K top-k.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from routereplay.integrations.areal.columns import ROUTES_KEY, TOKENS_KEY
from routereplay.runtime.discovery import LAYER_PATH
from tests.distributed.launch import free_port

MOE_LAYERS = (1, 2)
TOP_K = 2
NUM_EXPERTS = 16
# trajectories (prompt, response): 0 and 1 have equal lengths (9), for the swap test
LENGTHS = ((5, 4), (3, 6), (7, 1), (2, 3))


def distributed_env() -> None:
    """What torchrun would set for one rank; AReaL's `create_process_group` initialises gloo from it."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def checkpoint(folder: Path) -> str:
    from routereplay.testing.vllm_models import build_checkpoint

    build_checkpoint("qwen3_moe_dense_first", folder, dtype=torch.float32)
    return str(folder)


def actor_config(path: str, **overrides: Any) -> Any:
    """AReaL's own PPOActorConfig for the tiny model: fp32, sdpa, activation checkpointing, 2 micro-batches per
    call, 2 PPO mini-batches, recomputed old log-probs, a large learning rate (routing drifts within a step)."""
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig

    fields: dict[str, Any] = {
        "experiment_name": "routereplay",
        "trial_name": "cpu",
        "path": path,
        "attn_impl": "sdpa",
        "dtype": "float32",
        "optimizer": OptimizerConfig(lr=3e-2, warmup_steps_proportion=0.0),
        "mb_spec": MicroBatchSpec(n_mbs=2),
        "backend": "fsdp:d1",
        "recompute_logprob": True,
        "ppo_n_minibatches": 2,
        "gradient_checkpointing": True,
    }
    fields.update(overrides)
    return PPOActorConfig(**fields)


def build_actor(config: Any, cls: type | None = None) -> Any:
    """AReaL's actor (`cls`: routereplay's subclass by default) initialised the way AReaL's trainer does it."""
    from areal.api import FinetuneSpec

    if cls is None:
        from routereplay.integrations.areal.fsdp_actor import RouteReplayFSDPPPOActor

        cls = RouteReplayFSDPPPOActor
    distributed_env()
    actor = cls(config)
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=len(LENGTHS)))
    return actor


def episodes(seed: int = 0, lengths: tuple[tuple[int, int], ...] = LENGTHS) -> list[dict[str, torch.Tensor]]:
    """What AReaL's RLVRWorkflow returns per trajectory (batch dim 1), random distinct tokens."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, response) in enumerate(lengths):
        seq = torch.randint(4, 1000, (prompt + response,), generator=generator)
        res = {
            "input_ids": seq.to(torch.int32),
            "loss_mask": torch.tensor([0] * prompt + [1] * response, dtype=torch.int32),
            "logprobs": torch.zeros(prompt + response),
            "versions": torch.tensor([-1] * prompt + [0] * response, dtype=torch.int32),
            "attention_mask": torch.ones(prompt + response, dtype=torch.bool),
            "rewards": torch.tensor(float(i % 2) * 2.0 - 1.0),
        }
        out.append({k: v.unsqueeze(0) for k, v in res.items()})
    return out


def random_routes(batch: list[dict[str, torch.Tensor]], seed: int = 5) -> list[torch.Tensor]:
    """Per trajectory (S, M, K) int64: K distinct random experts per MoE row (routing nobody would pick), -1 on
    the final token (the engine never routed it)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for episode in batch:
        positions = int(episode["input_ids"].shape[1])
        keys = torch.rand(positions * len(MOE_LAYERS), NUM_EXPERTS, generator=generator)
        rows = keys.argsort(dim=1)[:, :TOP_K].reshape(positions, len(MOE_LAYERS), TOP_K)
        rows[-1] = -1
        out.append(rows)
    return out


def with_routes(
    batch: list[dict[str, torch.Tensor]], routes: list[torch.Tensor], *, tokens: bool = True
) -> list[dict[str, torch.Tensor]]:
    """The episodes with the contract's columns: routes [1, S, M, K] int16, tokens [1, S] int32 (-1 where the
    row is -1)."""
    out = []
    for episode, rows in zip(batch, routes, strict=True):
        new = dict(episode)
        new[ROUTES_KEY] = rows.to(torch.int16).unsqueeze(0)
        if tokens:
            ids = episode["input_ids"][0].clone()
            ids[rows[:, 0, 0] < 0] = -1
            new[TOKENS_KEY] = ids.unsqueeze(0)
        out.append(new)
    return out


@dataclass(slots=True)
class ModelCall:
    input_ids: torch.Tensor  # (T,)
    cu_seqlens: torch.Tensor  # (n + 1,)
    experts: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> (T, K) per experts call


@contextmanager
def dispatch_probe(model: nn.Module) -> Iterator[list[ModelCall]]:
    """Every model call's packed input and the expert ids each MoE layer's experts received during it (forward
    and activation-checkpoint recompute alike)."""
    calls: list[ModelCall] = []

    def on_model(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cu = kwargs.get("cu_seq_lens_q")
        assert isinstance(ids, torch.Tensor) and isinstance(cu, torch.Tensor), "AReaL passes packed input_ids"
        calls.append(ModelCall(ids.detach().reshape(-1).clone().cpu(), cu.detach().clone().cpu()))

    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True)]
    for name, module in model.named_modules():
        found = LAYER_PATH.findall(name)
        if not found or not type(module).__name__.endswith("Experts"):
            continue
        layer = int(found[-1])

        def on_experts(_m: nn.Module, args: tuple, kwargs: dict, layer: int = layer) -> None:
            values = [v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
            ids = next(v for v in values if not v.is_floating_point() and v.dim() == 2)
            calls[-1].experts.setdefault(layer, []).append(ids.detach().clone().cpu())

        handles.append(module.register_forward_pre_hook(on_experts, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def by_trajectory(calls: list[ModelCall], batch: list[dict[str, torch.Tensor]]) -> dict[int, dict[int, list]]:
    """Trajectory -> layer -> the sorted (S, K) expert ids of every experts call that routed it; each packed
    sequence matched to its trajectory by its tokens (AReaL's padding sequence matches none)."""
    tokens = [e["input_ids"][0].to(torch.int64) for e in batch]
    out: dict[int, dict[int, list]] = {i: {layer: [] for layer in MOE_LAYERS} for i in range(len(batch))}
    for call in calls:
        cu = call.cu_seqlens.tolist()
        for start, stop in itertools.pairwise(cu):
            segment = call.input_ids[start:stop].to(torch.int64)
            match = [i for i, t in enumerate(tokens) if t.shape == segment.shape and torch.equal(t, segment)]
            if not match:
                continue
            for layer in MOE_LAYERS:
                for ids_TK in call.experts.get(layer, []):
                    out[match[0]][layer].append(ids_TK[start:stop].sort(dim=-1).values)
    return out


def disagreement(seen: dict[int, dict[int, list]], expected: list[torch.Tensor]) -> int:
    """(token, layer, experts call) rows whose dispatched set differs from `expected`'s routed rows (sets);
    every trajectory must have been dispatched at least once per layer."""
    rows = 0
    for i, routes_SMK in enumerate(expected):
        routed_S = routes_SMK[:, 0, 0] >= 0
        for m, layer in enumerate(MOE_LAYERS):
            assert seen[i][layer], f"trajectory {i} never reached layer {layer}'s experts"
            want = routes_SMK[:, m].sort(dim=-1).values
            for got in seen[i][layer]:
                rows += int((got[routed_S] != want[routed_S]).any(-1).sum())
    return rows


def first_pass(seen: dict[int, dict[int, list]]) -> list[torch.Tensor]:
    """Per trajectory (S, M, K): what the first experts call of each layer dispatched."""
    return [torch.stack([seen[i][layer][0] for layer in MOE_LAYERS], dim=1) for i in sorted(seen)]


GRPO_YAML = """\
experiment_name: routereplay
trial_name: cpu
tokenizer_path: ${{actor.path}}
cluster:
  fileroot: {root}
  name_resolve:
    type: nfs
    nfs_record_root: {root}/name_resolve
actor:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  path: {model}
  backend: "fsdp:d1"
  attn_impl: sdpa
  recompute_logprob: true
  scheduling_spec:
    - env_vars: {env}
rollout:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  backend: "sglang:d1"
  return_routed_experts: false
train_dataset:
  type: rl
  path: unused
  batch_size: 4
"""
YAML_LOGGERS = ("stats_logger", "saver", "evaluator", "recover")


def grpo_config(folder: Path, model: str, *overrides: str, env: dict[str, str] | None = None) -> Any:
    """AReaL's GRPOConfig loaded the way AReaL's scripts load it (`load_expr_config`: Hydra compose of a YAML
    file, `key=value` overrides, OmegaConf structured merge into the dataclasses); `env` goes into
    `actor.scheduling_spec[0].env_vars`."""
    from areal.api.cli_args import GRPOConfig, load_expr_config

    text = GRPO_YAML.format(root=folder / "root", model=model, env="{" + ", ".join(f"{k}: {v}" for k, v in
                            (env or {}).items()) + "}")  # fmt: skip
    for name in YAML_LOGGERS:
        text += f"{name}:\n  experiment_name: routereplay\n  trial_name: cpu\n  fileroot: {folder / 'root'}\n"
    path = folder / "grpo.yaml"
    path.write_text(text)
    config, _ = load_expr_config(["--config", str(path), *overrides], GRPOConfig)
    return config


SP_CALLS = ("compute_logp_r3", "update_r3", "compute_logp_r2", "update_r2")


def sp_rank(folder: str) -> None:
    """One rank of a 2-rank Ulysses SP job (`test_fsdp_actor`): routereplay's actor with `backend=fsdp:d1c2`,
    R3 then R2, each pass's probe saved to `folder/rank{r}.pt`, with AReaL's own `ulysses_pad_and_slice_inputs`
    of a few columns beside `packed_layout.ulysses_slice` of them."""
    from areal.models.fsdp.ulysses import ulysses_pad_and_slice_inputs

    from routereplay.integrations.areal.packed_layout import ulysses_slice

    rank = int(os.environ["RANK"])
    actor = build_actor(actor_config(os.path.join(folder, "model"), backend="fsdp:d1c2"))
    batch = episodes()
    routes = random_routes(batch)
    saved: dict[str, Any] = {"sp_size": actor.parallel_helper.sp_size, "routes": routes}
    for mode, data in (("R3", with_routes(batch, routes)), ("R2", batch)):
        os.environ["ROUTEREPLAY_AREAL_ROUTER_REPLAY"] = mode
        with dispatch_probe(actor.model) as calls:
            logps = actor.compute_logp(data)
        saved[f"compute_logp_{mode.lower()}"] = calls
        adv = actor.compute_advantages([{**d, "prox_logp": lp} for d, lp in zip(data, logps, strict=True)])
        with dispatch_probe(actor.model) as calls:
            actor.ppo_update(adv)
        saved[f"update_{mode.lower()}"] = calls
    slices = []  # after the passes: AReaL sets its Ulysses group in the engine's first forward (_ensure_ready)
    for length in (255, 256, 257):
        column = torch.arange(1, length + 1).unsqueeze(0)
        theirs, _, _ = ulysses_pad_and_slice_inputs(column, sp_size=2)
        slices.append(torch.equal(theirs, ulysses_slice(column, 2, rank, fill=0)))
    saved["slices"] = slices
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    actor.destroy()


def dp_rank(folder: str) -> None:
    """One rank of a 2-rank data-parallel job (`backend=fsdp:d2`, R2): each rank records compute_logp on its own
    batch (`episodes(seed=rank)`), then updates on the OTHER rank's batch, which only the recording shared over
    AReaL's dp group holds; both probes saved to `folder/rank{r}.pt`."""
    rank = int(os.environ["RANK"])
    os.environ["ROUTEREPLAY_AREAL_ROUTER_REPLAY"] = "R2"
    actor = build_actor(actor_config(os.path.join(folder, "model"), backend="fsdp:d2"))
    mine, theirs = episodes(seed=rank), episodes(seed=1 - rank)
    with dispatch_probe(actor.model) as logp_calls:
        logps = actor.compute_logp(mine)
    adv = actor.compute_advantages([{**d, "prox_logp": lp} for d, lp in zip(theirs, logps, strict=True)])
    with dispatch_probe(actor.model) as update_calls:
        actor.ppo_update(adv)
    torch.save({"logp": logp_calls, "update": update_calls}, os.path.join(folder, f"rank{rank}.pt"))
    actor.destroy()


def joined_calls(ranks: list[list[ModelCall]]) -> list[ModelCall]:
    """The ranks' calls of one pass as whole packed model inputs: each rank's slice of the input ids and of every
    experts call, concatenated in rank order (AReaL's Ulysses slices), the global cu_seqlens kept."""
    out = []
    for parts in zip(*ranks, strict=True):
        call = ModelCall(torch.cat([p.input_ids for p in parts]), parts[0].cu_seqlens)
        for layer in parts[0].experts:
            call.experts[layer] = [torch.cat(xs) for xs in zip(*(p.experts[layer] for p in parts), strict=True)]
        out.append(call)
    return out


__all__ = [
    "LENGTHS",
    "MOE_LAYERS",
    "NUM_EXPERTS",
    "ROUTES_KEY",
    "TOKENS_KEY",
    "TOP_K",
    "actor_config",
    "build_actor",
    "by_trajectory",
    "checkpoint",
    "disagreement",
    "dispatch_probe",
    "dp_rank",
    "episodes",
    "first_pass",
    "grpo_config",
    "joined_calls",
    "random_routes",
    "sp_rank",
    "with_routes",
]
