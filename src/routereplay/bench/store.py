"""Store benchmark: driver memory of a batch's routes, compact `RouteStore` vs int16 holders.

The workload is an RL batch of Qwen3-30B-A3B shape: 512 samples of up to 8192 tokens (lengths
uniform in [1024, 8192]), 48 MoE layers, top-8 of 128 experts. Four ways to hold its routes, all
built from the same routes in one run:

- `compact`: routereplay's `RouteStore` as it is now: every sample's token ids and its routes kept
  encoded (set codec by default), added one sample at a time as rollouts finish (validated, encoded);
- `ragged_int16`: one decoded (N - 1, L, K) int16 array and the token ids per sample, what
  `RouteStore` held before it kept samples encoded;
- `dense_int16`: the padded [B, S, L, K] int16 batch tensor verl keeps on the driver;
- `dense_int32`: the same in int32, the dtype SGLang sends and several trainers decode to.

Peak memory is read with `tracemalloc` (numpy reports every array allocation to it, Python every
`bytes` blob), from an empty start, while each is built; `held` is what is still traced once it is
built; `store.nbytes` is the store's own count. The unpadded payload is sum(N - 1) x L x K x 2 bytes.
Build time of the compact store (every `add_turn`: validate + encode) is the median of repeated builds.

Routes come from one random (S, L, K) block drawn once (`SampleSource`): sample i takes a window of it
with its expert ids relabelled by a random permutation, so each sample's rows differ, stay valid, and
generating 512 samples costs one table lookup each.

Legend: B = samples, S = padded length (the longest sample), N = tokens of a sample, L = layers,
K = top-k, E = experts.
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

from routereplay.bench.config import SampledBenchConfig, require_positive, require_routing
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import target
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.trace.route_trace import RouteTrace

COMPACT_TARGET = 0.35  # compact store peak / unpadded int16 payload
VOCABULARY = 151_936  # Qwen3's vocabulary: token ids are drawn below it


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreBenchConfig(SampledBenchConfig):
    repeats: int = 3
    samples: int = 512

    def __post_init__(self) -> None:
        require_routing(self, "store")
        require_positive(self, "store", "samples", "seq")
        if self.min_len < 2:
            raise ValueError(
                f"store bench: min_len must be >= 2 (a sample of one token has no route), got {self.min_len}"
            )
        if self.min_len > self.seq:
            raise ValueError(f"store bench: min_len {self.min_len} exceeds seq {self.seq}")


class SampleSource:
    """Seeded samples of a batch: lengths, token ids and routes, cheap to generate (see the module docstring)."""

    __slots__ = ("_base_SLK", "_offsets", "_permutations", "_rng_seed", "layers", "lengths", "num_experts")

    def __init__(
        self, *, samples: int, seq: int, min_len: int, layers: int, top_k: int, experts: int, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = [int(n) for n in rng.integers(min_len, seq + 1, samples)]
        self.layers = tuple(range(layers))
        self.num_experts = experts
        base = random_trace(rng, num_tokens=seq - 1, num_layers=layers, top_k=top_k, num_experts=experts)
        self._base_SLK = base.experts
        self._offsets = [int(rng.integers(0, seq - n + 1)) for n in self.lengths]
        self._permutations = [rng.permutation(experts).astype(self._base_SLK.dtype) for _ in self.lengths]
        self._rng_seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def routes(self, i: int) -> np.ndarray:
        """(N - 1, L, K) routes of sample i (a new array)."""
        offset, n = self._offsets[i], self.lengths[i]
        return self._permutations[i][self._base_SLK[offset : offset + n - 1]]

    def tokens(self, i: int) -> np.ndarray:
        """(N,) int64 token ids of sample i."""
        return np.random.default_rng((self._rng_seed, i)).integers(0, VOCABULARY, self.lengths[i], dtype=np.int64)

    def trace(self, routes_TLK: np.ndarray) -> RouteTrace:
        return RouteTrace(routes_TLK, self.num_experts, self.layers)

    @property
    def rows(self) -> int:
        """(token, layer) rows of the batch: sum(N - 1) x L."""
        return sum(n - 1 for n in self.lengths) * len(self.layers)


def source_of(config: SampledBenchConfig) -> SampleSource:
    """The samples of the store or the delivery suite's batch."""
    return SampleSource(
        samples=config.samples,
        seq=config.seq,
        min_len=config.min_len,
        layers=config.layers,
        top_k=config.top_k,
        experts=config.experts,
        seed=config.seed,
    )


def build_ragged(source: SampleSource) -> list[tuple[np.ndarray, np.ndarray]]:
    """Today's ragged int16 holder: (token ids, decoded routes) per sample."""
    return [(source.tokens(i), source.routes(i)) for i in range(len(source))]


def build_store(source: SampleSource, ragged: list[tuple[np.ndarray, np.ndarray]], top_k: int) -> RouteStore:
    """The compact store, one `add_turn` per sample as rollouts finish (validated and encoded)."""
    store = RouteStore(num_experts=source.num_experts, layers=source.layers, top_k=top_k)
    for i, (tokens_N, routes_TLK) in enumerate(ragged):
        store.add_turn(i, tokens_N, source.trace(routes_TLK))
    return store


