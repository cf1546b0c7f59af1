"""Replay benchmark: forward + backward time of a training step with routers off, recording, replaying.

The model is Qwen3-MoE shaped and tiny enough for a CPU: hidden 256, 8 layers, 32 experts, top-4.
The batch is 8 x 256 tokens. Each repeat times one step per mode, with the modes interleaved
(off, record, replay, ...) so that drift in machine speed hits all three alike. The reported ratios
are medians of those per-repeat times. Legend: B = batch, S = sequence length, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from routereplay.bench.timing import interleave, median_ratio, spread, target
from routereplay.environment import collect

RECORD_TARGET = 1.03
REPLAY_TARGET = 1.05


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayBenchConfig:
    batch: int = 8
    seq: int = 256
    hidden: int = 256
    layers: int = 8
    experts: int = 32
    top_k: int = 4
    repeats: int = 21
    seed: int = 0


def build_model(config: ReplayBenchConfig) -> torch.nn.Module:
    import transformers

    model_config = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=config.hidden,
        intermediate_size=4 * config.hidden,
        moe_intermediate_size=config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=config.hidden // 4,  # type: ignore[call-arg]  # a config kwarg the stub does not list
        num_experts=config.experts,
        num_experts_per_tok=config.top_k,
        max_position_embeddings=max(512, config.seq),
    )
    torch.manual_seed(config.seed)
    return transformers.AutoModelForCausalLM.from_config(model_config).train()


def run(config: ReplayBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.runtime import attach

    report = progress or (lambda _name: None)
    report("building the model")
    model = build_model(config)
    generator = torch.Generator().manual_seed(config.seed)
    ids_BS = torch.randint(0, 1024, (config.batch, config.seq), generator=generator)
    mask_BS = torch.ones_like(ids_BS)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids_BS, attention_mask=mask_BS).logits
        logits.float().logsumexp(-1).mean().backward()

    replayer = attach(model)
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids_BS, attention_mask=mask_BS)
    routes_BSLK = rec.routes

    def off() -> None:
        step()

    def record() -> None:
        with replayer.record():
            step()

    def replay() -> None:
        with replayer.replay(routes_BSLK):
            step()

    seconds = interleave({"off": off, "record": record, "replay": replay}, config.repeats, report)
    replayer.detach()
    ratios = {
        "record_over_off": median_ratio(seconds["record"], seconds["off"]),
        "replay_over_off": median_ratio(seconds["replay"], seconds["off"]),
    }
    return {
        "suite": "replay",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in ReplayBenchConfig.__dataclass_fields__},
        "seconds": spread(seconds),
        "ratios": ratios,
        "targets": {
            "record_over_off": target(ratios["record_over_off"], RECORD_TARGET),
            "replay_over_off": target(ratios["replay_over_off"], REPLAY_TARGET),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine = result["config"], result["machine"]
    lines = [
        f"Measured on {machine['processor']} ({machine['cpu_count']} cores, {machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, transformers {machine['transformers']}, by `routereplay bench replay`.",
        "",
        f"Qwen3-MoE shape: hidden {config['hidden']}, {config['layers']} layers, {config['experts']} experts, "
        f"top-{config['top_k']}; batch {config['batch']} x {config['seq']}; forward + backward; "
        f"{config['repeats']} interleaved repeats (median).",
        "",
        "| mode | seconds per step (median) | low | high | ratio to off |",
        "|---|---:|---:|---:|---:|",
    ]
    ratio = {"off": 1.0, "record": result["ratios"]["record_over_off"], "replay": result["ratios"]["replay_over_off"]}
    for name, s in result["seconds"].items():
        lines.append(f"| {name} | {s['median']:.4f} | {s['low']:.4f} | {s['high']:.4f} | {ratio[name]:.3f} |")
    return "\n".join(lines)


__all__ = ["ReplayBenchConfig", "markdown", "run"]
