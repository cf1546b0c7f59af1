"""verl batch routes benchmark: bytes per sample of routereplay's compact blobs against verl 0.9.1's forms.

verl's agent loop pads every sample's routes into int16 `[1, prompt_length + response_length, L, K]`
(`agent_loop.py` l.783-809) and `left_right_2_no_padding` later makes them jagged (`[n, L, K]` per
sample, int16). routereplay puts one codec blob per sample in the non-tensor batch
(`routereplay.integrations.verl.compact_blob`: set mode by default, ceil(log2 C(E, K)) bits per
(token, layer) row; ordered mode keeps the router's order too), built here from the same traces;
`padded_routes` builds verl's padded tensor, so its bytes are measured, not computed. No verl is needed.

The batch is Qwen3-30B-A3B-shaped by default: 48 MoE layers, top-8 of 128 experts, 64 samples of
1k-8k tokens, verl's prompt_length 2048 and response_length 6144. Each sample's last token has no
route (-1), and `tool_fraction` of each response is a tool span no engine routed (-1). Route sets are
drawn uniformly (a table of 65,536 random top-8 sets, indexed at random): the set codec is fixed-rate,
so skew would not shrink it (only `compress=True` would). Encode / decode times are per sample, one core.
Legend: T = route rows of a sample, L = MoE layers, K = top-k, Q = the table of route sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from routereplay.bench import compact_record as batch
from routereplay.bench.environment import collect


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlRoutesBenchConfig(batch.BatchRoutesBenchConfig):
    prompt_length: int = 2048  # verl rollout.prompt_length
    response_length: int = 6144  # verl rollout.response_length
    tool_fraction: float = 0.0  # share of each response no engine routed

    def __post_init__(self) -> None:
        self.check_batch("verl", "min_tokens", "prompt_length", "response_length")
        if not 2 <= self.min_tokens <= self.max_tokens <= self.prompt_length + self.response_length:
            raise ValueError(
                f"verl bench: tokens {self.min_tokens}-{self.max_tokens} must lie in [2, prompt_length + "
                f"response_length = {self.prompt_length + self.response_length}]"
            )
        if not 0.0 <= self.tool_fraction < 1.0 or self.top_k > self.experts:
            raise ValueError("verl bench: tool_fraction must be in [0, 1) and top_k <= experts")


def _sample_trace(
    rng: np.random.Generator, sets_QK: np.ndarray, tokens: int, response: int, c: VerlRoutesBenchConfig
) -> Any:
    from routereplay.trace.route_trace import RouteTrace

    rows = tokens - 1
    experts_TLK = sets_QK[rng.integers(0, len(sets_QK), size=(rows, c.layers))]
    tool = int(response * c.tool_fraction)
    if tool:
        begin = tokens - response + int(rng.integers(0, response - tool + 1))
        experts_TLK[begin : min(begin + tool, rows)] = -1
    return RouteTrace(experts_TLK, c.experts, layers=range(c.layers))


def run(config: VerlRoutesBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.integrations.verl import padded_routes

    report = progress or (lambda _name: None)
    rng = np.random.default_rng(config.seed)
    sets_QK = batch.set_table(rng, config.experts, config.top_k)
    dense = jagged = engine = total_tokens = 0
    tally = batch.CompactTally()
    for index in range(config.samples):
        report(f"sample {index + 1}/{config.samples}")
        tokens = int(rng.integers(config.min_tokens, config.max_tokens + 1))
        low = max(1, tokens - config.response_length)
        prompt = int(rng.integers(low, min(config.prompt_length, tokens - 1) + 1))
        response = tokens - prompt
        trace = _sample_trace(rng, sets_QK, tokens, response, config)
        padded = padded_routes(
            trace,
            prompt_len=prompt,
            response_len=response,
            prompt_length=config.prompt_length,
            response_length=config.response_length,
        )
        dense += padded.numel() * padded.element_size()
        jagged += tokens * config.layers * config.top_k * 2  # int16 [n, L, K] after left_right_2_no_padding
        engine += (tokens - 1) * config.layers * config.top_k  # vLLM's uint8 ndarray (E <= 256), MoE layers
        tally.add(trace)
        total_tokens += tokens
    n = config.samples
    return {
        "suite": "verl",
        "machine": collect(),
        "config": asdict(config),
        "mean_tokens": total_tokens / n,
        "bytes_per_sample": {
            "verl_dense_int16_padded": dense / n,
            "verl_jagged_int16": jagged / n,
            "vllm_uint8_ndarray": engine / n,
            "routereplay_compact_set": tally.set_bytes / n,
            "routereplay_compact_ordered": tally.ordered_bytes / n,
        },
        "batch_bytes": {"verl_dense_int16_padded": dense, "routereplay_compact_set": tally.set_bytes},
        "ratios": {"dense_over_compact": dense / tally.set_bytes, "jagged_over_compact": jagged / tally.set_bytes},
        **tally.timings(config.experts, config.top_k, n),
    }


def markdown(result: dict[str, Any]) -> str:
    c, sizes = result["config"], result["bytes_per_sample"]
    setting = f"verl's prompt_length {c['prompt_length']} and response_length {c['response_length']}"
    lines = [
        *batch.table_head(result, "verl", "sample", "samples", setting),
        f"| verl dense int16, padded | {sizes['verl_dense_int16_padded']:,.0f} |",
        f"| verl jagged int16 (after `left_right_2_no_padding`) | {sizes['verl_jagged_int16']:,.0f} |",
        f"| vLLM's uint8 ndarray (MoE layers) | {sizes['vllm_uint8_ndarray']:,.0f} |",
        *batch.compact_rows(result),
        "",
        f"compact is {result['ratios']['dense_over_compact']:.2f} x smaller than verl's padded tensor and "
        f"{result['ratios']['jagged_over_compact']:.2f} x smaller than its jagged form; "
        f"{batch.timing_text(result)}.",
    ]
    return "\n".join(lines)


__all__ = ["VerlRoutesBenchConfig", "markdown", "run"]
