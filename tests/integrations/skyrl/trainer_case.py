"""SkyRL 0.4.0's own trainer loop on this CPU machine, with routereplay's worker and trainer.

What runs is SkyRL's: its config (`SkyRLTrainConfig.from_cli_overrides`, defaults kept but for the few CPU
overrides below), routereplay's `entrypoint.validate` + `install(cfg)`, `RayPPOTrainer.build_models` (its
`PPORayActorGroup`s, SkyRL's `WorkerDispatch` / `MeshDispatch` staging and chunking the batch), each worker's
`init_worker_process_group` and `init_model` (SkyRL's `FSDPStrategy`: the saved checkpoint loaded by its
`HFModelWrapper`, FSDP2 `fully_shard`, AdamW and scheduler), and one training step as `RayPPOTrainer.train()`
runs it: `generate` through `train_critic_and_policy`.

Stand-ins, each because this machine has no GPU (named here and in docs/skyrl.md):
- `in_process_ray`: Ray's actors need a GPU here (`num_gpus=1`), so no Ray instance runs. A Ray actor class's
  `.options(...).remote(...)` (`InProcessActorClass`) builds the worker in this process; `ray.put` pickles the
  object (SkyRL's `TensorBatch.__reduce__`, as Ray's object store does) and `ray.get` unpickles it, so every
  chunk a worker gets is a deserialized copy; a handle's `.method.remote(ref)` resolves its ref arguments, runs
  the method and puts its result. SkyRL's loss registries stay local (they sync to a Ray actor only when Ray is
  initialized);
- `cpu_stand_ins` also answers SkyRL's CUDA calls on the CPU: `torch.cuda.set_device` / `synchronize` are
  no-ops, `current_device()` answers "cpu", SkyRL's device meshes are built on "cpu" (gloo), and its
  `_sync_non_persistent_buffers` (`.cuda()`, nothing to broadcast on one rank) is skipped;
- config: `trainer.placement.colocate_all=false` (no GPU to share with vLLM), `trainer.flash_attn=false` and
  `trainer.remove_microbatch_padding=false` (no flash-attn build, and SkyRL packs micro-batches only with it;
  the packed layout runs in `test_policy_worker.py`), `trainer.logger=console`, a small batch
  (`train_batch_size=4` prompts in 4 policy mini-batches of 1, as SkyRL's defaults have four: 1024 / 256;
  `n_samples_per_prompt=2`), a learning rate that moves routing within one step,
  `trainer.placement.colocate_policy_ref=false` (its placement group asks Ray for a GPU bundle) and
  `generator.inference_engine.enable_ray_prometheus_stats=false` (it scrapes vLLM's metrics off Ray's nodes).
  Everything else is SkyRL's default: `recompute_old_logprobs_per_minibatch=true`, micro-batches of one sample,
  gradient checkpointing, the KL loss (so SkyRL's own FSDP ref worker runs too), GRPO;
- the generator (`TinyGenerator`) is a `GeneratorInterface` of the test's: no vLLM here. It returns SkyRL's
  `GeneratorOutput`; with routes, built per trajectory by SkyRL's own `RoutedExpertTrace` (SkyRL's generator's
  bookkeeping) or by routereplay's `RolloutRoutes`.

The model is a tiny Qwen2-MoE saved to disk (`tiny_config("qwen2_moe")`: 5 layers, dense layers 0 and 2,
`mlp_only_layers`), with a word-level tokenizer. Legend: N tokens of a trajectory, C captured rows, L every
hidden layer, K top-k.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

NUM_LAYERS = 5
DENSE_LAYERS = (0, 2)  # dense first and in the middle
MOE_LAYERS = (1, 3, 4)
NUM_EXPERTS = 8
TOP_K = 2
PROMPTS = 4  # train_batch_size
SAMPLES = 2  # n_samples_per_prompt
PROMPT_LENGTHS = (4, 3, 5, 2)
RESPONSE_LENGTHS = (3, 5, 2, 4)  # per prompt: both samples of a prompt have equal lengths
CPU_OVERRIDES = (
    "trainer.strategy=fsdp2",
    "trainer.logger=console",
    "trainer.placement.colocate_all=false",
    "trainer.flash_attn=false",
    "trainer.remove_microbatch_padding=false",
    f"trainer.train_batch_size={PROMPTS}",
    "trainer.policy_mini_batch_size=1",
    f"generator.n_samples_per_prompt={SAMPLES}",
    "trainer.policy.optimizer_config.lr=0.05",
    "trainer.placement.colocate_policy_ref=false",
    "generator.inference_engine.enable_ray_prometheus_stats=false",
)
R3_OVERRIDES = (
    "generator.inference_engine.enable_return_routed_experts=true",
    "generator.inference_engine.distributed_executor_backend=mp",
    "trainer.policy.megatron_config.moe_enable_routing_replay=true",
)


def save_checkpoint(folder: Path) -> Path:
    """A tiny Qwen2-MoE (dense layers 0 and 2) and its word-level tokenizer, written where SkyRL loads them."""
    import transformers

    from routereplay.testing.hf.models import tiny_config
    from routereplay.testing.vllm_models import word_tokenizer

    config = tiny_config(
        "qwen2_moe", num_hidden_layers=NUM_LAYERS, layer_types=["full_attention"] * NUM_LAYERS, vocab_size=64,
        mlp_only_layers=list(DENSE_LAYERS),
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    word_tokenizer(64).save_pretrained(folder)
    return folder


def skyrl_config(model_path: Path, *overrides: str) -> Any:
    """SkyRL's default config with the CPU overrides, checked by routereplay's `entrypoint.validate`."""
    from skyrl.train.config.config import SkyRLTrainConfig

    from routereplay.integrations.skyrl.entrypoint import validate

    cfg = SkyRLTrainConfig.from_cli_overrides([f"trainer.policy.model.path={model_path}", *CPU_OVERRIDES, *overrides])
    validate(cfg)
    return cfg


@dataclass(frozen=True, slots=True)
class LocalRef:
    """An object "in the store": its pickle."""

    payload: bytes


def put(value: Any, **_options: Any) -> LocalRef:
    return LocalRef(pickle.dumps(value))


def get(refs: Any, **_options: Any) -> Any:
    if isinstance(refs, list):
        return [get(ref) for ref in refs]
    return pickle.loads(refs.payload) if isinstance(refs, LocalRef) else refs


@dataclass(frozen=True, slots=True)
class RemoteMethod:
    """`handle.method` of a Ray actor: `.remote(*args)` resolves ref arguments, runs the method, puts its result."""

    method: Callable[..., Any]

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        result = self.method(*(get(a) for a in args), **{k: get(v) for k, v in kwargs.items()})
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return put(result)


class InProcessHandle:
    """A Ray actor handle's stand-in, around the worker built in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> RemoteMethod:
        return RemoteMethod(getattr(self.worker, name))


