"""What route forcing cannot serve on vLLM 0.31-0.33, named before the engine serves (`ForcingSetupError`).

Forcing replaces the ids a MoE layer's router computes (`BaseRouter._compute_routing`, wrapped by
`forcing.router`), on the rows the step's forcing buffers mark. Set-ups where that is not what the experts
run, or where the step's rows are not the rows `row_map` maps, are refused by name, with the fix:

Kernels (`kernel_problems`, read from the loaded model):
- a monolithic MoE kernel (the layer's quant method has `is_monolithic` true: FlashInfer TRT-LLM
  `TrtLlm*ExpertsMonolithic`, AITER, gpt-oss Triton, CPU int4 ...) routes inside the kernel from the raw
  logits (`forward_monolithic`), so no router runs. vLLM has no setting that picks the same backend's routed
  (modular) variant: the kernel oracle takes the first class of the backend whose `is_supported_config`
  passes, monolithic first. The fix is a modular backend, `--moe-backend` (`KernelConfig.moe_backend`):
  `triton`, `flashinfer_cutlass`, `cutlass`, `deep_gemm` or `marlin`, as the layer's quantisation allows;
- DeepGEMM mega-MoE (`--moe-backend deep_gemm_mega_moe`): the module routes internally and only reports
  its ids (`RoutedExpertsCaptureSource`, `layer_id` + `capture_fn`).
Set-ups (`config_problems`, read from `VllmConfig`; the front end checks them per request too):
- speculative decoding: draft and verify rows run through the same routers, so a forced prompt's routes
  would be mixed with the draft model's and the verified rows' (and the computed-token mirror is only an
  upper bound); refused;
- data parallel > 1: the MoE layers see tokens gathered across DP ranks, not this rank's step rows;
- pipeline parallel > 1: a stage holds part of the MoE layers, and a request's routes name all of them;
- sequence-parallel MoE (`ParallelConfig.use_sequence_parallel_moe`: expert parallel, tensor parallel > 1,
  data parallel > 1 and an all2all backend that shards the batch): each rank routes a shard of the rows;
- prefill context parallel > 1 and micro-batching (`--enable-dbo`, `ubatch_size` > 1): the forward runs on a
  partition of the step's rows;
- the V1 model runner on vLLM >= 0.31 (`VLLM_USE_V2_MODEL_RUNNER=0`, or a feature that made vLLM fall back):
  the plugin hooks Model Runner V2 there.
Tensor and expert parallel are served otherwise: every rank runs the step's rows through its router; the
forced ids are logical expert ids, and `BaseRouter._select_experts` maps them to physical ones (EPLB) after
`_compute_routing`, exactly as it maps live ids.

`ROUTEREPLAY_FORCING=off` in vLLM's environment serves without forcing (the plugin hooks no worker; the front
end refuses requests that ask for it, by name).
"""

from __future__ import annotations

import os
from typing import Any

from routereplay.errors import ForcingSetupError

FORCING_ENV = "ROUTEREPLAY_FORCING"  # "off": serve without route forcing (nothing is hooked in the worker)
MODULAR_BACKENDS = ("triton", "flashinfer_cutlass", "cutlass", "deep_gemm", "marlin")
_OFF_HINT = f"or set {FORCING_ENV}=off in vLLM's environment to serve without route forcing"


def forcing_enabled() -> bool:
    """Whether this process forces routes (`ROUTEREPLAY_FORCING` is not "off")."""
    return os.environ.get(FORCING_ENV, "").strip().lower() not in ("off", "0", "false", "no")


