"""Codec benchmark: bytes per (token, layer) row and throughput, against the engines' own forms.

Every format is measured in the same run on the same routes: routereplay's set and ordered codec,
JSON nested lists (vLLM 0.21, verl/SkyRL glue), SGLang's base64 raw int32, vLLM >= 0.22's base64
`.npy` uint8 (uint16 when E > 256), and raw uint8 bytes. Peers are timed on their format work
alone: wire bytes -> an int16 (T, L, K) array, the signed dtype a trainer needs for the -1 sentinel
(what routereplay's decode returns inside its `RouteTrace`).
The end-to-end validated decoders are timed too, since that is what a trainer pays.
Legend: T = tokens, L = layers, K = top-k, E = experts.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from routereplay.bench.config import BenchConfig, require_positive
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import Timing, measure, target
from routereplay.codec import blob as codec
from routereplay.testing.synthetic import random_trace
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.payload import npy_bytes
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

SET_VS_ENTROPY_TARGET = 1.02
DECODE_SECONDS_TARGET = 0.3
SET_VS_SGLANG_TARGET = 6.0
# one core (numpy runs single-threaded), Qwen3-30B-A3B shape (48 layers, top-8 of 128); the raw uint8
# format of the same run (~1-2 G rows/s, a memory copy) is the anchor the codec rates are read against
DECODE_ROWS_PER_S_TARGET = 60e6  # issue 26: route decode at rollout speed
ENCODE_ROWS_PER_S_TARGET = 40e6  # issue 26: encode (validate + rank + pack) at rollout speed


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecBenchConfig(BenchConfig):
    """The routing under `RouteTrace`'s names (`num_layers`, `num_experts`), as `random_trace` takes it."""

    num_tokens: int = 32768
    num_layers: int = 48
    top_k: int = 8
    num_experts: int = 128

    def __post_init__(self) -> None:
        require_positive(self, "codec", "repeats", "num_tokens", "num_layers", "top_k", "num_experts")


@dataclass(frozen=True, slots=True)
class FormatCase:
    name: str
    encode: Callable[[], Any]
    decode: Callable[[Any], Any]


def _cases(trace: RouteTrace) -> list[FormatCase]:
    experts_TLK = trace.experts
    wire = np.uint8 if trace.num_experts <= 256 else np.uint16
    cases = [
        FormatCase("routereplay set", lambda: codec.encode(trace), codec.decode),
        FormatCase("routereplay ordered", lambda: codec.encode(trace, mode="ordered"), codec.decode),
        FormatCase(  # what an install without a C compiler runs (and the kernel's test reference)
            "routereplay set, numpy path",
            lambda: codec.encode(trace, native=False),
            lambda blob: codec.decode(blob, native=False),
        ),
        FormatCase(
            "JSON nested lists",
            lambda: json.dumps(experts_TLK.tolist()).encode(),
            lambda blob: np.asarray(json.loads(blob), dtype=np.int16),
        ),
        FormatCase(
            "SGLang base64 int32",
            lambda: base64.b64encode(experts_TLK.astype(np.int32).tobytes()),
            lambda blob: (
                np.frombuffer(base64.b64decode(blob), np.int32).reshape(-1, *experts_TLK.shape[1:]).astype(np.int16)
            ),
        ),
        FormatCase(
            f"vLLM base64 .npy {np.dtype(wire)}",
            lambda: base64.b64encode(npy_bytes(experts_TLK.astype(wire))),
            lambda blob: np.load(io.BytesIO(base64.b64decode(blob)), allow_pickle=False).astype(np.int16),
        ),
        FormatCase(
            f"raw {np.dtype(wire)}",
            lambda: experts_TLK.astype(wire).tobytes(),
            lambda blob: np.frombuffer(blob, wire).reshape(experts_TLK.shape).astype(np.int16),
        ),
    ]
    return cases


