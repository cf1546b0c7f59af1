"""Delivery benchmark: a batch's routes from the driver to each rank, compact against dense.

Three measurements on Qwen3-30B-A3B-shaped routes (48 MoE layers, top-8 of 128), each side by side
in one run:

- `access`: random-access decode of one 8192-token sample kept encoded (`EncodedRoutes.rows`): one
  Ulysses SP rank's slice (1/sp of the tokens) and a small window against the whole sample, with all
  rows routed and with 1% of (token, layer) rows unrouted (validity bitmap + block index);
  interleaved repeats; the time ratio should follow the row fraction;
- `dp`: a batch of samples (lengths uniform in [1024, 8192]) delivered to `dp` data-parallel ranks
  of a real gloo job (`DeliveryJob`): each rank's compact `RankBundle` (`scatter_bundles`) against a
  broadcast of the dense padded int16 [B, S, L, K] batch (`broadcast_dense`); bytes each rank
  receives, and wall time to the rank's replay-ready rows;
- `pipeline`: the same batch end to end from vLLM HTTP response bodies to every SP rank's tensor
  (`ResponsePipeline`): (token, layer) rows per second and each stage's share.

Legend: B = samples, S = padded positions, T = routed rows of a sample, L = layers, K = top-k.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from routereplay.bench import scale_model
from routereplay.bench.config import SampledBenchConfig, require_positive, require_routing
from routereplay.bench.delivery.job import DeliveryJob
from routereplay.bench.delivery.pipeline import STAGES, ResponsePipeline, expected_rank_rows, response_body
from routereplay.bench.environment import collect
from routereplay.bench.store import SampleSource, source_of
from routereplay.bench.timing import interleave, median_ratio, spread, target
from routereplay.codec.encoded import EncodedRoutes
from routereplay.layout import pack, unpad
from routereplay.layout.plan import token_index
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.transport.spans import bundles_for

COMPACT_SHARE = 0.35  # compact routes per rank against the dense batch per rank, times dp
ACCESS_TARGET = 1.5  # (slice seconds / whole seconds) / (slice rows / whole rows)
PIPELINE_ROWS_PER_S_TARGET = 20e6  # issue 26: vLLM JSON to rank tensors, one process, one thread
ACCESS_CASES = {"routed": 0.0, "unrouted_1pct": 0.01}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliveryBenchConfig(SampledBenchConfig):
    dp: int = 4
    sp: int = 4
    window: int = 64
    access_repeats: int = 11

    def __post_init__(self) -> None:
        require_routing(self, "delivery")
        require_positive(self, "delivery", "samples", "seq", "dp", "sp", "window", "access_repeats")
        if not 2 <= self.min_len <= self.seq:
            raise ValueError(f"delivery bench: min_len {self.min_len} must be in [2, seq={self.seq}]")
        if self.samples < self.dp:
            raise ValueError(f"delivery bench: {self.samples} samples cannot give each of dp={self.dp} ranks one")
        if self.sp > self.seq - 1 or self.window > self.seq - 1:
            raise ValueError(
                f"delivery bench: sp={self.sp} and window={self.window} must not exceed the {self.seq - 1} routed "
                "rows of the random-access sample"
            )


def random_access(config: DeliveryBenchConfig, report: Callable[[str], None]) -> list[dict[str, Any]]:
    """Decode times of an SP slice and a window of one encoded sample against the whole of it."""
    rng = np.random.default_rng(config.seed)
    T = config.seq - 1
    chunk = -(-T // config.sp)
    ranges = {"whole": (0, T), "sp_slice": (chunk, min(T, 2 * chunk)), "window": (T // 2, T // 2 + config.window)}
    records = []
    for case, unrouted in ACCESS_CASES.items():
        report(f"random access: {case}")
        trace = random_trace(
            rng,
            num_tokens=T,
            num_layers=config.layers,
            top_k=config.top_k,
            num_experts=config.experts,
            unrouted_fraction=unrouted,
        )
        routes = EncodedRoutes.encode(trace)
        expected_TLK = np.sort(trace.experts, axis=2)
        for begin, end in ranges.values():
            if not np.array_equal(routes.rows(begin, end), expected_TLK[begin:end]):
                raise AssertionError(f"delivery bench: rows [{begin}, {end}) of the {case} sample decode wrong")
        seconds = interleave(
            {name: partial(routes.rows, begin, end) for name, (begin, end) in ranges.items()},
            config.access_repeats,
        )
        fractions = {name: (end - begin) / T for name, (begin, end) in ranges.items() if name != "whole"}
        ratios = {name: median_ratio(seconds[name], seconds["whole"]) for name in fractions}
        records.append({
            "case": case,
            "unrouted_fraction": unrouted,
            "tokens": T,
            "ranges": {name: list(r) for name, r in ranges.items()},
            "seconds": spread(seconds),
            "time_ratio": ratios,
            "row_fraction": fractions,
            "cost_over_share": {name: ratios[name] / fractions[name] for name in fractions},
            "whole_rows_per_s": T * config.layers / statistics.median(seconds["whole"]),
        })  # fmt: skip
    return records


def dp_batch(config: DeliveryBenchConfig, source: SampleSource) -> tuple[RouteStore, torch.Tensor, list[torch.Tensor]]:
    """The batch in a compact store, the dense padded int16 batch of the same route sets, and each DP rank's
    plan (its contiguous share of the samples, packed)."""
    store = RouteStore(num_experts=config.experts, layers=source.layers, top_k=config.top_k)
    positions = max(source.lengths)
    dense_BSLK = torch.full((len(source), positions, config.layers, config.top_k), -1, dtype=torch.int16)
    for i, n in enumerate(source.lengths):
        store.add_turn(i, source.tokens(i), source.trace(source.routes(i)))
        dense_BSLK[i, : n - 1] = torch.from_numpy(store.rows(i, 0, n - 1))
    index_BS = token_index(len(source), positions)
    lengths_B = torch.tensor(source.lengths)
    plans = [
        pack(unpad(index_BS[share], lengths_B[share])).values
        for share in torch.tensor_split(torch.arange(len(source)), config.dp)
    ]
    return store, dense_BSLK, plans


def data_parallel(config: DeliveryBenchConfig, source: SampleSource, report: Callable[[str], None]) -> dict[str, Any]:
    report("dp: building the batch")
    store, dense_BSLK, plans = dp_batch(config, source)
    bundles = bundles_for(store, list(range(len(source))), plans, dense_BSLK.shape[1])
    del store
    job = DeliveryJob(bundles, dense_BSLK, plans, config.repeats).run(report)
    dense_bytes = dense_BSLK.numel() * dense_BSLK.element_size()
    received = job["bytes_received"]
    if received["compact"] != [len(b) for b in bundles] or set(received["dense"]) != {dense_bytes}:
        raise AssertionError(f"delivery bench: ranks received {received}, not their bundles and the dense batch")
    seconds = {f"{method}_{stage}": v for method, stages in job["seconds"].items() for stage, v in stages.items()}
    return {
        "ranks": job["world"],
        "rows_per_rank": job["rows"],
        "bytes_per_rank": received,
        "max_bytes_over_dense": max(received["compact"]) / dense_bytes,
        "seconds": spread(seconds),
        "dense_over_compact": {
            stage: median_ratio(seconds[f"dense_{stage}"], seconds[f"compact_{stage}"])
            for stage in ("collective", "to_rows")
        },
    }


def pipeline(config: DeliveryBenchConfig, source: SampleSource, report: Callable[[str], None]) -> dict[str, Any]:
    report("pipeline: building the vLLM response bodies")
    bodies = [response_body(i, source.tokens(i), source.routes(i), config.experts) for i in range(len(source))]
    job = ResponsePipeline(bodies, config.experts, source.layers, config.top_k, config.sp)
    expected = expected_rank_rows([source.routes(i) for i in range(len(source))], config.sp)
    report("pipeline: checking every rank's rows")
    _, tensors = job.run()
    # each rank's host buffer, kept from step to step as a trainer keeps its (pinned) copy source
    buffers = [torch.empty_like(tensor) for tensor in tensors]
    _, buffered = job.run(buffers)
    for rank, (got, again, want) in enumerate(zip(tensors, buffered, expected, strict=True)):
        if not (torch.equal(got, want) and torch.equal(again, want)):
            raise AssertionError(f"delivery bench: SP rank {rank}'s tensor differs from the routes in the responses")
    del tensors, buffered, expected
    stages: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for repeat in range(config.repeats):
        report(f"pipeline: repeat {repeat + 1}/{config.repeats}")
        seconds, _ = job.run(buffers)
        for stage in STAGES:
            stages[stage].append(seconds[stage])
    totals = [sum(stages[stage][r] for stage in STAGES) for r in range(config.repeats)]
    total = statistics.median(totals)
    medians = {stage: statistics.median(v) for stage, v in stages.items()}
    return {
        "rows": source.rows,
        "body_bytes": sum(len(b) for b in bodies),
        "seconds": spread({**stages, "total": totals}),
        "rows_per_s": source.rows / total,
        "share": {stage: medians[stage] / sum(medians.values()) for stage in STAGES},
    }


def run(config: DeliveryBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    report = progress or (lambda _step: None)
    access = random_access(config, report)
    report("generating the batch")
    source = source_of(config)
    dp = data_parallel(config, source, report)
    end_to_end = pipeline(config, source, report)
    worst_access = max(a["cost_over_share"]["sp_slice"] for a in access)
    record = {
        "suite": "delivery",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in DeliveryBenchConfig.__dataclass_fields__},
        "tokens": sum(source.lengths),
        "rows": source.rows,
        "payload_bytes": source.rows * config.top_k * 2,
        "access": access,
        "dp": dp,
        "pipeline": end_to_end,
        "targets": {
            "compact_bytes_per_rank_over_dense": target(dp["max_bytes_over_dense"], COMPACT_SHARE / config.dp),
            "sp_slice_decode_cost_over_row_share": target(worst_access, ACCESS_TARGET),
            "pipeline_rows_per_s": target(
                end_to_end["rows_per_s"], PIPELINE_ROWS_PER_S_TARGET, higher_is_better=True, rate=True
            ),
        },
    }
    record["scale"] = scale_model.predict(record)  # the same run's rates at cluster scale, checked against its job
    return record


def markdown(result: dict[str, Any]) -> str:
    config, machine = result["config"], result["machine"]
    mib = 2**20
    lines = [
        f"Measured on {machine['processor']} ({machine['cpu_count']} cores), torch {machine['torch']}, numpy "
        f"{machine['numpy']}, by `routereplay bench delivery`; {config['layers']} layers, top-{config['top_k']} of "
        f"{config['experts']}.",
        "",
        f"Random access into one encoded {result['access'][0]['tokens']}-row sample (`EncodedRoutes.rows`), "
        f"{config['access_repeats']} interleaved repeats:",
        "",
        "| sample | rows decoded | seconds (median) | x whole | row fraction | cost / share |",
        "|---|---|---:|---:|---:|---:|",
    ]
    names = {"whole": "whole sample", "sp_slice": f"SP={config['sp']} rank 1's slice", "window": "window"}
    for access in result["access"]:
        for name, (begin, end) in access["ranges"].items():
            ratio = access["time_ratio"].get(name, 1.0)
            fraction = access["row_fraction"].get(name, 1.0)
            lines.append(
                f"| {access['case']} | {names[name]} [{begin}, {end}) | {access['seconds'][name]['median']:.5f} | "
                f"{ratio:.3f} | {fraction:.3f} | {ratio / fraction:.2f} |"
            )
    dp = result["dp"]
    compact, dense = dp["bytes_per_rank"]["compact"], dp["bytes_per_rank"]["dense"]
    seconds = dp["seconds"]
    lines += [
        "",
        f"DP={dp['ranks']} delivery over gloo (4 processes on 127.0.0.1, 1 thread each) of {config['samples']} samples "
        f"({result['tokens']} tokens, lengths uniform in [{config['min_len']}, {config['seq']}]; unpadded int16 "
        f"payload {result['payload_bytes'] / mib:.1f} MiB), {config['repeats']} repeats, slowest rank per repeat:",
        "",
        "| delivery | MiB per rank (max) | x dense | send s (median) | to rows s (median) | low | high |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| compact `RankBundle` per rank (`scatter_bundles`) | {max(compact) / mib:.2f} | "
        f"{dp['max_bytes_over_dense']:.4f} | {seconds['compact_collective']['median']:.4f} | "
        f"{seconds['compact_to_rows']['median']:.4f} | {seconds['compact_to_rows']['low']:.4f} | "
        f"{seconds['compact_to_rows']['high']:.4f} |",
        f"| dense padded int16 batch (`broadcast_dense`) | {max(dense) / mib:.2f} | 1 | "
        f"{seconds['dense_collective']['median']:.4f} | {seconds['dense_to_rows']['median']:.4f} | "
        f"{seconds['dense_to_rows']['low']:.4f} | {seconds['dense_to_rows']['high']:.4f} |",
        "",
        f"Dense / compact time: {dp['dense_over_compact']['collective']:.1f}x to send, "
        f"{dp['dense_over_compact']['to_rows']:.1f}x to each rank's replay-ready rows.",
    ]
    end = result["pipeline"]
    lines += [
        "",
        f"vLLM HTTP responses (base64 `.npy`, {end['body_bytes'] / mib:.1f} MiB of JSON) to SP={config['sp']} ranks' "
        f"tensors, end to end in one process on one thread: {end['rows_per_s'] / 1e6:.2f}M (token, layer) rows/s "
        f"({end['seconds']['total']['median']:.3f} s median of {config['repeats']}; target >= "
        f"{PIPELINE_ROWS_PER_S_TARGET / 1e6:.0f}M: {_met(result['targets']['pipeline_rows_per_s'])}).",
        "",
        "| stage | seconds (median) | share |",
        "|---|---:|---:|",
    ]
    stage_names = {
        "decode": "json.loads + decode_vllm (validate=False)",
        "store": "RouteStore.add_turn (validated while encoded)",
        "plan": "pack + ulysses_shard plans",
        "bundles": "bundles_for (cut, no decode)",
        "ranks": "RankBundle decode -> each rank's reused host buffer (to_torch(out=))",
    }
    for stage in STAGES:
        lines.append(f"| {stage_names[stage]} | {end['seconds'][stage]['median']:.4f} | {end['share'][stage]:.1%} |")
    if "scale" in result:
        lines += ["", scale_model.markdown(result["scale"])]
    return "\n".join(lines)


def _met(graded: dict[str, Any]) -> str:
    return "not graded" if graded.get("met") is None else "met" if graded["met"] else "NOT met"


__all__ = ["DeliveryBenchConfig", "data_parallel", "dp_batch", "markdown", "pipeline", "random_access", "run"]
