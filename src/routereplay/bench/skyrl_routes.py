"""SkyRL batch routes benchmark: bytes per sample of routereplay's compact column against SkyRL 0.4.0's forms.

SkyRL carries a trajectory's routes in three forms (`routereplay.integrations.skyrl`): the `/skyrl/v1/generate`
response's `{data, shape, dtype}` envelope (base64 of the compact array, per engine call), the generator's array
(`rollout_expert_indices`: the captured prefix, every hidden layer, uint8 when E <= 256), and the batch's
`PackedTensor` (one row per real token, the uncaptured tail filled with dummy routes, `cu_seqlens` int32) with
its `router_padding_mask` (bool, one byte per padded position). routereplay's compact column is one codec blob
per trajectory (set mode by default: ceil(log2 C(E, K)) bits per (token, layer) row; ordered mode keeps the
router's order too). Every form is built here from the same traces (`generator_routes` for SkyRL's array, the
envelope with base64 + JSON as SkyRL's server writes it, the packed buffer laid out as SkyRL's collate lays it)
and its bytes measured; no SkyRL is needed.

The batch is Qwen3-30B-A3B-shaped by default: 48 layers, all MoE, top-8 of 128 experts, 64 trajectories of
1k-8k tokens, each one engine call (the last token has no route: SkyRL's tail row). Route sets are drawn
uniformly (a table of 65,536 random top-8 sets, indexed at random). Encode / decode times are per trajectory,
one core. Legend: N = tokens of a trajectory, C = its captured rows, L = layers, K = top-k, Q = the set table.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from routereplay.bench import compact_record as batch
from routereplay.bench.environment import collect


@dataclass(frozen=True, slots=True, kw_only=True)
class SkyRLRoutesBenchConfig(batch.BatchRoutesBenchConfig):
    def __post_init__(self) -> None:
        self.check_batch("skyrl")
        if not 2 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"skyrl bench: tokens {self.min_tokens}-{self.max_tokens} must satisfy 2 <= min <= max")


def _envelope_bytes(array_CLK: np.ndarray) -> int:
    """Bytes of the `routed_experts` field of a /skyrl/v1/generate body: `"routed_experts":{data, shape, dtype}`."""
    envelope = {
        "data": base64.b64encode(array_CLK.tobytes()).decode("ascii"),
        "shape": list(array_CLK.shape),
        "dtype": array_CLK.dtype.name,
    }
    return len(b'"routed_experts":') + len(json.dumps(envelope, separators=(",", ":")))


def run(config: SkyRLRoutesBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from routereplay.integrations.skyrl import RouteGeometry, generator_routes, route_digests
    from routereplay.trace.route_trace import RouteTrace

    report = progress or (lambda _name: None)
    c = config
    geometry = RouteGeometry(
        num_experts=c.experts, num_layers=c.layers, top_k=c.top_k, moe_layers=tuple(range(c.layers))
    )
    rng = np.random.default_rng(c.seed)
    sets_QK = batch.set_table(rng, c.experts, c.top_k)
    lengths = [int(n) for n in rng.integers(c.min_tokens, c.max_tokens + 1, size=c.samples)]
    width = max(lengths)  # SkyRL pads the batch to its longest trajectory (left padding)
    envelope = generator = packed = mask = 0
    tally = batch.CompactTally()
    for index, tokens in enumerate(lengths):
        report(f"sample {index + 1}/{c.samples}")
        ids_N = rng.integers(0, 150_000, size=tokens)
        experts_CLK = sets_QK[rng.integers(0, len(sets_QK), size=(tokens - 1, c.layers))]
        trace = RouteTrace(experts_CLK, c.experts, layers=range(c.layers), token_ids=ids_N[:-1])
        (array_CLK,) = generator_routes([trace], geometry)
        envelope += _envelope_bytes(array_CLK)
        generator += array_CLK.nbytes
        values_NLK = np.empty((tokens, c.layers, c.top_k), dtype=array_CLK.dtype)  # SkyRL's collate: N rows
        values_NLK[: len(array_CLK)] = array_CLK
        values_NLK[len(array_CLK) :] = np.arange(c.top_k, dtype=array_CLK.dtype)  # its dummy tail route
        packed += values_NLK.nbytes + np.dtype(np.int32).itemsize  # + this trajectory's cu_seqlens entry
        mask += np.zeros(width, dtype=np.bool_).nbytes  # router_padding_mask row
        tally.add(trace)
    digest = len(route_digests([trace], geometry)[0])
    n = c.samples
    return {
        "suite": "skyrl",
        "machine": collect(),
        "config": asdict(config),
        "mean_tokens": sum(lengths) / n,
        "bytes_per_sample": {
            "skyrl_wire_envelope": envelope / n,
            "skyrl_generator_uint8": generator / n,
            "skyrl_packed_tensor": packed / n,
            "skyrl_packed_plus_padding_mask": (packed + mask) / n,
            "routereplay_compact_set": tally.set_bytes / n,
            "routereplay_compact_ordered": tally.ordered_bytes / n,
            "routereplay_digest": digest,
        },
        "ratios": {
            "packed_over_compact": (packed + mask) / tally.set_bytes,
            "wire_over_compact": envelope / tally.set_bytes,
        },
        **tally.timings(c.experts, c.top_k, n),
    }


def markdown(result: dict[str, Any]) -> str:
    sizes = result["bytes_per_sample"]
    lines = [
        *batch.table_head(result, "skyrl", "trajectory", "trajectories", "one engine call each"),
        f"| SkyRL `/skyrl/v1/generate` envelope (base64 JSON) | {sizes['skyrl_wire_envelope']:,.0f} |",
        f"| SkyRL generator array (uint8, captured rows) | {sizes['skyrl_generator_uint8']:,.0f} |",
        f"| SkyRL batch `PackedTensor` + `router_padding_mask` | {sizes['skyrl_packed_plus_padding_mask']:,.0f} |",
        *batch.compact_rows(result),
        "",
        f"compact is {result['ratios']['packed_over_compact']:.2f} x smaller than SkyRL's packed batch field and "
        f"{result['ratios']['wire_over_compact']:.2f} x smaller than its wire envelope; "
        f"{batch.timing_text(result)}; "
        f"the packed-field digest is {sizes['routereplay_digest']} bytes per trajectory.",
    ]
    return "\n".join(lines)
