"""Replay options benchmark: what each replay option does to the engine / trainer mismatch on the demo.

`routereplay bench replay-options`. The built-in engine (bf16, its own routing, capturing routes AND
combine weights) samples answers to addition prompts from the cached demo model (Qwen3-MoE, top-2, 8
layers; trained on first use); its traces go through the codec (set mode, float16 weights)
as they would over the wire. The trainer (fp32, the same weights) then scores the same tokens once per
option, side by side in one run:
- `off`: its routers choose freely;
- `r3_ids`: it replays the engine's expert ids (R3);
- `r3_ids_weights`: ids and the engine's combine weights (`replay(weights=True)`, prime-rl #3523);
- `threshold_<m>`: ids kept only within margin m of the live top-k's K-th selection score, else the
  live choice (`replay(threshold=m)`, prime-rl #2703).
Per option: k3 KL and mean |delta log p| against the engine's log-probs over response tokens, routing
disagreement against the engine's routes (expert sets per (token, layer) row), and the replace rate;
and the codec's bytes per row with and without weights. The vLLM variant (rollouts from vLLM on CPU,
its plugin capturing the combine weights) is `bench/colocated_options.py` (`--engine vllm`); both variants
sample with `sampling` and score with `scored`.

Legend: B = sequences, S = positions, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from routereplay.bench.config import BenchConfig, require_positive
from routereplay.bench.environment import collect, measured_on
from routereplay.errors import ConfigError

if TYPE_CHECKING:
    from routereplay.engines.hf import Rollout, SamplingParams
    from routereplay.rl.tasks import AdditionTask

ENGINES = ("hf",)  # the vLLM variant is `bench/colocated_options.py` (`bench replay-options --engine vllm`)


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionsBenchConfig(BenchConfig):
    repeats: int = 1  # one scoring pass per option: the figures are mismatch measures, not timings
    engine: str = "hf"
    prompts: int = 1024
    max_new_tokens: int = 5
    margins: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01)
    engine_dtype: str = "bfloat16"
    train_steps: int = 800  # the demo model's training steps (800: the cached demo model)

    def __post_init__(self) -> None:
        require_positive(self, "replay-options", "prompts", "max_new_tokens", "train_steps")
        if self.engine not in ENGINES:
            raise ConfigError(
                f"OptionsBenchConfig(engine={self.engine!r}): this is the built-in engine's variant ({ENGINES}); the "
                "vLLM variant is bench.colocated_options.VLLMOptionsBenchConfig (`bench replay-options --engine vllm`)"
            )


def run(config: OptionsBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.engines.hf import HFEngine
    from routereplay.rl.model import load_or_train

    report = progress or (lambda _name: None)
    report("loading the demo model")
    model, tokenizer, source = load_or_train("qwen3_moe", steps=config.train_steps, seed=config.seed)
    model = model.float().eval()
    task, prompt_ids, params = sampling(config, tokenizer)
    report("sampling (engine, routes and weights)")
    engine = HFEngine(model, dtype=getattr(torch, config.engine_dtype), capture_weights=True, policy_version=0)
    rollouts = engine.generate(prompt_ids, params)
    return scored(
        config, model, rollouts, pad_token_id=task.pad_token_id, source=source, machine=collect(), report=report
    )


def sampling(config: OptionsBenchConfig, tokenizer: Any) -> tuple[AdditionTask, list[list[int]], SamplingParams]:
    """The addition task, its `config.prompts` prompts and the greedy sampling params, as both variants sample."""
    from routereplay.rl.tasks import AdditionTask

    task = AdditionTask(tokenizer)
    problems = task.problems(config.prompts, seed=config.seed + 1)
    return task, task.prompt_ids(problems), task.sampling(max_new_tokens=config.max_new_tokens, seed=config.seed)


def scored(
    config: OptionsBenchConfig,
    model: torch.nn.Module,
    rollouts: list[Rollout],
    *,
    pad_token_id: int,
    source: str,
    machine: dict[str, Any],
    report: Callable[[str], None],
) -> dict[str, Any]:
    """The suite's record from the engine's rollouts (traces with combine weights), either engine's.

    The traces go through the codec (set mode, float16 weights) as they would over the wire; then the
    trainer (`model`) scores the same tokens once per option (`off`, `r3_ids`, `r3_ids_weights`,
    `threshold_<m>` for each of `config.margins`) against the engine's log-probs and routes.
    """
    from routereplay.codec import decode, encode
    from routereplay.codec.header import WEIGHT_BYTES
    from routereplay.metrics import logprob_mismatch, routing_agreement
    from routereplay.rl.scoring import batch_of, engine_logprobs, engine_routes, logprobs_of
    from routereplay.runtime import attach

    blobs = [encode(r.trace) for r in rollouts if r.trace is not None]
    ids_only = [encode(r.trace.with_weights(None)) for r in rollouts if r.trace is not None]
    for rollout, blob in zip(rollouts, blobs, strict=True):  # the traces as the trainer receives them
        rollout.trace = decode(blob)
    rows = sum(r.trace.num_tokens * r.trace.num_layers for r in rollouts if r.trace is not None)
    batch = batch_of(rollouts, pad_token_id)
    replayer = attach(model)
    infer_BS = engine_logprobs(rollouts, batch.ids_BS.shape)
    engine_BSLK = engine_routes(rollouts, batch.ids_BS.shape, len(replayer.layers), replayer.top_k)
    traces = [r.trace for r in rollouts]

    def replayed(**options: Any) -> Callable[[], AbstractContextManager[Any]]:
        return lambda: replayer.replay(traces, batch.mask_BS, input_ids=batch.ids_BS, **options)  # type: ignore[arg-type]

    variants: dict[str, Callable[[], AbstractContextManager[Any]]] = {
        "off": replayer.record,
        "r3_ids": replayed(),
        "r3_ids_weights": replayed(weights=True),
        **{f"threshold_{m:g}": replayed(threshold=m) for m in config.margins},
    }
    options: dict[str, dict[str, Any]] = {}
    for name, context in variants.items():
        report(f"scoring (trainer, {name})")
        replayer.stats.reset()
        with torch.no_grad(), context() as used:
            logprobs_BS = logprobs_of(model, batch)
            routes_BSLK = used.routes
        mismatch = logprob_mismatch(logprobs_BS, infer_BS, batch.response_BS)
        routing = routing_agreement(routes_BSLK, engine_BSLK, batch.mask_BS.bool())
        stats = replayer.stats
        options[name] = {
            "k3_kl": mismatch["k3_kl"],
            "mean_abs_dlogp": mismatch["mean_abs_dlogp"],
            "extreme_frac_2": mismatch["extreme_frac_2"],
            "routing_disagreement": routing["routing_disagreement"],
            "replace_rate": stats.replace_rate if name.startswith("threshold") else 0.0,
            "replaced_rows_by_layer": dict(stats.replaced_rows_by_layer),
        }
    replayer.detach()
    top_k = replayer.top_k
    return {
        "suite": "replay-options",
        "targets": {},  # mismatch measures, not speed targets
        "machine": machine,
        "config": {k: getattr(config, k) for k in type(config).__dataclass_fields__},
        "model": {"source": source, "layers": list(replayer.layers), "top_k": top_k, "experts": replayer.num_experts},
        "rollouts": {"sequences": len(rollouts), "response_tokens": int(batch.response_BS.sum()), "rows": rows},
        "options": options,
        "bytes_per_row": {
            "weights": WEIGHT_BYTES * top_k,
            "blob_ids": _per_row(ids_only, rows),
            "blob_ids_weights": _per_row(blobs, rows),
        },
    }


def _per_row(blobs: Sequence[bytes], rows: int) -> float:
    return sum(len(b) for b in blobs) / max(rows, 1)


def markdown(result: dict[str, Any]) -> str:
    config, machine, size = result["config"], result["machine"], result["bytes_per_row"]
    lines = [
        measured_on(machine, "replay-options", "torch", "transformers") + ".",
        "",
        f"Demo model ({result['model']['source']}), {config['engine']} engine in {config['engine_dtype']} against the "
        f"fp32 trainer: {result['rollouts']['sequences']} sequences, {result['rollouts']['response_tokens']} response "
        "tokens; traces through the codec (set mode, float16 weights).",
        "",
        "| option | k3 KL | mean abs dlogp | F(2) | routing disagreement | replace rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, o in result["options"].items():
        lines.append(
            f"| {name} | {o['k3_kl']:.3g} | {o['mean_abs_dlogp']:.3g} | {o['extreme_frac_2']:.3g} | "
            f"{o['routing_disagreement']:.4f} | {o['replace_rate']:.4f} |"
        )
    lines.append(
        f"\nBytes per (token, layer) row: weights {size['weights']} (float16 x top-{result['model']['top_k']}); "
        f"whole blobs {size['blob_ids']:.2f} ids only, {size['blob_ids_weights']:.2f} with weights."
    )
    return "\n".join(lines)


__all__ = ["OptionsBenchConfig", "markdown", "run", "sampling", "scored"]