def run(config: CodecBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every format on one random trace; returns the JSON record `bench codec` prints."""
    report = progress or (lambda _name: None)
    rng = np.random.default_rng(config.seed)
    trace = random_trace(
        rng,
        num_tokens=config.num_tokens,
        num_layers=config.num_layers,
        top_k=config.top_k,
        num_experts=config.num_experts,
    )
    rows = config.num_tokens * config.num_layers
    entropy_bytes = codec.entropy_bits_per_row(config.num_experts, config.top_k) / 8
    formats: list[dict[str, Any]] = []
    for case in _cases(trace):
        report(case.name)
        blob = case.encode()
        encode_t = measure(case.encode, config.repeats)
        decode_t = measure(partial(case.decode, blob), config.repeats)
        formats.append(_record(case.name, len(blob), rows, entropy_bytes, encode_t, decode_t))
    validated = _validated_decoders(trace, config, report)
    by_name = {f["name"]: f for f in formats}
    set_record, sglang_record = by_name["routereplay set"], by_name["SGLang base64 int32"]
    numpy_record = by_name["routereplay set, numpy path"]
    targets = {
        "set_vs_entropy": target(set_record["vs_entropy"], SET_VS_ENTROPY_TARGET),
        "set_smaller_than_sglang_int32": target(
            sglang_record["bytes"] / set_record["bytes"], SET_VS_SGLANG_TARGET, higher_is_better=True
        ),
        "set_decode_seconds": target(set_record["decode_s"]["median"], DECODE_SECONDS_TARGET, rate=True),
        "set_decode_rows_per_s": target(
            set_record["decode_rows_per_s"], DECODE_ROWS_PER_S_TARGET, higher_is_better=True, rate=True
        ),
        "set_encode_rows_per_s": target(
            set_record["encode_rows_per_s"], ENCODE_ROWS_PER_S_TARGET, higher_is_better=True, rate=True
        ),
    }
    anchor = next(f for f in formats if f["name"].startswith("raw "))
    return {
        "suite": "codec",
        "machine": collect(),
        "config": {
            "num_tokens": config.num_tokens,
            "num_layers": config.num_layers,
            "top_k": config.top_k,
            "num_experts": config.num_experts,
            "repeats": config.repeats,
            "seed": config.seed,
            "rows": rows,
        },
        "entropy_bytes_per_row": entropy_bytes,
        "formats": formats,
        "validated_decoders": validated,
        "anchor": {  # the set codec against a memory copy of the same routes, in the same run
            "name": anchor["name"],
            "set_encode_vs_anchor": set_record["encode_rows_per_s"] / anchor["encode_rows_per_s"],
            "set_decode_vs_anchor": set_record["decode_rows_per_s"] / anchor["decode_rows_per_s"],
            "kernel_over_numpy_encode": set_record["encode_rows_per_s"] / numpy_record["encode_rows_per_s"],
            "kernel_over_numpy_decode": set_record["decode_rows_per_s"] / numpy_record["decode_rows_per_s"],
        },
        "targets": targets,
    }


def _validated_decoders(
    trace: RouteTrace, config: CodecBenchConfig, report: Callable[[str], None]
) -> list[dict[str, Any]]:
    """What a trainer pays end to end: wire form -> validated RouteTrace."""
    experts_TLK = trace.experts
    sglang_text = base64.b64encode(experts_TLK.astype(np.int32).tobytes()).decode()
    wire = np.uint8 if trace.num_experts <= 256 else np.uint16
    vllm_text = base64.b64encode(npy_bytes(experts_TLK.astype(wire))).decode()
    blob = codec.encode(trace)
    cases: list[tuple[str, Callable[[], Any]]] = [
        (
            "decode_sglang (base64 int32 -> validated trace)",
            lambda: decode_sglang(
                sglang_text, num_layers=config.num_layers, top_k=config.top_k, num_experts=config.num_experts
            ),
        ),
        (
            "decode_vllm (base64 .npy -> validated trace)",
            lambda: decode_vllm(vllm_text, num_experts=config.num_experts),
        ),
        ("codec.decode + validate()", lambda: codec.decode(blob).validate()),
    ]
    records = []
    for name, function in cases:
        report(name)
        timing = measure(function, config.repeats)
        rows = config.num_tokens * config.num_layers
        records.append({"name": name, "seconds": timing.to_dict(), "rows_per_s": timing.rate(rows)})
    return records


def _record(
    name: str, size: int, rows: int, entropy_bytes: float, encode_t: Timing, decode_t: Timing
) -> dict[str, Any]:
    return {
        "name": name,
        "bytes": size,
        "bytes_per_row": size / rows,
        "vs_entropy": size / rows / entropy_bytes,
        "encode_s": encode_t.to_dict(),
        "decode_s": decode_t.to_dict(),
        "encode_rows_per_s": encode_t.rate(rows),
        "decode_rows_per_s": decode_t.rate(rows),
    }


def markdown(result: dict[str, Any]) -> str:
    """The README / BENCHMARKS.md table for a `run` record."""
    config, machine = result["config"], result["machine"]
    lines = [
        measured_on(machine, "codec", "Python", "numpy", "torch") + " (`--json` for every figure and its spread).",
        "",
        f"T={config['num_tokens']} tokens x L={config['num_layers']} layers, top-{config['top_k']} of "
        f"E={config['num_experts']} experts, {config['repeats']} repeats (median); entropy bound "
        f"{result['entropy_bytes_per_row']:.3f} B per (token, layer) row.",
        "",
        "| format | bytes/row | x entropy | encode rows/s | decode rows/s | decode s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for f in result["formats"]:
        lines.append(
            f"| {f['name']} | {f['bytes_per_row']:.3f} | {f['vs_entropy']:.3f} | {_si(f['encode_rows_per_s'])} | "
            f"{_si(f['decode_rows_per_s'])} | {f['decode_s']['median']:.4f} |"
        )
    anchor = result.get("anchor")
    if anchor:
        lines += [
            "",
            f"Set codec against the {anchor['name']} anchor of the same run: encode "
            f"{anchor['set_encode_vs_anchor']:.3f}x, decode {anchor['set_decode_vs_anchor']:.3f}x its rows/s.",
        ]
        if "kernel_over_numpy_encode" in anchor:
            lines.append(
                f"The set codec's C kernel ({result['machine'].get('set_codec_kernel', '?')}) against its numpy "
                f"path in the same run: encode {anchor['kernel_over_numpy_encode']:.2f}x, decode "
                f"{anchor['kernel_over_numpy_decode']:.2f}x."
            )
    graded = [(name, t) for name, t in result["targets"].items() if name.endswith("rows_per_s")]
    if graded:
        lines += ["", "| target (one core) | rows/s | goal | met |", "|---|---:|---:|---|"]
        for name, t in graded:
            lines.append(f"| {name} | {_si(t['value'])} | {t['direction']} {_si(t['target'])} | {_met(t)} |")
    lines += ["", "| validated decode path | seconds (median) | rows/s |", "|---|---:|---:|"]
    for v in result["validated_decoders"]:
        lines.append(f"| {v['name']} | {v['seconds']['median']:.4f} | {_si(v['rows_per_s'])} |")
    return "\n".join(lines)


def _met(graded: dict[str, Any]) -> str:
    return "met" if graded["met"] else "NOT met"


def _si(value: float) -> str:
    if not math.isfinite(value):
        return "inf"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


__all__ = ["CodecBenchConfig", "markdown", "run"]
