"""Store benchmark: memory of holding a batch's routes in the ragged `RouteStore` vs dense padding.

The workload is an RL batch of Qwen3-30B-A3B shape: 512 samples of up to 8192 tokens (lengths
uniform in [1024, 8192]), 48 MoE layers, top-8 of 128 experts. Three ways to hold its routes:

- `store`: routereplay's `RouteStore` — each sample's token ids and its (N - 1, L, K) int16 trace,
  added one sample at a time as rollouts finish (validated, copied in);
- `dense int16`: the padded [B, S, L, K] int16 batch tensor verl keeps on the driver;
- `dense int32`: the same in int32, the dtype SGLang sends and several trainers decode to.

Peak memory is read with `tracemalloc` (numpy reports every array allocation to it), from an
empty start, while each is built; the unpadded payload is sum(N - 1) x L x K x 2 bytes. Build
time of the store is the median of repeated builds. Legend: B = samples, S = padded length,
N = tokens of a sample, L = layers, K = top-k.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from routereplay.bench.timing import target
from routereplay.environment import collect
from routereplay.store import RouteStore
from routereplay.trace import RouteTrace, canonical_dtype

STORE_TARGET = 1.05


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreBenchConfig:
    samples: int = 512
    seq: int = 8192
    min_len: int = 1024
    layers: int = 48
    top_k: int = 8
    experts: int = 128
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples", "seq", "min_len", "layers", "top_k", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"store bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.min_len > self.seq:
            raise ValueError(f"store bench: min_len {self.min_len} exceeds seq {self.seq}")
        if self.top_k > self.experts:
            raise ValueError(f"store bench: top_k {self.top_k} exceeds experts {self.experts}")


def _peak(build: Callable[[], Any]) -> tuple[int, Any]:
    """Peak traced bytes while `build()` runs (from an empty trace), and what it built."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        held = build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, held


def _base_routes(config: StoreBenchConfig) -> np.ndarray:
    """(seq, L, K) valid routes: distinct ids per row, varying by token and layer."""
    rows_T = np.arange(config.seq)[:, None, None]
    layers_L = np.arange(config.layers)[None, :, None] * 7
    slots_K = np.arange(config.top_k)[None, None, :] * (config.experts // config.top_k)
    return ((rows_T + layers_L + slots_K) % config.experts).astype(canonical_dtype(config.experts))


def build_store(config: StoreBenchConfig, lengths: list[int], base_SLK: np.ndarray) -> RouteStore:
    store = RouteStore(num_experts=config.experts, layers=tuple(range(config.layers)), top_k=config.top_k)
    for i, n in enumerate(lengths):
        experts_TLK = base_SLK[: n - 1].copy()  # the rollout's own array, freed after it is added
        store.add_turn(
            i, np.arange(n, dtype=np.int64), RouteTrace(experts_TLK, config.experts, tuple(range(config.layers)))
        )
        del experts_TLK
    return store


def run(config: StoreBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    report = progress or (lambda _name: None)
    rng = np.random.default_rng(config.seed)
    lengths = [int(n) for n in rng.integers(config.min_len, config.seq + 1, config.samples)]
    base_SLK = _base_routes(config)
    row_bytes = config.layers * config.top_k * base_SLK.itemsize
    payload = sum(n - 1 for n in lengths) * row_bytes

    report("store: building")
    seconds = []
    for repeat in range(config.repeats):
        report(f"store: timed build {repeat + 1}/{config.repeats}")
        begin = time.perf_counter()
        store = build_store(config, lengths, base_SLK)
        seconds.append(time.perf_counter() - begin)
        del store
    report("store: peak memory")
    store_peak, store = _peak(lambda: build_store(config, lengths, base_SLK))
    held = sum(store.trace(i).experts.nbytes for i in range(len(lengths)))
    del store
    peaks = {"store": store_peak}
    shape = (config.samples, config.seq, config.layers, config.top_k)
    for name, dtype in (("dense_int16", np.int16), ("dense_int32", np.int32)):
        report(f"{name}: peak memory")
        peak, dense = _peak(partial(np.full, shape, -1, dtype=dtype))
        peaks[name] = peak
        del dense
    seconds.sort()
    ratios = {
        "store_over_payload": peaks["store"] / payload,
        "dense_int16_over_store": peaks["dense_int16"] / peaks["store"],
        "dense_int32_over_store": peaks["dense_int32"] / peaks["store"],
    }
    return {
        "suite": "store",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in StoreBenchConfig.__dataclass_fields__},
        "tokens": sum(lengths),
        "payload_bytes": payload,
        "routes_held_bytes": held,
        "peak_bytes": peaks,
        "store_build_seconds": {"median": seconds[len(seconds) // 2], "low": seconds[0], "high": seconds[-1]},
        "ratios": ratios,
        "targets": {"store_over_payload": target(ratios["store_over_payload"], STORE_TARGET)},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine, peaks = result["config"], result["machine"], result["peak_bytes"]
    gib = 2**30
    lines = [
        f"Measured on {machine['processor']} ({machine['cpu_count']} cores), numpy {machine['numpy']}, "
        "by `routereplay bench store` (peak bytes from tracemalloc).",
        "",
        f"{config['samples']} samples x up to {config['seq']} tokens ({result['tokens']} tokens, lengths uniform in "
        f"[{config['min_len']}, {config['seq']}]), {config['layers']} layers, top-{config['top_k']} of "
        f"{config['experts']}; unpadded int16 payload {result['payload_bytes'] / gib:.3f} GiB.",
        "",
        "| holding the batch's routes | peak GiB | x unpadded payload |",
        "|---|---:|---:|",
    ]
    names = {
        "store": "routereplay RouteStore (ragged int16 + token ids)",
        "dense_int16": "dense padded int16 [B, S, L, K] (verl driver)",
        "dense_int32": "dense padded int32 [B, S, L, K]",
    }
    for name, peak in peaks.items():
        lines.append(f"| {names[name]} | {peak / gib:.3f} | {peak / result['payload_bytes']:.3f} |")
    build = result["store_build_seconds"]
    lines += [
        "",
        f"Store build (validate + copy every sample): {build['median']:.2f} s median of {config['repeats']} "
        f"(low {build['low']:.2f}, high {build['high']:.2f}).",
    ]
    return "\n".join(lines)


__all__ = ["StoreBenchConfig", "build_store", "markdown", "run"]