def config_problems(vllm_config: Any) -> list[str]:
    """What in an engine's configuration route forcing cannot serve (empty: nothing)."""
    problems = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        method = getattr(vllm_config.speculative_config, "method", None)
        problems.append(
            f"speculative decoding (method {method!r}) is on: draft and verified rows would be routed and forced "
            "together; start vLLM without --speculative-config"
        )
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "data_parallel_size", 1)) != 1:
        problems.append(
            f"data_parallel_size is {parallel.data_parallel_size}: MoE layers see tokens gathered across data-"
            "parallel ranks; run one engine per rank (--data-parallel-size 1) with tensor or expert parallel"
        )
    if int(getattr(parallel, "prefill_context_parallel_size", 1)) != 1:
        problems.append(
            f"prefill_context_parallel_size is {parallel.prefill_context_parallel_size}: the forward runs on a "
            "partition of the step's rows; use --prefill-context-parallel-size 1"
        )
    if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
        problems.append(
            f"pipeline_parallel_size is {parallel.pipeline_parallel_size}: each stage holds part of the MoE layers "
            "and a request's routes name all of them; use --pipeline-parallel-size 1"
        )
    if bool(getattr(parallel, "use_sequence_parallel_moe", False)):
        problems.append(
            f"sequence-parallel MoE is on (expert parallel, tensor parallel {parallel.tensor_parallel_size}, data "
            f"parallel {parallel.data_parallel_size}, all2all_backend {getattr(parallel, 'all2all_backend', None)!r}): "
            "each rank routes a shard of the step's rows; run one data-parallel rank"
        )
    if bool(getattr(parallel, "use_ubatching", False)):
        problems.append(
            "micro-batching is on (--enable-dbo or --ubatch-size > 1): each micro-batch's MoE layers see a slice "
            "of the step's rows; start vLLM without it"
        )
    if not bool(getattr(vllm_config, "use_v2_model_runner", True)):
        problems.append(
            "vLLM runs its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, or a feature that made it fall back): on "
            "vLLM >= 0.31 route forcing hooks Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER=0 or drop that feature"
        )
    return problems


def kernel_problem(layer: int, quant_method: Any) -> str | None:
    """Why one MoE layer's kernel cannot be forced (None: it is modular, its router chooses the experts)."""
    if not bool(getattr(quant_method, "is_monolithic", False)):
        return None
    kernel = kernel_name(quant_method)
    return (
        f"MoE layer {layer} runs the monolithic kernel {kernel} ({type(quant_method).__name__}), which routes "
        f"inside the kernel from the raw logits: select a modular MoE backend, --moe-backend "
        f"{'|'.join(MODULAR_BACKENDS)} (KernelConfig.moe_backend), as the layer's quantisation allows"
    )


def kernel_name(quant_method: Any) -> str:
    """The experts kernel class of a quant method (vLLM's own lookup in `bind_routed_experts_capturer`)."""
    impl = getattr(getattr(quant_method, "moe_kernel", None), "impl", None)
    experts = getattr(impl, "fused_experts", None)
    if experts is not None:
        return type(experts).__name__
    experts_cls = getattr(quant_method, "experts_cls", None)
    return getattr(experts_cls, "__name__", "an unnamed kernel")


def kernel_problems(model: Any) -> list[str]:
    """The MoE layers of a loaded vLLM model whose kernels route internally (empty: every layer can be forced)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    problems = []
    for name, module in model.named_modules():
        if isinstance(module, MoERunner):
            problem = kernel_problem(int(module.layer_id), module.routed_experts.quant_method)
            if problem is not None:
                problems.append(problem)
        elif hasattr(module, "layer_id") and hasattr(module, "capture_fn"):  # vLLM's RoutedExpertsCaptureSource
            problems.append(
                f"module {name!r} ({type(module).__name__}, MoE layer {module.layer_id}) routes internally and only "
                "reports its ids (DeepGEMM mega-MoE): select another --moe-backend than deep_gemm_mega_moe"
            )
    return problems


def refuse(problems: list[str], *, where: str) -> None:
    """`ForcingSetupError` naming every problem and its fix; nothing when there is none."""
    if problems:
        raise ForcingSetupError(
            f"{where}: route forcing (the routereplay vLLM plugin) cannot serve this engine: "
            + "; ".join(problems)
            + f"; {_OFF_HINT}"
        )


__all__ = [
    "FORCING_ENV",
    "MODULAR_BACKENDS",
    "config_problems",
    "forcing_enabled",
    "kernel_name",
    "kernel_problem",
    "kernel_problems",
    "refuse",
]