def _traced(build: Callable[[], Any]) -> tuple[int, int, Any]:
    """Peak and held traced bytes of `build()` (from an empty trace), and what it built."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        built = build()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, held, built


def run(config: StoreBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    report = progress or (lambda _name: None)
    report("generating routes")
    source = source_of(config)
    payload = source.rows * config.top_k * 2
    peaks: dict[str, int] = {}
    held: dict[str, int] = {}
    report("ragged_int16: peak memory")
    peaks["ragged_int16"], held["ragged_int16"], ragged = _traced(partial(build_ragged, source))

    seconds = []
    for repeat in range(config.repeats):
        report(f"compact: timed build {repeat + 1}/{config.repeats}")
        gc.collect()
        begin = time.perf_counter()
        store = build_store(source, ragged, config.top_k)
        seconds.append(time.perf_counter() - begin)
        del store
    report("compact: peak memory")
    peaks["compact"], held["compact"], store = _traced(partial(build_store, source, ragged, config.top_k))
    nbytes = store.nbytes
    _check_readback(store, ragged)
    del store, ragged

    shape = (config.samples, max(source.lengths), config.layers, config.top_k)
    for name, dtype in (("dense_int16", np.int16), ("dense_int32", np.int32)):
        report(f"{name}: peak memory")
        peaks[name], held[name], dense = _traced(partial(np.full, shape, -1, dtype=dtype))
        del dense
    seconds.sort()
    build = {"median": seconds[len(seconds) // 2], "low": seconds[0], "high": seconds[-1]}
    ratios = {
        "compact_over_payload": peaks["compact"] / payload,
        "compact_nbytes_over_payload": nbytes / payload,
        "ragged_int16_over_compact": peaks["ragged_int16"] / peaks["compact"],
        "dense_int16_over_compact": peaks["dense_int16"] / peaks["compact"],
        "dense_int32_over_compact": peaks["dense_int32"] / peaks["compact"],
    }
    return {
        "suite": "store",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in StoreBenchConfig.__dataclass_fields__},
        "tokens": sum(source.lengths),
        "rows": source.rows,
        "padded_length": shape[1],
        "payload_bytes": payload,
        "store_nbytes": nbytes,
        "peak_bytes": peaks,
        "held_bytes": held,
        "build_seconds": build,
        "encode_rows_per_s": source.rows / build["median"],
        "ratios": ratios,
        "targets": {"compact_over_payload": target(ratios["compact_over_payload"], COMPACT_TARGET)},
    }


def _check_readback(store: RouteStore, ragged: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """The compact store gives back every route set it was given (rows read back sorted: a set store)."""
    for i in sorted({0, len(ragged) // 2, len(ragged) - 1}):
        tokens_N, routes_TLK = ragged[i]
        if not np.array_equal(store.rows(i, 0, len(tokens_N) - 1), np.sort(routes_TLK, axis=2)):
            raise AssertionError(f"store bench: sample {i} reads back routes other than the ones added")


def markdown(result: dict[str, Any]) -> str:
    config, machine, peaks, held = result["config"], result["machine"], result["peak_bytes"], result["held_bytes"]
    gib, payload = 2**30, result["payload_bytes"]
    lines = [
        measured_on(machine, "store", "numpy") + " (peak and held bytes from tracemalloc).",
        "",
        f"{config['samples']} samples x up to {config['seq']} tokens ({result['tokens']} tokens, lengths uniform in "
        f"[{config['min_len']}, {config['seq']}], padded to {result['padded_length']}), {config['layers']} layers, "
        f"top-{config['top_k']} of {config['experts']}; unpadded int16 payload {payload / gib:.3f} GiB.",
        "",
        "| holding the batch's routes | peak GiB | held GiB | peak x unpadded payload |",
        "|---|---:|---:|---:|",
    ]
    names = {
        "compact": "routereplay RouteStore (encoded, set codec + token ids)",
        "ragged_int16": "ragged int16 + token ids (RouteStore before the compact store)",
        "dense_int16": "dense padded int16 [B, S, L, K] (verl driver)",
        "dense_int32": "dense padded int32 [B, S, L, K]",
    }
    for name in ("compact", "ragged_int16", "dense_int16", "dense_int32"):
        lines.append(
            f"| {names[name]} | {peaks[name] / gib:.3f} | {held[name] / gib:.3f} | {peaks[name] / payload:.3f} |"
        )
    build = result["build_seconds"]
    lines += [
        "",
        f"`store.nbytes` {result['store_nbytes'] / gib:.3f} GiB ({result['ratios']['compact_nbytes_over_payload']:.3f}"
        "x the payload). Compact store build (validate + encode every sample, one `add_turn` each): "
        f"{build['median']:.2f} s median of {config['repeats']} (low {build['low']:.2f}, high {build['high']:.2f}), "
        f"{result['encode_rows_per_s'] / 1e6:.2f}M (token, layer) rows/s.",
    ]
    return "\n".join(lines)


__all__ = ["SampleSource", "StoreBenchConfig", "build_ragged", "build_store", "markdown", "run", "source_of"]