class InProcessActorClass:
    """A Ray actor class (`ray.remote(cls)`, as `install` and SkyRL bind them) building `cls` in this process."""

    def __init__(self, actor_class: Any) -> None:
        self.cls = actor_class.__ray_metadata__.modified_class
        self.handles: list[InProcessHandle] = []

    def options(self, **_options: Any) -> InProcessActorClass:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> InProcessHandle:
        handle = InProcessHandle(self.cls(*args, **kwargs))
        self.handles.append(handle)
        return handle


@contextlib.contextmanager
def cpu_stand_ins(monkeypatch: Any) -> Iterator[None]:
    """Ray's object store in this process, and SkyRL's CUDA calls answered on the CPU (the module docstring)."""
    import ray
    import skyrl.backends.skyrl_train.distributed.fsdp_utils as fsdp_utils
    import torch.distributed.device_mesh as device_mesh

    if ray.is_initialized():
        raise RuntimeError("the SkyRL trainer-loop tests run without a Ray instance; another test left one running")
    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr(ray, "get", get)

    make_mesh = device_mesh.init_device_mesh

    def cpu_mesh(_device_type: str, *args: Any, **kwargs: Any) -> Any:
        return make_mesh("cpu", *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "set_device", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(device_mesh, "init_device_mesh", cpu_mesh)
    if hasattr(fsdp_utils, "init_device_mesh"):
        monkeypatch.setattr(fsdp_utils, "init_device_mesh", cpu_mesh)
    monkeypatch.setattr(fsdp_utils, "_sync_non_persistent_buffers", lambda model, full_sd: None)
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")  # SkyRL's actor __init__ sets them; restored after the test
    yield


def build_trainer(cfg: Any, generator: Any, *, routereplay_trainer: bool = True) -> Any:
    """`install(cfg)`, then the trainer (routereplay's `trainer_class()`, or SkyRL's own `RayPPOTrainer`) and SkyRL's
    `build_models` with the worker classes SkyRL's entrypoint imports from `fsdp_worker`, built in this process."""
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
    from skyrl.train.trainer import RayPPOTrainer

    from routereplay.integrations.skyrl import install, trainer_class
    from routereplay.testing.vllm_models import word_tokenizer

    install(cfg)
    cls = trainer_class() if routereplay_trainer else RayPPOTrainer
    trainer = cls(
        cfg=cfg, tracker=None, tokenizer=word_tokenizer(64), train_dataset=None, eval_dataset=None,
        inference_engine_client=None, generator=generator, colocate_pg=None,
    )  # fmt: skip
    classes = (fsdp_worker.PolicyWorker, fsdp_worker.CriticWorker, fsdp_worker.RefWorker)
    workers = [InProcessActorClass(c) for c in classes]
    trainer.build_models(*workers)
    return trainer


def policy_worker(trainer: Any) -> Any:
    return trainer.policy_model.actor_infos[0].handle.worker


def prompts() -> list[dict[str, Any]]:
    """The dataset rows SkyRL's dataloader yields: a chat prompt and an env class each."""
    rows = []
    for index, length in enumerate(PROMPT_LENGTHS):
        words = " ".join(f"w{4 + (7 * index + j) % 50}" for j in range(length))
        chat = [{"role": "user", "content": words}]
        rows.append({"prompt": chat, "env_class": "gsm8k", "env_extras": {}, "uid": str(index)})
    return rows


class TinyGenerator:
    """SkyRL's `GeneratorInterface` without an engine: seeded responses and rewards; with `routes` ("skyrl" or
    "routereplay") random rollout routes per trajectory (dense layers zero, as vLLM reports them)."""

    def __init__(self, tokenizer: Any, routes: str | None = None, seed: int = 0) -> None:
        self.tokenizer, self.routes, self.seed = tokenizer, routes, seed
        self.outputs: list[dict[str, Any]] = []

    async def generate(self, input_batch: dict[str, Any]) -> dict[str, Any]:
        rng = np.random.default_rng(self.seed)
        prompt_ids, response_ids, routes = [], [], []
        for index, prompt in enumerate(input_batch["prompts"]):
            ids = self.tokenizer(prompt[0]["content"])["input_ids"]
            response = rng.integers(4, 64, size=RESPONSE_LENGTHS[index // SAMPLES]).tolist()
            prompt_ids.append(ids)
            response_ids.append(response)
            if self.routes is not None:
                routes.append(self.trajectory_routes(index, ids, response, rng))
        output = {
            "prompt_token_ids": prompt_ids, "response_ids": response_ids,
            "rewards": rng.random(len(prompt_ids)).tolist(), "loss_masks": [[1] * len(r) for r in response_ids],
            "stop_reasons": ["stop"] * len(prompt_ids), "rollout_metrics": None, "rollout_logprobs": None,
            "rollout_expert_indices": routes if self.routes is not None else None,
        }  # fmt: skip
        self.outputs.append(output)
        return output

    def trajectory_routes(self, index: int, prompt: list[int], response: list[int], rng: Any) -> np.ndarray:
        """(N - 1, L, K): one engine call's routes, through SkyRL's `RoutedExpertTrace` or routereplay's rollout."""
        rows_CLK = np.zeros((len(prompt) + len(response) - 1, NUM_LAYERS, TOP_K), dtype=np.int32)
        for layer in MOE_LAYERS:
            rows_CLK[:, layer] = np.argsort(rng.random((len(rows_CLK), NUM_EXPERTS)), axis=-1)[:, :TOP_K]
        if self.routes == "skyrl":
            from skyrl.backends.skyrl_train.utils.routed_experts import RoutedExpertTrace

            trace = RoutedExpertTrace()
            trace.record_generation(
                prompt_token_count=len(prompt), generated_token_count=len(response), routed_experts=rows_CLK
            )
            loss_mask = [0] * len(prompt) + [1] * len(response)
            return trace.finalize(token_count=len(loss_mask), loss_mask=loss_mask)
        from routereplay.integrations.skyrl import RolloutRoutes, RouteGeometry

        geometry = RouteGeometry(num_experts=NUM_EXPERTS, num_layers=NUM_LAYERS, top_k=TOP_K, moe_layers=MOE_LAYERS)
        rollout = RolloutRoutes(geometry)
        rollout.add_generation(index, prompt, response, rows_CLK, prompt_start=0)
        (array_CLK,) = rollout.generator_routes([index])
        return array_CLK


def train_step(trainer: Any, *, tamper: Callable[[Any], None] | None = None) -> dict[str, float]:
    """One step of SkyRL's `RayPPOTrainer.train()` loop body: generate, postprocess, convert, the old-log-prob
    pass, advantages, `train_critic_and_policy`; `tamper` edits the batch SkyRL built before its first pass."""
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.generators.utils import prepare_generator_input

    cfg = trainer.cfg
    trainer.global_step += 1
    generator_input, uids = prepare_generator_input(
        prompts(), cfg.generator.n_samples_per_prompt,
        get_sampling_params_for_backend(cfg.generator.inference_engine.backend, cfg.generator.sampling_params),
        cfg.environment.env_class, "train", trainer.global_step,
    )  # fmt: skip
    output = asyncio.run(trainer.generate(generator_input))
    output, uids = trainer.postprocess_generator_output(output, uids)
    batch = trainer.convert_to_training_input(output, uids)
    if tamper is not None:
        tamper(batch)
    batch = trainer.fwd_logprobs_values_reward(batch)
    batch = trainer.compute_advantages_and_returns(batch)
    batch.pop("rewards")
    batch.metadata.pop("uids")
    batch.metadata.pop("is_last_step", None)
    return trainer.train_critic_and_policy(batch)


__all__ = [
    "DENSE_LAYERS",
    "MOE_LAYERS",
    "R3_OVERRIDES",
    "InProcessActorClass",
    "TinyGenerator",
    "build_trainer",
    "cpu_stand_ins",
    "policy_worker",
    "save_checkpoint",
    "skyrl_config",
    "train_step",
]
