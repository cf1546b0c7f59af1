"""Replay benchmark: forward + backward time of a training step with routers off, recording, replaying.

The default model is Qwen3-MoE shaped and tiny enough for a CPU: hidden 256, 8 layers, 32 experts,
top-4, fp32, batch 8 x 256 tokens. `shape="qwen3-30b-a3b"` takes Qwen3-30B-A3B's layer shapes
(hidden 2048, 128 experts, top-8, expert width 768, 32 query / 4 kv heads of 128) truncated to
`layers` layers, for a GPU run in bf16 (`device="cuda"`, `dtype="bfloat16"`).
Each repeat times one step per mode, with the modes interleaved in a rotating order
(off, record, replay, replay_engine; record, replay, ...) so that drift in machine speed hits all alike. `replay` is
the default `order="set"` (each forced set in the live router's order: on CPU a gather of K scores per row when no
scores tie, else a live top-k beside the forced one; see `runtime/set_order.py`), `replay_engine` forces the
routes' own order (`order="engine"`); both count disagreement (the default), and `replay_uncounted` is `replay` with
`count_disagreement=False`, so `counting_over_uncounted` is what counting disagreement costs a replayed step
(`runtime/disagreement.py`; target <= 1%). The reported ratios are medians of per-repeat ratios; `set_over_engine`
is what the default order costs over the stored order, in the same repeats. The routes are handed to
`replay` on the host, as decoded from an engine (a device tensor would cost one device->host copy at entry;
`runtime/transfer.py`).
Legend: B = batch, S = sequence length, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from routereplay.bench.config import BenchConfig
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import check_device, interleave, median_ratio, spread, synchronizer, target

RECORD_TARGET = 1.03
REPLAY_TARGET = 1.05
SET_ORDER_TARGET = 1.01  # order="set" within 1% of order="engine" (issue 26)
COUNTING_TARGET = 1.01  # counting disagreement within 1% of a replayed step (issue 41)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayBenchConfig(BenchConfig):
    repeats: int = 21
    batch: int = 8
    seq: int = 256
    hidden: int = 256
    layers: int = 8
    experts: int = 32
    top_k: int = 4
    shape: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"replay bench: shape {self.shape!r} is not one of {sorted(SHAPES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"replay bench: dtype {self.dtype!r} must be float32, bfloat16 or float16")
        check_device("replay", self.device)


# Qwen3-30B-A3B's per-layer shapes (config.json of Qwen/Qwen3-30B-A3B); the vocabulary is cut to
# keep the LM head from dominating a truncated model.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "qwen3-30b-a3b": {
        "hidden": 2048,
        "experts": 128,
        "top_k": 8,
        "moe_intermediate": 768,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
    },
}


def model_shape(config: ReplayBenchConfig) -> dict[str, int]:
    """The model's sizes: the config's, overridden by a named shape."""
    return {
        "hidden": config.hidden,
        "experts": config.experts,
        "top_k": config.top_k,
        "moe_intermediate": config.hidden,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": config.hidden // 4,
        **SHAPES[config.shape],
    }


def build_model(config: ReplayBenchConfig) -> torch.nn.Module:
    import transformers

    shape = model_shape(config)
    model_config = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=shape["hidden"],
        intermediate_size=4 * shape["hidden"],
        moe_intermediate_size=shape["moe_intermediate"],
        num_hidden_layers=config.layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],  # type: ignore[call-arg]  # a config kwarg the stub does not list
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        max_position_embeddings=max(512, config.seq),
    )
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, config.dtype))
    return model.to(config.device).train()


def run(config: ReplayBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.runtime import attach

    report = progress or (lambda _name: None)
    report("building the model")
    model = build_model(config)
    generator = torch.Generator().manual_seed(config.seed)
    ids_BS = torch.randint(0, 1024, (config.batch, config.seq), generator=generator).to(config.device)
    mask_BS = torch.ones_like(ids_BS)
    synchronize = synchronizer(config.device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids_BS, attention_mask=mask_BS).logits
        logits.float().logsumexp(-1).mean().backward()
        synchronize()  # GPU work is asynchronous: time it to the end

    replayer = attach(model)
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids_BS, attention_mask=mask_BS)
    routes_BSLK = rec.routes.cpu()  # on the host, as an engine delivers them: a replayed step reads no device value

    def off() -> None:
        step()

    def record() -> None:
        with replayer.record():
            step()

    def replay() -> None:
        with replayer.replay(routes_BSLK):
            step()

    def replay_engine() -> None:
        with replayer.replay(routes_BSLK, order="engine"):
            step()

    def replay_uncounted() -> None:
        with replayer.replay(routes_BSLK, count_disagreement=False):
            step()

    modes = {
        "off": off,
        "record": record,
        "replay": replay,
        "replay_engine": replay_engine,
        "replay_uncounted": replay_uncounted,
    }
    seconds = interleave(modes, config.repeats, report)
    replayer.detach()
    ratios = {
        "record_over_off": median_ratio(seconds["record"], seconds["off"]),
        "replay_over_off": median_ratio(seconds["replay"], seconds["off"]),
        "replay_engine_over_off": median_ratio(seconds["replay_engine"], seconds["off"]),
        "set_over_engine": median_ratio(seconds["replay"], seconds["replay_engine"]),
        "replay_uncounted_over_off": median_ratio(seconds["replay_uncounted"], seconds["off"]),
        "counting_over_uncounted": median_ratio(seconds["replay"], seconds["replay_uncounted"]),
    }
    return {
        "suite": "replay",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in ReplayBenchConfig.__dataclass_fields__},
        "model": model_shape(config),
        "seconds": spread(seconds),
        "ratios": ratios,
        "targets": {
            "record_over_off": target(ratios["record_over_off"], RECORD_TARGET),
            "replay_over_off": target(ratios["replay_over_off"], REPLAY_TARGET),
            "set_over_engine": target(ratios["set_over_engine"], SET_ORDER_TARGET),
            "counting_over_uncounted": target(ratios["counting_over_uncounted"], COUNTING_TARGET),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine, model = result["config"], result["machine"], result["model"]
    lines = [
        measured_on(machine, "replay", "torch", "transformers", threads=True) + ".",
        "",
        f"Qwen3-MoE ({config['shape']}) shape: hidden {model['hidden']}, {config['layers']} layers, "
        f"{model['experts']} experts, top-{model['top_k']}, {config['dtype']} on {config['device']}; "
        f"batch {config['batch']} x {config['seq']}; forward + backward; "
        f"{config['repeats']} interleaved repeats (median).",
        "",
        "| mode | seconds per step (median) | low | high | ratio to off |",
        "|---|---:|---:|---:|---:|",
    ]
    ratios = result["ratios"]
    ratio = {"off": 1.0, **{name: ratios.get(f"{name}_over_off") for name in result["seconds"] if name != "off"}}
    names = {
        "replay": "replay (order set)",
        "replay_engine": "replay (order engine)",
        "replay_uncounted": "replay (order set, count_disagreement=False)",
    }
    for name, s in result["seconds"].items():
        label, r = names.get(name, name), ratio[name]
        shown = "-" if r is None else f"{r:.3f}"
        lines.append(f"| {label} | {s['median']:.4f} | {s['low']:.4f} | {s['high']:.4f} | {shown} |")
    if "set_over_engine" in ratios:
        lines += [
            "",
            f"Order set over order engine, per repeat (median): {ratios['set_over_engine']:.3f}.",
        ]
    if "counting_over_uncounted" in ratios:
        lines.append(
            f"Counting disagreement over not counting, per repeat (median): {ratios['counting_over_uncounted']:.3f}."
        )
    return "\n".join(lines)


__all__ = ["ReplayBenchConfig", "markdown", "run"]
