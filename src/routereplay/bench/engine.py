"""Engine benchmark: what route capture costs the built-in engine's generation.

The model has the demo shape (Qwen3-MoE, 8 layers, top-2 of 128 experts) with random weights; speed
does not depend on training. Prompts are addition-length (6 tokens) and the engine samples 16 new
tokens each, in bf16. Each repeat generates once without capture and once with it, interleaved,
and the ratio reported is the median of the per-repeat ratios. Capture means recording every
router's choice across the KV-cache steps and assembling a `RouteTrace` per sequence.
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

CAPTURE_TARGET = 1.05


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineBenchConfig(BenchConfig):
    repeats: int = 11
    prompts: int = 256
    max_new_tokens: int = 16


def run(config: EngineBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    import transformers

    from routereplay.engines.hf import HFEngine, SamplingParams
    from routereplay.rl.model import demo_config

    report = progress or (lambda _name: None)
    report("building the model")
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForCausalLM.from_config(demo_config("qwen3_moe", 16, 1, 0)).eval()
    engines = {"no_capture": HFEngine(model, capture=False), "capture": HFEngine(model, capture=True)}
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(2, 16, (config.prompts, 6), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=config.max_new_tokens, seed=config.seed)
    calls: dict[str, Callable[[], Any]] = {name: partial(e.generate, prompts, params) for name, e in engines.items()}
    seconds = interleave(calls, config.repeats, report)
    ratio = median_ratio(seconds["capture"], seconds["no_capture"])
    tokens = config.prompts * config.max_new_tokens
    return {
        "suite": "engine",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in EngineBenchConfig.__dataclass_fields__},
        "seconds": spread(seconds),
        "tokens_per_s": {n: tokens / statistics.median(v) for n, v in seconds.items()},
        "ratios": {"capture_over_no_capture": ratio},
        "targets": {"capture_over_no_capture": target(ratio, CAPTURE_TARGET)},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine = result["config"], result["machine"]
    lines = [
        measured_on(machine, "engine", "torch", "transformers") + ".",
        "",
        f"Demo-shaped Qwen3-MoE (8 layers, top-2 of 128 experts), bf16 engine, {config['prompts']} prompts x "
        f"{config['max_new_tokens']} new tokens; {config['repeats']} interleaved repeats (median).",
        "",
        "| engine | seconds per generate (median) | low | high | new tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in result["seconds"].items():
        lines.append(
            f"| {name.replace('_', ' ')} | {s['median']:.3f} | {s['low']:.3f} | {s['high']:.3f} | "
            f"{result['tokens_per_s'][name]:.0f} |"
        )
    lines.append(
        f"\ncapture / no capture (median of per-repeat ratios): {result['ratios']['capture_over_no_capture']:.3f}"
    )
    return "\n".join(lines)


__all__ = ["EngineBenchConfig", "markdown", "run"]
