"""Indexer benchmark: compact DSA indexer choices against the dense int32 form.

Two synthetic sequences of T query tokens over L DSA layers picking I keys each: `recent` (a query
at position p picks key k with weight 1 / (1 + p - k), the recency bias real indexers show, plus
the first keys as attention sinks) and `uniform` (every visible key alike: the worst case for the
gap form). For each: bytes of the `IndexerTrace` blob and of its resident form against
T * L * I * 4 dense bytes, and the median seconds (over `repeats`) of encode (dense array ->
trace -> blob) and decode (blob -> checked trace -> dense array). The decode is checked to give the
input back exactly. `routereplay bench indexer` (part of `bench all`) runs `run`; `indexer_bench()`
returns the same JSON-ready dict without the machine and targets.
Legend: T = query tokens, L = DSA layers, I = index_topk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from routereplay.bench.config import BenchConfig, require_positive
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import measure, target
from routereplay.indexer.trace import IndexerTrace

SINK_KEYS = 4  # recent case: the first keys every query keeps (attention sinks)


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerBenchConfig(BenchConfig):
    num_tokens: int = 4096
    num_layers: int = 4
    index_topk: int = 512

    def __post_init__(self) -> None:
        require_positive(self, "indexer", "repeats", "num_tokens", "num_layers", "index_topk")


def synthetic_choices(num_tokens: int, num_layers: int, index_topk: int, *, recent: bool, seed: int = 0) -> np.ndarray:
    """A canonical (T, L, I) int32 array: weighted sampling without replacement (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    out_TLI = np.full((num_tokens, num_layers, index_topk), -1, np.int32)
    for t in range(num_tokens):
        visible = t + 1
        if visible <= index_topk:
            out_TLI[t, :, :visible] = np.arange(visible, dtype=np.int32)
            continue
        scores_LN = rng.gumbel(size=(num_layers, visible))
        if recent:
            scores_LN -= np.log1p(np.arange(visible)[::-1])
            scores_LN[:, :SINK_KEYS] = np.inf
        picked_LI = np.argpartition(scores_LN, visible - index_topk, axis=1)[:, visible - index_topk :]
        out_TLI[t] = np.sort(picked_LI, axis=1)
    return out_TLI


def _encode(dense_TLI: np.ndarray, layers: tuple[int, ...], index_topk: int) -> bytes:
    return IndexerTrace.from_dense(dense_TLI, layers, index_topk).encode()


def _decode(blob: bytes) -> np.ndarray:
    return IndexerTrace.decode(blob).to_dense()


def indexer_bench(config: IndexerBenchConfig | None = None) -> dict[str, Any]:
    """Sizes and encode/decode medians of both synthetic cases (see the module docstring)."""
    config = config or IndexerBenchConfig()
    T, L, I = config.num_tokens, config.num_layers, config.index_topk
    layers = tuple(range(L))
    cases = []
    for name, recent in (("recent", True), ("uniform", False)):
        dense_TLI = synthetic_choices(T, L, I, recent=recent, seed=config.seed)
        trace = IndexerTrace.from_dense(dense_TLI, layers, I)
        blob = trace.encode()
        if not np.array_equal(IndexerTrace.decode(blob).to_dense(), dense_TLI):
            raise AssertionError(f"indexer bench case {name}: decode(encode(x)) != x")
        encode = measure(partial(_encode, dense_TLI, layers, I), config.repeats)
        decode = measure(partial(_decode, blob), config.repeats)
        dense_bytes = dense_TLI.nbytes
        cases.append({
            "case": name,
            "dense_bytes": dense_bytes,
            "blob_bytes": len(blob),
            "resident_bytes": trace.nbytes,
            "dense_over_blob": dense_bytes / len(blob),
            "bytes_per_token": len(blob) / T,
            "encode_seconds": encode.to_dict(),
            "decode_seconds": decode.to_dict(),
            "encode_dense_mb_per_s": dense_bytes / encode.median / 1e6 if encode.median > 0 else float("inf"),
            "decode_dense_mb_per_s": dense_bytes / decode.median / 1e6 if decode.median > 0 else float("inf"),
        })  # fmt: skip
    return {"suite": "indexer", "config": asdict(config), "cases": cases}


DENSE_OVER_BLOB_TARGET = 8.0  # the recency-biased case's blob is at least 8x smaller than dense int32


def run(config: IndexerBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`indexer_bench` with the machine and the target: the record `bench indexer` prints."""
    (progress or (lambda _step: None))("recent and uniform cases")
    result = indexer_bench(config)
    recent = next(case for case in result["cases"] if case["case"] == "recent")
    result["machine"] = collect()
    result["targets"] = {
        "recent_dense_over_blob": target(recent["dense_over_blob"], DENSE_OVER_BLOB_TARGET, higher_is_better=True)
    }
    return result


def markdown(result: dict[str, Any]) -> str:
    """The BENCHMARKS.md table for a `run` record."""
    config, machine = result["config"], result["machine"]
    lines = [
        measured_on(machine, "indexer", "numpy") + ".",
        "",
        f"T={config['num_tokens']} query tokens x L={config['num_layers']} DSA layers, index_topk "
        f"I={config['index_topk']}, {config['repeats']} repeats (median); dense = T x L x I int32.",
        "",
        "| case | dense bytes | blob bytes | dense / blob | bytes / token | encode MB/s dense | decode MB/s dense |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in result["cases"]:
        lines.append(
            f"| {case['case']} | {case['dense_bytes']:,} | {case['blob_bytes']:,} | {case['dense_over_blob']:.2f} | "
            f"{case['bytes_per_token']:.1f} | {case['encode_dense_mb_per_s']:.1f} | "
            f"{case['decode_dense_mb_per_s']:.1f} |"
        )
    return "\n".join(lines)


__all__ = ["IndexerBenchConfig", "indexer_bench", "markdown", "run", "synthetic_choices"]
